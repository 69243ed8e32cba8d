"""``FusedMixedPrecisionLamb``: apex's mixed-precision LAMB signature on :class:`fp16kit.optim.FusedLAMB`'s
master-weights mode (the LAMB math is FusedLAMB's; nothing is forked)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ._apex_common import ApexStateOptimizer, check_lr, check_state, widen_state
from .lamb import FusedLAMB

__all__ = ["FusedMixedPrecisionLamb"]

_REDUCED = (torch.float16, torch.bfloat16)
_SPEC = {"exp_avg": "param", "exp_avg_sq": "param"}
_math_dtype = ApexStateOptimizer._math_dtype


class FusedMixedPrecisionLamb(FusedLAMB):
    """apex's ``FusedMixedPrecisionLamb``: LAMB (:class:`fp16kit.optim.FusedLAMB`'s math, ``docs/optim.md``) with
    the learning rate and the step counter as device tensors, and fp32 masters for reduced-precision params.

    With ``reduced_precision_dtype`` set (``torch.float16`` or ``torch.bfloat16``), every param of that dtype
    gets an fp32 master copy and fp32 moments, created on the first step (after DDP has synced the params, as
    in apex); each step updates the master and writes its round-to-nearest-even copy into the param in the
    same pass. Params of other dtypes are updated directly, with fp32 moments (apex: moments in the param
    dtype). ``reduced_precision_dtype=None``: no masters.

    ``group["lr"]`` is a one-element fp32 tensor on the params' device (each group its own), so a schedule
    may update it in place (``group["lr"].fill_(x)``) without a recompile or a host sync; assigning a Python
    float also works. ``group["step"]`` is a one-element fp32 device tensor starting at ``step`` (apex: int32);
    it advances only for steps that are taken. Under a GradScaler (torch's or fp16kit's) the grads are
    unscaled inside the step and an inf/NaN skips it on the device, as for FusedLAMB.

    Args:
        params: parameters or param groups.
        lr: initial learning rate (a finite float >= 0, or a one-element tensor).
        step: initial value of every group's step counter (for resuming a schedule).
        bias_correction, betas, eps, weight_decay, adam_w_mode, grad_averaging, max_grad_norm, use_nvlamb:
            as :class:`fp16kit.optim.FusedLAMB` (apex's defaults).
        amsgrad: must be False (RuntimeError otherwise, as in apex).
        reduced_precision_dtype: ``None``, ``torch.float16`` or ``torch.bfloat16``.
        on_nonfinite: as :class:`fp16kit.optim.FusedLAMB`.

    Not supported: apex's ``step(closure, grad_scaler=...)`` keyword; call ``scaler.step(optimizer)`` instead
    (the scaler hands over ``grad_scale``/``found_inf`` as attributes, torch's current contract).
    """

    _name = "FusedMixedPrecisionLamb"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        step: int | torch.Tensor = 0,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        reduced_precision_dtype: torch.dtype | None = None,
        *,
        on_nonfinite: str = "warn",
    ) -> None:
        if reduced_precision_dtype is not None and reduced_precision_dtype not in _REDUCED:
            raise ValueError(
                f"{self._name}: reduced_precision_dtype={reduced_precision_dtype!r} is not supported; use None, "
                f"torch.float16 or torch.bfloat16."
            )
        check_lr(self._name, lr)
        if isinstance(step, bool) or not isinstance(step, (int, torch.Tensor)) or int(step) < 0:
            raise ValueError(f"{self._name}: step={step!r} must be a non-negative integer (the steps taken so far).")
        self.reduced_precision_dtype = reduced_precision_dtype
        self._initial_step = float(step)
        self._initial_lr = lr
        super().__init__(
            params,
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adam_w_mode=adam_w_mode,
            grad_averaging=grad_averaging,
            set_grad_none=True,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            master_weights=reduced_precision_dtype is not None,
            on_nonfinite=on_nonfinite,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its ``lr`` and ``step`` become its own device tensors (apex clones tensor defaults)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            group["lr"] = lr.detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
        else:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        group.setdefault("step", self._initial_step)
        self._group_step(group, device)

    def _state_for(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Masters only for params of ``reduced_precision_dtype`` (apex); others are updated in place. An
        existing state is checked against the param (a checkpoint of other params is refused)."""
        if self.state[p]:
            check_state(self._name, p, lambda: self._index_of(p), self.state[p], _SPEC, _math_dtype(p))
        if self.state[p] or not self.master_weights or p.dtype == self.reduced_precision_dtype:
            return super()._state_for(p)
        self.master_weights = False
        try:
            return super()._state_for(p)
        finally:
            self.master_weights = True

    def _index_of(self, p: torch.Tensor) -> int:
        return next(i for i, q in enumerate(q for g in self.param_groups for q in g["params"]) if q is p)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint (FusedLAMB's: saved dtypes kept, fp16/bf16 moments of an apex checkpoint widened to
        fp32); each group's ``lr`` tensor moves to its params' device."""
        super().load_state_dict(state_dict)
        widen_state(self, _SPEC)  # apex keeps the moments of non-reduced params in the param dtype
        for group in self.param_groups:
            if group["params"] and isinstance(group["lr"], torch.Tensor):
                group["lr"] = group["lr"].to(group["params"][0].device)
