"""fp16kit's mixed precision under PyTorch Lightning: :class:`AmpPrecision`, a Lightning precision plugin.

Two routes, picked by ``opt_level``::

    from lightning import Trainer
    from fp16kit.integrations.lightning import AmpPrecision

    Trainer(plugins=[AmpPrecision("bf16-mixed")])                  # torch-style: fp16kit autocast
    Trainer(plugins=[AmpPrecision("16-mixed")])                    # ... + fp16kit's GradScaler
    Trainer(plugins=[AmpPrecision("16-mixed", opt_level="O2")])    # apex-style: fp16 model, fp32 masters
    Trainer(plugins=[AmpPrecision("bf16-mixed", opt_level="O1")])  # apex-style O1 with bf16

**Torch-style** (``opt_level=None``): every training/validation/test/predict step runs inside
``fp16kit.amp.autocast(dtype)``; ``"16-mixed"`` scales the loss with ``fp16kit.amp.GradScaler`` (an overflowed step
is skipped and the scale backs off), ``"bf16-mixed"`` needs no scaler. Unlike Lightning's own ``MixedPrecision``,
gradient clipping works with optimizers that unscale inside their step (fp16kit's ``FusedLAMB``/``FusedAdam``, torch's
``fused=True``): when Lightning clips, the plugin unscales first (``scaler.unscale_``) and the optimizer is then
handed ``grad_scale=None``; without clipping the fused optimizer unscales in its own first pass (no extra pass).

**apex-style** (``opt_level="O1"``/``"O2"``): when Lightning connects the plugin (after ``configure_optimizers``),
``amp.initialize(module, optimizers, opt_level, low_precision_dtype=...)`` runs on the LightningModule and its
optimizers, with apex's semantics (docs/migrating-from-apex.md): O2 casts the module to fp16/bf16 (batchnorm
fp32), casts the floating inputs of ``forward`` to that dtype and its outputs to fp32, and keeps fp32 master weights
in the optimizer (fp16kit's fused optimizers: in their own state; others: in their param groups); O1 runs every step
inside the cast policy (the apex patch of torch functions, scoped to the step). Every backward runs inside
``amp.scale_loss`` (``delay_unscale=True`` for the micro-batches that ``accumulate_grad_batches`` adds up, apex's
recipe); an overflowed step is skipped by amp and the scale backs off. O2 needs ``training_step`` to call the
module's ``forward`` (``self(x)``), as apex's O2 did: that is where the inputs are cast.

Both routes: ``gradient_clip_val`` clips the unscaled gradients (apex-style: the fp32 master gradients,
``amp.master_params``); ``accumulate_grad_batches`` works; the scaler or amp state (scale, growth and hysteresis
trackers) is saved in every Lightning checkpoint by :meth:`AmpPrecision.state_dict` and restored by
``Trainer.fit(ckpt_path=...)`` (the fp32 masters travel in the optimizer's own state), so a resumed run continues
bit for bit. Optimizers from ``configure_optimizers`` may be fp16kit's ``FusedLAMB``/``FusedAdam`` in any mode
(``master_weights=True``/``"split"``/``"stochastic"``, ``state_bits=8``) or torch's.

Not supported: apex-style with a strategy that wraps the module (DDP, FSDP, DeepSpeed: ``amp.initialize`` must see
the bare module before the wrapper; use the torch-style route there), LBFGS with a loss scaler, and the manual
optimization of several optimizers with apex-style (one ``scale_loss`` per backward needs to know which optimizer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import Precision
except ImportError as exc:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "fp16kit.integrations.lightning needs the lightning package: pip install 'lightning>=2.6'."
    ) from exc

from .. import amp
from ._amp_hooks import clip_master_grads, scaled_backward

__all__ = ["AmpPrecision"]

_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
_LEVELS = ("O0", "O1", "O2", "O3")


class AmpPrecision(Precision):
    """A Lightning precision plugin running fp16kit's mixed precision (module docstring).

    Args:
        precision: ``"16-mixed"`` (fp16) or ``"bf16-mixed"`` (bf16), Lightning's names.
        opt_level: ``None`` (torch-style autocast, default) or an apex opt level ``"O0"``-``"O3"``.
        scaler: torch-style ``"16-mixed"`` only: the ``fp16kit.amp.GradScaler`` to use (default: a new one with
            torch's defaults). Must be None for ``"bf16-mixed"``.
        amp_options: apex-style only: further keywords for ``amp.initialize`` (``loss_scale``, ``min_loss_scale``,
            ``master_weights``, ``keep_batchnorm_fp32``, ``scale_window``, ``hysteresis``, ...; ``verbosity`` defaults
            to 0).

    Raises:
        ValueError: an unknown ``precision`` or ``opt_level``, a scaler with bf16 or with an opt level, amp options
            without an opt level.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"] = "bf16-mixed",
        *,
        opt_level: str | None = None,
        scaler: amp.GradScaler | None = None,
        amp_options: dict[str, Any] | None = None,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"AmpPrecision(precision={precision!r}): use '16-mixed' (fp16) or 'bf16-mixed' (bf16).")
        if opt_level is not None and opt_level not in _LEVELS:
            raise ValueError(f"AmpPrecision(opt_level={opt_level!r}): use None (torch-style autocast) or one of "
                             f"{_LEVELS} (apex-style; the letter O, not zero).")
        if scaler is not None and (opt_level is not None or precision == "bf16-mixed"):
            raise ValueError(
                "AmpPrecision: a GradScaler belongs to the torch-style '16-mixed' route only (bf16 needs no loss "
                "scaling; apex-style opt levels scale with amp's own loss scaler: pass "
                "amp_options={'loss_scale': ...})."
            )
        if amp_options and opt_level is None:
            raise ValueError("AmpPrecision: amp_options are amp.initialize's keywords; they need an opt_level.")
        self.precision = precision  # Lightning's name for the mode (trainer.precision)
        self.dtype = _DTYPES[precision]
        self.opt_level = opt_level
        self.amp_options = {"verbosity": 0, **(amp_options or {})}
        if opt_level is None and precision == "16-mixed" and scaler is None:
            scaler = amp.GradScaler()
        self.scaler = scaler
        self._optimizers: list[torch.optim.Optimizer] = []  # apex-style: the optimizers amp.initialize processed
        self._pending: dict[str, Any] | None = None  # amp state loaded before connect
        self._stepping = False  # inside optimizer_step's closure: the backward of the last micro-batch
        self._unscaled: set[int] = set()  # torch-style: optimizers unscaled (scaler.unscale_) in this step

    # ------------------------------------------------------------------ set-up
    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, list[Any], list[Any]]:
        """apex-style: ``amp.initialize`` the LightningModule and its optimizers (once); torch-style: nothing.

        Raises:
            NotImplementedError: apex-style with a module wrapped by the strategy (DDP, FSDP, ...).
            RuntimeError: the module went through ``amp.initialize`` but the optimizers are new (a second ``fit``
                whose ``configure_optimizers`` built new ones): build a new module too.
        """
        if self.opt_level is None or not optimizers:
            return model, optimizers, lr_schedulers
        if self._optimizers:
            if [id(o) for o in optimizers] != [id(o) for o in self._optimizers]:
                raise RuntimeError(
                    "AmpPrecision: amp.initialize already processed this module with other optimizers (a second "
                    "Trainer.fit?). apex-style amp casts the module once; build a new LightningModule and Trainer."
                )
            return model, optimizers, lr_schedulers
        if not isinstance(model, pl.LightningModule):
            raise NotImplementedError(
                f"AmpPrecision(opt_level={self.opt_level!r}): the strategy wrapped the module "
                f"({type(model).__name__}) before the precision plugin connected, and amp.initialize must see the bare "
                "module. Use the torch-style route (AmpPrecision(precision) without opt_level) with this strategy."
            )
        amp.initialize(model, optimizers, opt_level=self.opt_level, low_precision_dtype=self.dtype,
                       **self.amp_options)
        self._optimizers = list(optimizers)
        if self._pending is not None:
            state, self._pending = self._pending, None
            self.load_state_dict(state)
        return model, optimizers, lr_schedulers

    @property
    def _apex(self) -> bool:
        return bool(self._optimizers)

    # ------------------------------------------------------------------ forward
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Torch-style and apex O1: the step inside ``fp16kit.amp.autocast(dtype)``. apex O2/O3: nothing here (the
        module's own input/output casts from ``amp.initialize``); O0: nothing."""
        if self.opt_level in ("O0", "O2", "O3"):
            yield
            return
        with amp.autocast(dtype=self.dtype):
            yield

    # ------------------------------------------------------------------ backward
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any,
                 **kwargs: Any) -> None:
        """apex-style: the backward inside ``amp.scale_loss``; all micro-batches but the one whose step follows use
        ``delay_unscale=True`` (the scaled grads add up; the last one unscales and checks the sum)."""
        if not self._apex:
            return super().backward(tensor, model, optimizer, *args, **kwargs)
        if optimizer is None and len(self._optimizers) > 1:
            raise NotImplementedError(
                "AmpPrecision: manual_backward with several optimizers under an apex-style opt level: amp.scale_loss "
                "needs the optimizer of this loss. Use one optimizer, or the torch-style route."
            )
        last = self._stepping or not model.automatic_optimization

        def run(scaled: torch.Tensor) -> None:
            super(AmpPrecision, self).backward(scaled, model, optimizer, *args, **kwargs)

        scaled_backward(run, tensor, optimizer if optimizer is not None else self._optimizers[0],
                        last_micro_batch=last)

    # ------------------------------------------------------------------ step
    def optimizer_step(self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:  # type: ignore[override]
        """The closure (forward and backward), Lightning's ``on_before_optimizer_step`` and clipping, then the step:
        ``scaler.step`` + ``update`` (fp16 torch-style), amp's skipping ``optimizer.step`` (apex-style), or the
        plain step (bf16). A closure that returned None (the step skipped the backward) skips the step."""
        if self.scaler is None and not self._apex:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise RuntimeError("AmpPrecision: LBFGS re-evaluates its closure inside step(), which loss scaling does "
                               "not support; use bf16-mixed without an opt_level.")
        self._stepping = True
        try:
            closure_result = closure()
        finally:
            self._stepping = False
        skipped = closure_result is None and model.automatic_optimization
        if self.scaler is not None and not skipped and not getattr(optimizer, "_step_supports_amp_scaling", False):
            self._unscale(optimizer)  # the grads Lightning's hooks and clipping see are the true ones
        try:
            self._after_closure(model, optimizer)
            if skipped:
                return closure_result
            if self.scaler is None:
                return optimizer.step(**kwargs)
            out = self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
            return out
        finally:
            self._unscaled.discard(id(optimizer))

    def _unscale(self, optimizer: Any) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    # ------------------------------------------------------------------ clipping
    def main_params(self, optimizer: Any) -> Any:
        """The params the optimizer updates: apex-style, the fp32 masters (``amp.master_params``)."""
        return amp.master_params(optimizer) if self._apex else super().main_params(optimizer)

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = None) -> None:
        """Clip the unscaled gradients: torch-style fp16 unscales first (also for optimizers that unscale in their
        own step, which then get ``grad_scale=None``); apex-style clips the fp32 master grads."""
        from lightning.pytorch.utilities import GradClipAlgorithmType

        if clip_val <= 0:
            return
        self._unscale(optimizer)
        algorithm = gradient_clip_algorithm or GradClipAlgorithmType.NORM
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=algorithm)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if self._apex:
            clip_master_grads(optimizer, float(clip_val))
            return
        super().clip_grad_by_norm(optimizer, clip_val)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond the optimizer and module: apex-style ``amp.state_dict()`` (loss scale, growth
        and hysteresis trackers), fp16 torch-style the GradScaler's state, bf16 torch-style nothing."""
        if self._apex:
            return {"amp": dict(amp.state_dict(optimizer=self._optimizers[0]))}
        if self.scaler is not None:
            return {"scaler": self.scaler.state_dict()}
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (apex-style state that arrives before ``connect`` is kept until then).

        Raises:
            ValueError: the checkpoint was written by the other route (amp state into a torch-style plugin or the
                reverse), naming both.
        """
        if "amp" in state_dict:
            if self.opt_level is None:
                raise ValueError("AmpPrecision.load_state_dict: the checkpoint holds apex-style amp state; this plugin "
                                 "is torch-style (opt_level=None). Resume with the opt_level that wrote it.")
            if not self._apex:
                self._pending = dict(state_dict)
                return
            amp.load_state_dict(state_dict["amp"], optimizer=self._optimizers[0])
            return
        if "scaler" in state_dict:
            if self.scaler is None:
                raise ValueError("AmpPrecision.load_state_dict: the checkpoint holds a GradScaler's state (torch-style "
                                 f"'16-mixed'); this plugin is {self.precision!r}, opt_level={self.opt_level!r}.")
            self.scaler.load_state_dict(state_dict["scaler"])
