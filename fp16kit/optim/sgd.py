"""``FusedSGD``: apex's FusedSGD (same constructor, same math) on one multi-tensor Triton pass per dtype group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import required  # type: ignore[attr-defined]

from fp16kit.kernels import DeviceStep, sgd_update
from fp16kit.kernels.optimizers import StepVerify

from ._apex_common import ApexRows, ApexStateOptimizer, check_range, hparams64

__all__ = ["FusedSGD"]


class FusedSGD(ApexStateOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, as apex's ``FusedSGD`` (and ``torch.optim.SGD``).

    Per param, with ``g`` the (unscaled) gradient::

        if wd != 0 and not wd_after_momentum: g = g + wd * p
        if momentum != 0:
            m = g                                      on the buffer's first use (apex and torch)
            m = momentum * m + (1 - dampening) * g     afterwards
            g = g + momentum * m  if nesterov  else  m
        if wd != 0 and wd_after_momentum: g = g + wd * p
        p = p - lr * g

    One fused pass reads g, p, m and writes p, m (and the rounded model copy in master-weights mode), after a
    read-only check pass over the grads that detects inf/NaN (a step with a non-finite grad is skipped: nothing
    changes), and a step whose result would be inf/NaN (``lr * g`` or the buffer past fp32's range) is skipped
    the same way (the result check, docs/guarantees.md 2.15). fp32 math; momentum buffers are fp32 for fp16/bf16
    params (fp64 for fp64 params). FSDP2/DTensor params step on their local shards.

    Args:
        params: parameters or param groups (groups may override lr, momentum, dampening, weight_decay, nesterov).
        lr: learning rate (required, as in apex and torch); a float or a one-element device tensor.
        momentum, dampening, weight_decay, nesterov: as ``torch.optim.SGD``; ``nesterov`` needs
            ``momentum > 0`` and ``dampening == 0``. Unlike torch, ``momentum`` and ``dampening`` must lie in
            [0, 1] (a momentum above 1 grows the buffer geometrically until it overflows) and ``lr`` and
            ``weight_decay`` in [0, 3.4028235e+38] (float32's range); ``ValueError`` otherwise.
        wd_after_momentum: add the weight decay after the momentum update instead of before (apex).
        materialize_master_grads: accepted for apex compatibility. Under fp16kit's amp O2 the fp32 master
            grads are always materialized (the unscale pass writes them), which is apex's default ``True``;
            ``False`` gives the same numbers to fp32 rounding, so it changes nothing here.
        set_grad_none: ``zero_grad()`` sets grads to None instead of zeroing them (apex's default: False).
        master_weights, on_nonfinite: as in :class:`fp16kit.optim.FusedLAMB`.

    No momentum buffer is kept when ``momentum == 0`` (apex allocates an unused one). If the very first step
    of a param is skipped on the device (``found_inf``), its buffer stays zero and the next step applies
    ``1 - dampening`` to the grad instead of copying it: identical unless ``dampening != 0``.
    """

    _name = "FusedSGD"
    _state_spec: ClassVar[dict[str, str]] = {"momentum_buffer": "param"}
    _accepts: ClassVar[tuple[str, ...]] = ("FusedSGD", "torch.optim.SGD")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = required,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        *,
        master_weights: bool = False,
        on_nonfinite: str = "warn",
        capturable: bool = False,
    ) -> None:
        # As in apex, lr may be left out when every param group sets its own (torch's add_param_group then
        # raises for a group without one).
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
        }
        self._check_group({**defaults, "lr": 0.0} if lr is required else defaults)
        self.wd_after_momentum = bool(wd_after_momentum)
        self.materialize_master_grads = bool(materialize_master_grads)
        super().__init__(
            params, defaults, set_grad_none=set_grad_none, master_weights=master_weights, on_nonfinite=on_nonfinite,
            capturable=capturable,
        )

    def _check_hparams(self, group: dict[str, Any]) -> None:
        fn = self._name
        momentum = check_range(fn, "momentum", group["momentum"], high=1.0, hint=" (the weight of the old buffer)")
        dampening = check_range(fn, "dampening", group["dampening"], high=1.0, hint=" (the grad gets 1 - dampening)")
        check_range(fn, "weight_decay", group["weight_decay"])
        if group["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ValueError(
                f"{fn}: Nesterov momentum requires a momentum and zero dampening; got momentum={momentum!r}, "
                f"dampening={dampening!r}. Set momentum > 0 and dampening=0, or nesterov=False."
            )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def _init_state(self, p: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any]) -> None:
        if float(group["momentum"]) != 0:
            state["momentum_buffer"] = torch.zeros_like(
                p, dtype=self._math_dtype(p), memory_format=torch.contiguous_format
            )

    def _host_update(
        self, group: dict[str, Any], rows: ApexRows, step: torch.Tensor, inv_scale64: torch.Tensor,
        found_inf: torch.Tensor, device: torch.device, *, verify: bool = False,
    ) -> None:
        # A buffer created in this step (``_state_for_group``: a new param, or momentum switched on later) has
        # its first use now (apex and torch: buffer = grad).
        bufs, first, modes = self._sgd_rows(group, rows)
        hp = (float(group["momentum"]), 1.0 - float(group["dampening"]), float(group["weight_decay"]))
        hp64 = hparams64(group["lr"], hp, device, (inv_scale64,))
        sgd_update(rows.params, rows.grads, bufs, rows.models, hp64, found_inf, first_run=first, verify=verify, **modes)

    # -- the device-resident step (docs/optim.md, "The step on the device") ---------------------------------

    def _sgd_rows(self, group: dict[str, Any], rows: ApexRows) -> tuple[list | None, list[bool], dict[str, bool]]:
        """``(momentum buffers or None, first use per row, kernel modes)`` of the group's update."""
        momentum, wd = float(group["momentum"]), float(group["weight_decay"])
        first = list(rows.new) if momentum != 0 else [False] * len(rows.params)
        bufs = rows.state("momentum_buffer") if momentum != 0 else None
        modes = {"weight_decay": wd != 0, "wd_after_momentum": self.wd_after_momentum, "nesterov": group["nesterov"]}
        return bufs, first, modes

    def _device_ready(self, group: dict[str, Any], rows: ApexRows) -> bool:
        bufs, first, modes = self._sgd_rows(group, rows)
        return bool(sgd_update(rows.params, rows.grads, bufs, rows.models, group["lr"], None, first_run=first,
                               plan_only=True, **modes))

    def _device_step(self, group: dict[str, Any], base: DeviceStep) -> DeviceStep:
        host = {
            "momentum": float(group["momentum"]),
            "one_minus_dampening": 1.0 - float(group["dampening"]),
            "weight_decay": float(group["weight_decay"]),
        }
        return self._apex_device_step(base, group["lr"], host)

    def _run_device_update(  # type: ignore[override]
        self, group: dict[str, Any], rows: ApexRows, ds: DeviceStep, skip: torch.Tensor, *, verify: bool = False,
        check: StepVerify | None = None,
    ) -> None:
        bufs, first, modes = self._sgd_rows(group, rows)
        sgd_update(rows.params, rows.grads, bufs, rows.models, ds, skip, first_run=first, verify=verify, check=check,
                   **modes)
