"""What FusedSGD, FusedAdagrad and FusedNovoGrad share on top of ``FusedOptimizer`` (``_base.py``): their own
per-param state (checked against the params), row collection and hyper-parameter checks. The update of a group
is a public op of ``fp16kit.kernels`` (``sgd_update``, ``adagrad_update``, ``novograd_update``:
fp16kit/kernels/optimizers.py, which plans the rows between the Triton kernels and the torch fallback).

``FusedOptimizer.step`` runs unchanged: one check pass over the grads (raising ``found_inf`` on inf/NaN,
unscaling by ``grad_scale`` under a GradScaler), the result check (``_check_results``: every group's update with
``verify=True``, storing nothing, raising ``found_inf`` when the step would store an inf/NaN; docs/guarantees.md
2.15), then ``_update_group`` per group, a no-op on the device when ``found_inf`` is set. Checkpoints of another
optimizer class are refused naming both (``_checkpoint.refuse_foreign``), torch's SGD/Adagrad state imported.
A subclass names its state (``_state_spec``: key -> ``"param"`` for a tensor shaped like the param,
``"scalar"`` for a one-element tensor) and fills it in ``_init_state``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import required

from fp16kit.kernels import DeviceStep, check_found_inf
from fp16kit.kernels.optimizers import StepVerify

from . import functional as F
from ._base import FusedOptimizer
from ._checkpoint import TORCH_FLAGS, check_state_values, refuse_foreign
from ._context import capturing
from ._sharding import ShardedSteps
from ._state import LOW_PRECISION
from ._validate import FP32_MAX, _number, check_sparse_grad, check_step_value, naming_group

__all__ = ["ApexRows", "ApexStateOptimizer", "check_range", "check_state", "hparams64", "widen_state"]

F64 = torch.float64




def check_range(
    fn: str,
    name: str,
    value: Any,
    *,
    low: float = 0.0,
    low_open: bool = False,
    high: float = FP32_MAX,
    hint: str = "",
) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` when ``low_open``); a clear error otherwise.

    ``high`` defaults to float32's maximum: a larger host value would round to inf in the kernels' float32
    math. Values that are in range but still overflow an update (``lr=1e30`` with large grads) are caught on
    the device by the result check (docs/guarantees.md, 2.15)."""
    number = _number(fn, name, value)
    if number is None:
        raise ValueError(f"{fn}: {name} must be a Python number here, got a tensor {value!r}.")
    ok = number > low if low_open else number >= low
    if not (ok and number <= high):
        bound = f"> {low}" if low_open else f">= {low}"
        top = "float32's maximum 3.4028235e+38" if high == FP32_MAX else repr(high)
        raise ValueError(f"{fn}: invalid {name}={value!r}; it must be a finite number {bound} and <= {top}{hint}.")
    return number


def check_lr(fn: str, lr: Any) -> None:
    """A float lr >= 0 (finite), or a one-element floating tensor (on the device: not read, no sync)."""
    if lr is required:
        raise TypeError(
            f"{fn}: lr is required (as in torch.optim.SGD and apex): pass lr=..., or set 'lr' in every param group."
        )
    if isinstance(lr, torch.Tensor):
        _number(fn, "lr", lr)
        return
    if isinstance(lr, Real) and not isinstance(lr, bool):
        check_range(fn, "learning rate lr", lr)
        return
    raise TypeError(f"{fn}: lr must be a real number or a one-element floating tensor, got {lr!r}.")


def hparams64(
    lr: Any, values: Sequence[float], device: torch.device, tail: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """float64 ``[lr, *values, *tail]`` on ``device`` (host constants cached, ``lr`` may be a device tensor)."""
    parts = [F._scalar64("lr", lr, device)]
    if values:
        parts.append(F._constant(tuple(float(v) for v in values), device))
    parts += [t.reshape(1).to(F64) for t in tail]
    return torch.cat(parts)


@dataclass
class ApexRows:
    """One group's tensors paired by position (params with a grad only)."""

    params: list[torch.Tensor] = field(default_factory=list)  # fp32 masters in master-weights mode
    grads: list[torch.Tensor] = field(default_factory=list)
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    models: list[torch.Tensor | None] = field(default_factory=list)
    new: list[bool] = field(default_factory=list)  # state created in this step

    def state(self, key: str) -> list[torch.Tensor]:
        return [s[key] for s in self.states]


class ApexStateOptimizer(ShardedSteps, FusedOptimizer):
    """``FusedOptimizer`` with a subclass-defined per-param state instead of Adam's moments."""

    _state_spec: ClassVar[dict[str, str]] = {}
    #: the writers (``_checkpoint.writer_of``) whose state dicts this class loads; another's is refused
    _accepts: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], *, set_grad_none: bool, master_weights: bool,
        on_nonfinite: str, capturable: bool,
    ) -> None:
        # ``capturable`` is accepted as torch's: the step already captures into a CUDA graph (docs/optim.md, "The
        # step on the device")
        self.capturable = bool(capturable)
        super().__init__(
            params, defaults, set_grad_none=set_grad_none, master_weights=master_weights, on_nonfinite=on_nonfinite
        )

    def _check_group(self, group: dict[str, Any]) -> None:
        """``lr`` (:func:`check_lr`), then the subclass's own hyper-parameters (``_check_hparams``)."""
        check_lr(self._name, group["lr"])
        self._check_hparams(group)

    def _check_hparams(self, group: dict[str, Any]) -> None:
        """Check the group's hyper-parameters other than ``lr`` (a clear ``ValueError`` naming the bad one)."""

    def _init_state(self, p: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any]) -> None:
        """Fill a new param's state (besides the master); state tensors use ``_math_dtype(p)``."""
        raise NotImplementedError

    @staticmethod
    def _math_dtype(p: torch.Tensor) -> torch.dtype:
        return F64 if p.dtype == F64 else torch.float32

    def _state_for_group(self, p: torch.Tensor, index: int, group: dict[str, Any]) -> tuple[dict, bool]:
        """``(state, new)``: the param's state, created on first use (``new``); an existing state is checked
        against the param."""
        state = self.state[p]
        if not state:
            if self.master_weights and p.dtype in LOW_PRECISION:
                state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            self._init_state(p, state, group)
            return state, True
        self._check_state(p, index, state)
        # A checkpoint may lack some entries (apex's NovoGrad keeps its second moment in the group, torch's SGD
        # may save ``momentum_buffer=None``): create them, and count the param as new for them.
        if all(state.get(k) is not None for k in self._state_spec):
            return state, False
        fresh: dict[str, torch.Tensor] = {}
        self._init_state(p, fresh, group)
        missing = [k for k in fresh if state.get(k) is None]
        for k in missing:
            state[k] = fresh[k]
        return state, bool(missing)

    def _check_state(self, p: torch.Tensor, index: int, state: dict[str, Any]) -> None:
        check_state(self._name, p, index, state, self._state_spec, self._math_dtype(p))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint: validated, then committed; on any error the optimizer keeps its old state.

        Saved dtypes are kept (``torch.optim.Optimizer`` would cast fp32 state to an fp16 param's dtype) and
        fp16/bf16 state from an apex checkpoint (apex keeps state in the param dtype) is widened to fp32,
        exactly. Every state tensor must belong to its param (``check_state``) and be finite; every group's
        hyper-parameters and step counter must be valid. Entries a checkpoint lacks (apex NovoGrad's per-param
        moment, a ``None`` momentum buffer) are created at the next step. One host read for the values.
        """
        fn = f"{self._name}.load_state_dict"
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"{fn}: expected a dict with 'state' and 'param_groups' (a state_dict()).")
        writer = refuse_foreign(self._name, state_dict, self._accepts or (self._name,))
        state_dict = self._import(state_dict, writer)
        old_groups, old_state = self.param_groups, self.state
        try:
            torch.optim.Optimizer.load_state_dict(self, state_dict)
            saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            entries = []
            for gi, group in enumerate(self.param_groups):
                with naming_group(gi):
                    self._check_group(group)
                if "step" in group:
                    step = group["step"]
                    check_step_value(fn, gi, float(step.reshape(()) if isinstance(step, torch.Tensor) else step))
            params = [(gi, i, p) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])]
            for idx, (gi, i, p) in zip(saved_ids, params):
                saved = state_dict["state"].get(idx, {})
                state = self.state[p]
                for key, value in saved.items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        state[key] = value.detach().to(p.device, copy=True)
                        entries.append((gi, i, key, state[key]))
                widen_state_of(state, self._state_spec)
                if state:
                    self._check_state(p, i, state)
            check_state_values(fn, entries)
        except BaseException:
            self.param_groups, self.state = old_groups, old_state
            raise
        self._adopt_counters()

    def _import(self, state_dict: dict[str, Any], writer: str) -> dict[str, Any]:
        """A copy of an accepted ``state_dict`` in this class's form: torch's flags checked (``maximize=True``
        fails) and dropped, missing hyper-parameters taken from the defaults, torch's per-param ``step`` dropped
        (these optimizers keep none, or one per group). Subclasses check what else torch's class may differ in."""
        fn = f"{self._name}.load_state_dict"
        groups = []
        for gi, saved in enumerate(state_dict["param_groups"]):
            group = dict(saved)
            if group.pop("maximize", False):
                raise ValueError(
                    f"{fn}: the checkpoint's param_groups[{gi}] has maximize=True ({writer}); {self._name} "
                    f"minimizes. Negate the loss instead, and start afresh."
                )
            for key in TORCH_FLAGS:
                group.pop(key, None)
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            groups.append(group)
        state = state_dict["state"]
        if writer.startswith("torch.optim."):
            state = {k: {n: v for n, v in s.items() if n != "step"} for k, s in state.items()}
        return {**state_dict, "param_groups": groups, "state": state}

    def _check_results(self, all_rows: list, inv_scale64: torch.Tensor, found_inf: torch.Tensor) -> None:
        """The result check (docs/guarantees.md, 2.15): every group's update runs once with ``verify=True``
        (the kernels' ``VERIFY`` pass, ``fp16kit/kernels/engine/results.py``, or the fallback on copies), writing
        nothing but raising ``found_inf`` when a param, model copy or state value would become inf/NaN. It runs
        for all groups before any is written, so a step is taken whole or not at all; the loss scaler then backs
        off (or ``on_nonfinite`` reports it) as for an inf gradient. On the device, no host sync.

        ``result_skips`` counts the steps this check skipped. Without a scaler the step reports them per
        ``on_nonfinite`` with its non-finite skips; with a handed-over flag they are reported here too: a scaler
        that decides its scale from its own copy of the flags (``torch.amp.GradScaler``) or before the step
        (the amp frontend, as apex) cannot back off for them."""
        if not any(rows.params for rows in all_rows):
            return
        before = found_inf.clone()
        for group, rows in zip(self.param_groups, all_rows):
            if not rows.params:
                continue
            device = rows.params[0].device
            step = group.get("step", 0)
            # the counter this update would use (advanced only for a step that is taken); a fill, not a copy
            if isinstance(step, torch.Tensor):
                t = step.reshape(1).to(device, torch.float32) + 1
            else:
                t = torch.full((1,), float(step) + 1, dtype=torch.float32, device=device)
            self._update_group(group, rows, t, inv_scale64, found_inf, None, verify=True)  # type: ignore[call-arg]
        result = found_inf.reshape(1) - before.reshape(1)  # 1 where this check raised the flag
        self._count("result_skips", result, found_inf.device)
        if getattr(self, "found_inf", None) is not None:
            self._report(result, self._result_message)

    @property
    def result_skips(self) -> torch.Tensor | None:
        """Steps skipped because their update would have stored inf/NaN from finite inputs (a one-element int64
        device tensor; None before the first such check)."""
        return self.__dict__.get("_skip_counts", {}).get("result_skips")

    def _result_message(self) -> str:
        return (
            f"{self._name}: this step's update would have written inf/NaN (finite gradients, but too large for "
            f"the update: e.g. Adagrad's g * g, a momentum buffer, lr * g); the step was skipped (params, state "
            f"and step counters are unchanged; optimizer.result_skips counts such steps). Lower the learning rate "
            f"or check the gradients' magnitude."
        )

    # -- the device-resident step (docs/optim.md, "The step on the device") ---------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """``FusedOptimizer.step``; the rows ``_collect`` kept for ``_on_device`` are let go after it (a step that
        ends early must not keep this step's grads alive)."""
        try:
            return super().step(closure)
        finally:
            if not torch.compiler.is_compiling():
                self._release_step_rows()

    def _release_step_rows(self) -> None:
        self._step_cache.pop("apex_rows", None)

    def _steps_eagerly_under_compile(self) -> bool:
        return True  # apex's passes have no dispatcher op (FusedOptimizer._steps_eagerly_under_compile)

    def _update_group(  # type: ignore[override]
        self,
        group: dict[str, Any],
        rows: ApexRows,
        step: torch.Tensor,
        inv_scale64: torch.Tensor,
        found_inf: torch.Tensor,
        grad_norm: torch.Tensor | None,
        verify: bool = False,
    ) -> None:
        """``FusedOptimizer``'s per-group update (and ``_check_results``'s ``verify=True`` pass): the subclass's
        ``_host_update`` on the group's rows on ``device``, nothing for a group without grads."""
        if rows.params:
            self._host_update(group, rows, step, inv_scale64, found_inf, rows.params[0].device, verify=verify)

    def _host_update(
        self, group: dict[str, Any], rows: ApexRows, step: torch.Tensor, inv_scale64: torch.Tensor,
        found_inf: torch.Tensor, device: torch.device, *, verify: bool = False,
    ) -> None:
        """One group's update op with float64 hyper-parameters built on the host (``hparams64``)."""
        raise NotImplementedError

    @staticmethod
    def _apex_device_step(base: DeviceStep, lr: Any, host: dict[str, float], **extra: Any) -> DeviceStep:
        """``base`` with the update's host constants (``lr`` first: 0.0 for a tensor ``lr``, which the kernel reads
        from the device) and the device lr."""
        host = {"lr": 0.0 if isinstance(lr, torch.Tensor) else float(lr), **host}
        return dataclasses.replace(base, host=host, lr=F.device_lr(lr, base.step.device), **extra)

    def _device_ready(self, group: dict[str, Any], rows: ApexRows) -> bool:
        """Do the Triton kernels take every row of this group (the update op planned with ``plan_only``)? A
        subclass with a device step answers; the others never step on the device."""
        return False

    def _on_device(self, device: torch.device) -> bool:
        """``FusedOptimizer._on_device``, and every group's rows in the kernels' groups (rows the torch fallback
        takes, e.g. float64 or non-contiguous params, keep the whole step on the host-vector path)."""
        rows = self._step_cache.pop("apex_rows", None)
        if rows is None or not super()._on_device(device):
            return False
        return all(self._device_ready(g, r) for g, r in zip(self.param_groups, rows) if r.params)

    def _step_on_device(self, all_rows: list, device: torch.device) -> None:  # type: ignore[override]
        """``step`` with nothing copied from the host and nothing read back (CUDA-graph capturable): per group and
        dtype combination, one check-and-verify launch (the grads' inf/NaN check and the result check in one read,
        finished on the device: flag, ``result_skips``, ``nonfinite_skips``), then after all of them the update
        launch, which derives the hyper-parameters on the device and advances the step counter. Same results,
        bit for bit, as the host-vector step (``FusedOptimizer.step``'s check pass, ``_check_results``, updates)."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        own_flag = found_inf is None
        if own_flag:
            found_inf = self._device_buffers(device)["flag"]
        else:
            check_found_inf(f"{self._name}.step", found_inf, device)
        check = StepVerify(
            result=self._result_buffer(device),
            result_count=self._counter("result_skips", device),
            nonfinite_count=self._counter("nonfinite_skips", device) if own_flag else None,
            own_flag=own_flag,
        )
        work = []
        for gi, (group, rows) in enumerate(zip(self.param_groups, all_rows)):
            step = self._own_step(gi, group, device)
            ds = self._device_step(group, DeviceStep(step, {}, scale=grad_scale)) if rows.params else None
            work.append((group, rows, ds))
            if ds is not None:  # the check pass and the result check of every group, before any write
                self._run_device_update(group, rows, ds, found_inf, verify=True, check=check)
        if check.launches == 0:  # no grad anywhere (a group of empty tensors): nothing checked
            if own_flag:
                found_inf.zero_()
            check.result.zero_()
        bad_hp = F.bad_lr_flag([g["lr"] for g in self.param_groups], device)
        skip = found_inf if bad_hp is None else torch.maximum(found_inf.reshape(1), bad_hp)
        for group, rows, ds in work:
            if ds is not None:  # a group without grads keeps its counter (docs/optim.md, "Step counters")
                self._run_device_update(group, rows, ds, skip)
        if self.unscale_grads and grad_scale is not None:
            grads = [g for rows in all_rows for g in rows.grads]
            self._write_unscaled_grads(grads, F.inv_scale_from_grad_scale(grad_scale, device), device)
        report = not (device.type == "cuda" and capturing())
        if report and not own_flag:
            self._report(check.result, self._result_message)
        self._count_and_report(bad_hp, found_inf if own_flag else None, device, counted=True, report=report)

    def _result_buffer(self, device: torch.device) -> torch.Tensor:
        """float32 ``[1]`` on ``device``: 1 when this step's result check raised the flag (written whole each step)."""
        store = self._skip_counts
        key = f"result:{device}"
        buf = store.get(key)
        if buf is None:
            buf = store[key] = torch.zeros(1, dtype=torch.float32, device=device)
        return buf

    def _run_device_update(  # type: ignore[override]
        self, group: dict[str, Any], rows: ApexRows, ds: DeviceStep, skip: torch.Tensor, *, verify: bool = False,
        check: StepVerify | None = None,
    ) -> None:
        raise NotImplementedError

    def _collect(self) -> list[ApexRows]:  # type: ignore[override]
        out = []
        for group in self.param_groups:
            rows = ApexRows()
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                check_sparse_grad(self._name, i, p.grad)
                if p.grad.shape != p.shape:
                    raise ValueError(
                        f"{self._name}: the gradient of params[{i}] has shape {tuple(p.grad.shape)} but the param "
                        f"{tuple(p.shape)}."
                    )
                state, new = self._state_for_group(p, i, group)
                master = state.get("master")
                rows.params.append(p if master is None else master)
                rows.models.append(None if master is None else p)
                rows.grads.append(p.grad)
                rows.states.append(state)
                rows.new.append(new)
            out.append(rows)
        if not torch.compiler.is_compiling():
            self._step_cache["apex_rows"] = out  # for _on_device, which takes it out again
        return out


def widen_state(optimizer: torch.optim.Optimizer, keys: Iterable[str]) -> None:
    """State tensors ``keys`` stored in fp16/bf16 (apex's optimizers keep state in the param dtype) become fp32:
    exact, and what fp16kit's kernels expect."""
    for state in optimizer.state.values():
        widen_state_of(state, keys)


def widen_state_of(state: dict[str, Any], keys: Iterable[str]) -> None:
    """``widen_state`` for one param's state."""
    for key in keys:
        t = state.get(key)
        if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION:
            state[key] = t.float()


def check_state(
    fn: str,
    p: torch.Tensor,
    index: int | Callable[[], int],
    state: dict[str, Any],
    spec: dict[str, str],
    dtype: torch.dtype,
) -> None:
    """An existing state must belong to ``p``: each ``spec`` key (``"param"``: shaped like ``p``, ``"scalar"``:
    one element) of ``dtype`` on ``p``'s device, and an fp32 master (if any) shaped like ``p``. ``index`` (or a
    callable giving it, evaluated only for the message) names the param."""
    bad = None
    for key, kind in spec.items():
        t = state.get(key)
        if t is None:
            continue  # e.g. no momentum buffer for momentum=0; created when needed
        shape = p.shape if kind == "param" else torch.Size([1])
        if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != p.device:
            got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)
            bad = f"state[{key!r}] is {got}, but it must be {tuple(shape)} {dtype} on {p.device}"
            break
    master = state.get("master")
    if bad is None and master is not None and (master.shape != p.shape or master.device != p.device):
        bad = f"its fp32 master has shape {tuple(master.shape)} on {master.device}"
    if bad is not None:
        i = index() if callable(index) else index
        raise ValueError(
            f"{fn}: params[{i}] ({tuple(p.shape)} {p.dtype} on {p.device}): {bad}. The optimizer state does not "
            f"belong to these params: load the state_dict saved for this model, or start fresh."
        )
