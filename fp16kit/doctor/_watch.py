"""``doctor.watch``: sample gradients into exponent histograms on the device, every N steps, no host sync.

**What a step is.** One forward of the watched model with autograd enabled (a training forward),
counted by a forward pre-hook on the model. Steps ``0, N, 2N, ...`` are *sampled*: their forward arms
the hooks below, the backward that follows fills the histograms, and the next forward disarms them. So
nothing has to be called per step, and an unsampled step costs one Python pre-hook call. (With gradient
accumulation every micro-batch's forward is a step; a forward under ``torch.no_grad()`` is not.)

**What is sampled.** In the sampled backward:

- parameter gradients: one ``torch.autograd.graph.register_multi_grad_hook`` over every parameter that
  requires grad; it fires once all of this backward's parameter gradients exist and histograms them in
  one ``fp16kit.kernels.exponent_histogram`` call (one launch per dtype). These are the gradients of this
  backward alone (not the accumulated ``.grad``), before any unscaling, clipping or optimizer step.
- with ``activations=True``, activation gradients: the gradient of every leaf module's output(s), the
  ``grad_output`` a full backward hook would see. It is taken with a tensor hook that the module's
  forward hook puts on its output, not with ``register_full_backward_hook``: the full hook wraps every
  module call in an extra autograd node (even on unsampled steps, since it must exist at forward time),
  breaks on in-place outputs, and warns about the first layer (whose input needs no grad) in every backward.

Both are the raw backward values, i.e. ``S * g`` when the loss was multiplied by a loss scale ``S``.
The watcher divides ``S`` out: it reads the watched ``scaler``'s scale *tensor* in the hook and shifts
the histogram by ``-log2(S)`` with device-side indexing (``S`` a power of two makes this exact; another
``S`` is rounded down to a power of two), so the accumulated histograms describe the unscaled
gradients, whatever the scale was at each sample, and ``report`` can ask what any other scale would do.

With activations, the sampled forward also notes which watched module consumed each module's output (a
forward pre-hook compares its inputs with the outputs seen so far, by identity): a module's output gradient
is computed by its consumers' backward, so the code that keeps it fp32 names them (``_report.fix_for``).
Each entry also records the dtypes its gradients came in (metadata, no sync): a mixed-precision run shows
which ones were fp32 already.

Float64 gradients are histogrammed as fp32 (``exponent_histogram`` covers fp32's range). Everything
stays on the device until :meth:`Watcher.report`, which reads the counts back once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..kernels import exponent_histogram
from ..kernels.histogram import MIN_EXP, NUM_BINS, ZERO_BIN
from ._report import NUM_EXPONENTS, TRUE_MIN_EXP, Entry, Report, check_report_args, scale_exponent

__all__ = ["Watcher", "watch"]

_WIDTH = NUM_EXPONENTS + 3  # unscaled exponents, then zeros, infs, NaNs


def _scale_reader(scaler: Any) -> tuple[Callable[[], torch.Tensor | float | None], str]:
    """A function giving the current loss scale (a device tensor where the scaler keeps one), and a name.

    Accepts fp16kit's ``LossScaler`` (apex-style amp: ``optimizer._amp_stash.session.scalers[0]``) and
    ``GradScaler``, torch's ``GradScaler``, a Python float (a static scale) or a tensor.
    """
    if scaler is None:
        return (lambda: None), "none (loss not scaled)"
    if isinstance(scaler, (int, float)):
        value = float(scaler)
        return (lambda: value), f"static {value:g}"
    if isinstance(scaler, torch.Tensor):
        return (lambda: scaler), "tensor"
    if hasattr(scaler, "loss_scaler") and hasattr(scaler, "get_scale"):  # fp16kit.amp.GradScaler

        def fp16kit_grad_scaler() -> torch.Tensor | float | None:
            inner = scaler.loss_scaler
            if inner is not None:
                return inner.scale
            return scaler.get_scale() if scaler.is_enabled() else None  # not started yet: a host float

        return fp16kit_grad_scaler, type(scaler).__name__
    if isinstance(getattr(scaler, "scale", None), torch.Tensor):  # fp16kit.amp LossScaler
        return (lambda: scaler.scale), type(scaler).__name__
    if hasattr(scaler, "_scale") and hasattr(scaler, "is_enabled"):  # torch.amp.GradScaler

        def torch_grad_scaler() -> torch.Tensor | float | None:
            if not scaler.is_enabled():
                return None
            return scaler._scale if scaler._scale is not None else float(scaler._init_scale)

        return torch_grad_scaler, type(scaler).__name__
    raise TypeError(
        f"doctor.watch: scaler must be an fp16kit LossScaler or GradScaler, a torch.amp.GradScaler, a float or a "
        f"tensor (the loss scale); got {type(scaler).__name__}."
    )


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name or type(m).__name__, m) for name, m in model.named_modules() if not any(True for _ in m.children())]


class Watcher:
    """Accumulates exponent histograms of a model's gradients; use through :func:`watch`."""

    def __init__(self, model: nn.Module, every: int = 100, activations: bool = False, scaler: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"doctor.watch: model must be a torch.nn.Module, got {type(model).__name__}.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"doctor.watch: every must be an integer >= 1 (sample every N-th step), got {every!r}.")
        self.model, self.every, self.activations = model, every, bool(activations)
        self._read_scale, self.scale_source = _scale_reader(scaler)
        self._scaler_kind = None if scaler is None else type(scaler).__name__
        self._scaler_given = scaler is not None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named and not activations:
            raise ValueError("doctor.watch: the model has no parameter that requires grad: nothing to watch.")
        self._params = [p for _, p in named]
        self._leaves = _leaf_modules(model) if activations else []
        self._names = [n for n, _ in named] + [n for n, _ in self._leaves]
        self._kinds = ["param"] * len(named) + ["activation"] * len(self._leaves)
        self._modules = [self._owner(n) for n, _ in named] + [type(m).__name__ for _, m in self._leaves]
        self._dtypes: list[set[torch.dtype]] = [set() for _ in self._names]
        self._produced: dict[int, tuple[int, Any]] = {}  # id(output) -> (leaf index, weakref), sampled forward
        self._consumers: dict[int, set[int]] = {}  # leaf index -> indices of the leaves that consumed its output
        # created at the first sample, on the gradients' device (the model may move after watch() is called)
        self._acc: torch.Tensor | None = None
        self._cols_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
        self.steps = 0  # training forwards seen
        self.samples = 0  # sampled backwards that reached the parameter hook
        self._armed: list[Any] = []
        self._handles: list[Any] = []
        self._open = False

    def _owner(self, param_name: str) -> str:
        module_name = param_name.rpartition(".")[0]
        return type(self.model.get_submodule(module_name)).__name__ if module_name else type(self.model).__name__

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Watcher:
        if self._open:
            raise RuntimeError("doctor.watch: this watcher is already active; use one `with` block at a time.")
        self._open = True
        self._handles = [self.model.register_forward_pre_hook(self._on_forward)]
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook (the histograms are kept: ``report`` still works)."""
        self._disarm()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._open = False

    # ------------------------------------------------------------------ hooks
    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._disarm()
        sampled = self.steps % self.every == 0
        self.steps += 1
        if not sampled:
            return
        if self._params:
            self._armed.append(torch.autograd.graph.register_multi_grad_hook(self._params, self._on_param_grads))
        for i, (_, leaf) in enumerate(self._leaves):
            self._armed.append(leaf.register_forward_pre_hook(self._consumer_hook(i)))
            self._armed.append(leaf.register_forward_hook(self._activation_hook(len(self._params) + i)))

    def _disarm(self) -> None:
        for h in self._armed:
            h.remove()
        self._armed = []
        self._produced.clear()

    def _consumer_hook(self, leaf: int) -> Callable[..., None]:
        """A forward pre-hook noting which earlier leaves' outputs this leaf takes as inputs."""

        def pre_hook(module: nn.Module, args: Any) -> None:
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    seen = self._produced.get(id(arg))
                    if seen is not None and seen[1]() is arg and seen[0] != leaf:
                        self._consumers.setdefault(seen[0], set()).add(leaf)

        return pre_hook

    def _shift(self, device: torch.device) -> torch.Tensor:
        """``s = floor(log2 S)`` of the current loss scale, an int64 tensor on ``device`` (no host sync)."""
        scale = self._read_scale()
        if scale is None:
            return torch.zeros((), dtype=torch.int64, device=device)
        if isinstance(scale, torch.Tensor):
            _, k = torch.frexp(scale.detach().reshape(()).to(device=device, dtype=torch.float32))
            return (k.to(torch.int64) - 1).clamp(-149, 127)
        _, k = np.frexp(float(scale))
        return torch.full((), int(k) - 1, dtype=torch.int64, device=device)

    def _columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where observed column j lands in the accumulator for a scale exponent 0, and which are exponents."""
        cached = self._cols_cache.get(device)
        if cached is None:
            j = torch.arange(NUM_BINS, device=device)
            is_exp = j < ZERO_BIN
            # exponent column j is exponent MIN_EXP + j; the accumulator's column 0 is exponent TRUE_MIN_EXP
            base = torch.where(is_exp, j + (MIN_EXP - TRUE_MIN_EXP), j - ZERO_BIN + NUM_EXPONENTS)
            cached = self._cols_cache[device] = (base, is_exp.to(torch.int64))
        return cached

    def _rows(self, rows: list[int], device: torch.device) -> torch.Tensor:
        """Accumulator rows as a device tensor, cached. The usual cases (all parameters; one module) are a
        range, made on the device; another subset is copied from the host once (a blocking copy on CUDA)."""
        key = (device, tuple(rows))
        t = self._rows_cache.get(key)
        if t is None:
            if rows == list(range(rows[0], rows[0] + len(rows))):
                t = torch.arange(rows[0], rows[0] + len(rows), dtype=torch.int64, device=device)
            else:
                t = torch.tensor(rows, dtype=torch.int64).to(device)
            self._rows_cache[key] = t
        return t

    def _accumulate(self, rows: list[int], tensors: list[torch.Tensor]) -> None:
        """Histogram ``tensors`` (observed, scaled values) into the accumulator rows, unscaled."""
        by_device: dict[torch.device, list[int]] = {}
        for row, t in zip(rows, tensors):
            self._dtypes[row].add(t.dtype)
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        for device, idx in by_device.items():
            if self._acc is None:
                self._acc = torch.zeros(len(self._names), _WIDTH, dtype=torch.int64, device=device)
            group = [tensors[i].float() if tensors[i].dtype == torch.float64 else tensors[i] for i in idx]
            counts = exponent_histogram(group)
            dest = [rows[i] for i in idx]
            base, is_exp = self._columns(device)
            cols = base - is_exp * self._shift(device)
            n = counts.shape[0]
            index = (self._rows(dest, device)[:, None].expand(n, NUM_BINS), cols[None, :].expand(n, NUM_BINS))
            if device != self._acc.device:
                index = (index[0].to(self._acc.device), index[1].to(self._acc.device))
                counts = counts.to(self._acc.device)
            self._acc.index_put_(index, counts, accumulate=True)

    def _on_param_grads(self, grads: Any) -> None:
        rows, tensors = [], []
        for i, g in enumerate(grads):
            if g is None:
                continue
            if g.layout != torch.strided:
                g = g.coalesce().values()
            rows.append(i)
            tensors.append(g)
        if tensors:
            self._accumulate(rows, tensors)
        self.samples += 1

    def _activation_hook(self, row: int) -> Callable[..., None]:
        """A forward hook that puts a gradient hook on each floating output that requires grad."""

        def on_grad(g: torch.Tensor) -> None:
            if g.layout == torch.strided:
                self._accumulate([row], [g])

        def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for out in outputs:
                if isinstance(out, torch.Tensor) and out.requires_grad and out.is_floating_point():
                    out.register_hook(on_grad)
                    self._produced[id(out)] = (row - len(self._params), weakref.ref(out))

        return forward_hook

    # ------------------------------------------------------------------ results
    def histograms(self) -> torch.Tensor:
        """The accumulated counts, int64 ``[entries, NUM_EXPONENTS + 3]`` on the device (unscaled exponents
        ``TRUE_MIN_EXP..TRUE_MAX_EXP``, then zeros, infs, NaNs). No host sync. Zeros on the CPU before the
        first sample."""
        if self._acc is None:
            return torch.zeros(len(self._names), _WIDTH, dtype=torch.int64)
        return self._acc

    def reset(self) -> None:
        """Forget the accumulated histograms (and the sample count)."""
        self._acc = None
        self.samples = 0
        self._dtypes = [set() for _ in self._names]
        self._consumers = {}

    def report(
        self,
        dtype: torch.dtype = torch.float16,
        loss_scale: float | None = None,
        *,
        keep: float = 0.99,
        fp32_threshold: float = 0.01,
    ) -> Report:
        """What the sampled gradients would become when scaled by ``loss_scale`` and cast to ``dtype``.

        Args:
            dtype: the format the table and picture lead with (``torch.float16`` or ``torch.bfloat16``;
                the report always holds both).
            loss_scale: a power of two; ``None`` means the scale the run used, i.e. the watched scaler's current
                scale, or, with no scaler watched, the one recommended for ``dtype`` (``Report.scale_basis`` says
                which; ``_report.recommended_scale_exp`` how it is chosen).
            keep: the share of nonzero values the recommended range keeps at or above the smallest normal.
            fp32_threshold: an entry losing more than this share (flush + overflow) is listed to stay fp32.

        .. warning:: Reads the histograms back to the host (one sync), and the watched scaler's scale.
        """
        check_report_args(dtype, keep, fp32_threshold)
        current = self._read_scale()
        run_exp = 0
        if current is not None:
            value = float(current.reshape(()).item() if isinstance(current, torch.Tensor) else current)
            run_exp = int(np.frexp(value)[1]) - 1  # not a power of two: rounded down, as in the histograms
        scale_exp: int | None = None
        if loss_scale is not None:
            scale_exp, source, basis = scale_exponent(loss_scale), "given", "given"
        elif current is None:
            source, basis = "no scaler watched" if not self._scaler_given else "scaler disabled", "recommended"
        else:
            scale_exp, source, basis = run_exp, f"the run's: watched scaler ({self.scale_source})", "run"
        acc = self.histograms().cpu().numpy()
        entries = [
            Entry(name, kind, module, acc[i, :NUM_EXPONENTS].copy(), *(int(v) for v in acc[i, NUM_EXPONENTS:]),
                  tuple(sorted(str(d).replace("torch.", "") for d in self._dtypes[i])))
            for i, (name, kind, module) in enumerate(zip(self._names, self._kinds, self._modules))
        ]
        first = len(self._params)
        consumers = {self._names[first + i]: [self._names[first + j] for j in sorted(js)]
                     for i, js in self._consumers.items()}
        return Report(entries, dtype=dtype, scale_exp=scale_exp, scale_source=source, steps=self.steps,
                      samples=self.samples, every=self.every, keep=keep, fp32_threshold=fp32_threshold,
                      scale_basis=basis, scaler=self._scaler_kind if self._scaler_given else None,
                      consumers=consumers, run_scale_exp=run_exp)


def watch(model: nn.Module, every: int = 100, activations: bool = False, scaler: Any = None) -> Watcher:
    """Watch ``model``'s gradients: ``with doctor.watch(model, every=100) as w: ...; w.report()``.

    Args:
        model: the module whose forward is called once per training step.
        every: sample steps ``0, every, 2*every, ...`` (a step is one forward with autograd enabled).
        activations: also histogram every leaf module's output gradient (its ``grad_output``).
        scaler: what multiplies the loss: fp16kit's ``LossScaler`` (apex-style amp) or ``GradScaler``,
            torch's ``GradScaler``, a float or a tensor; ``None`` for an unscaled loss.

    See ``fp16kit/doctor/_watch.py`` for what a step is and what is sampled, and ``docs/doctor.md``.
    """
    return Watcher(model, every=every, activations=activations, scaler=scaler)

