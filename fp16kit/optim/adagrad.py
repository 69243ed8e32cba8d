"""``FusedAdagrad``: apex's FusedAdagrad (same constructor, same math) on one multi-tensor Triton pass per dtype."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from fp16kit.kernels import DeviceStep, adagrad_update
from fp16kit.kernels.optimizers import StepVerify

from ._apex_common import ApexRows, ApexStateOptimizer, check_range, hparams64

__all__ = ["FusedAdagrad"]


class FusedAdagrad(ApexStateOptimizer):
    """Adagrad as apex's ``FusedAdagrad``; with ``adagrad_w_mode=False`` (default) also ``torch.optim.Adagrad``
    (``lr_decay=0``, ``initial_accumulator_value=0``).

    Per param, with ``g`` the (unscaled) gradient and ``h`` the running sum of squares (state ``"sum"``)::

        if not adagrad_w_mode: g = g + wd * p          # L2 penalty in the gradient
        h = h + g * g
        u = g / (sqrt(h) + eps)
        if adagrad_w_mode: u = u + wd * p              # decoupled decay
        p = p - lr * u

    One fused pass reads g, p, h and writes p, h (and the rounded model copy in master-weights mode), after a
    read-only check pass over the grads that detects inf/NaN (a step with a non-finite grad is skipped), and a
    result check that skips a step whose update would store inf/NaN (``g * g`` overflows fp32 for |g| > 1.8e19;
    docs/guarantees.md 2.15). ``torch.optim.Adagrad`` state loads (``lr_decay=0``). FSDP2/DTensor params step
    on their local shards.
    ``h`` is fp32 for fp16/bf16 params (fp64 for fp64 params).

    Args:
        params: parameters or param groups (groups may override lr, eps, weight_decay).
        lr: learning rate, a float or a one-element device tensor.
        eps: added to ``sqrt(h)``; must be > 0 (an entry whose gradient has always been 0 has ``h = 0``, and
            ``eps = 0`` would turn it into 0/0 = NaN: apex and torch write that NaN into the weights).
        weight_decay: L2 penalty (``adagrad_w_mode=False``) or decoupled decay (``True``).
        set_grad_none: ``zero_grad()`` sets grads to None (apex's default) instead of zeroing them.
        adagrad_w_mode: decoupled (AdamW-style) weight decay.
        master_weights, on_nonfinite: as in :class:`fp16kit.optim.FusedLAMB`.
        capturable: accepted (torch's capture recipe passes it); the step is capturable either way.
    """

    _name = "FusedAdagrad"
    _state_spec: ClassVar[dict[str, str]] = {"sum": "param"}
    _accepts: ClassVar[tuple[str, ...]] = ("FusedAdagrad", "torch.optim.Adagrad")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        adagrad_w_mode: bool = False,
        *,
        master_weights: bool = False,
        on_nonfinite: str = "warn",
        capturable: bool = False,
    ) -> None:
        defaults = {"lr": lr, "eps": eps, "weight_decay": weight_decay}
        self._check_group(defaults)
        self.adagrad_w_mode = bool(adagrad_w_mode)
        super().__init__(
            params, defaults, set_grad_none=set_grad_none, master_weights=master_weights, on_nonfinite=on_nonfinite,
            capturable=capturable,
        )

    def _check_hparams(self, group: dict[str, Any]) -> None:
        fn = self._name
        hint = " (e.g. 1e-10; 0 turns never-updated entries into NaN)"
        check_range(fn, "eps", group["eps"], low_open=True, hint=hint)
        check_range(fn, "weight_decay", group["weight_decay"])

    def _import(self, state_dict: dict[str, Any], writer: str) -> dict[str, Any]:
        """``torch.optim.Adagrad`` state continues here when the math is the same: ``lr_decay=0`` and, with a
        weight decay, ``adagrad_w_mode=False`` (torch's decay is the L2 penalty); its ``sum`` is this ``sum``
        (``initial_accumulator_value`` is already in it). Anything else fails at load."""
        out = super()._import(state_dict, writer)
        if writer != "torch.optim.Adagrad":
            return out
        fn = f"{self._name}.load_state_dict"
        for gi, group in enumerate(out["param_groups"]):
            if float(group.pop("lr_decay", 0.0)) != 0.0:
                raise ValueError(
                    f"{fn}: the checkpoint's param_groups[{gi}] comes from torch.optim.Adagrad with lr_decay != 0; "
                    f"{self._name} has no learning-rate decay. Resume it with torch.optim.Adagrad."
                )
            group.pop("initial_accumulator_value", None)
            if self.adagrad_w_mode and float(group["weight_decay"]) != 0.0:
                raise ValueError(
                    f"{fn}: the checkpoint's param_groups[{gi}] comes from torch.optim.Adagrad (L2 weight decay), "
                    f"but this {self._name} has adagrad_w_mode=True. Construct it with adagrad_w_mode=False."
                )
        return out

    def _init_state(self, p: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any]) -> None:
        state["sum"] = torch.zeros_like(p, dtype=self._math_dtype(p), memory_format=torch.contiguous_format)

    def _host_update(
        self, group: dict[str, Any], rows: ApexRows, step: torch.Tensor, inv_scale64: torch.Tensor,
        found_inf: torch.Tensor, device: torch.device, *, verify: bool = False,
    ) -> None:
        hp64 = hparams64(group["lr"], (float(group["eps"]), float(group["weight_decay"])), device, (inv_scale64,))
        sums = rows.state("sum")
        adagrad_update(rows.params, rows.grads, sums, rows.models, hp64, found_inf, verify=verify, **self._modes(group))

    # -- the device-resident step (docs/optim.md, "The step on the device") ---------------------------------

    def _modes(self, group: dict[str, Any]) -> dict[str, bool]:
        wd = float(group["weight_decay"])
        return {"l2_mode": not self.adagrad_w_mode and wd != 0, "decoupled": self.adagrad_w_mode and wd != 0}

    def _device_ready(self, group: dict[str, Any], rows: ApexRows) -> bool:
        return bool(adagrad_update(rows.params, rows.grads, rows.state("sum"), rows.models, group["lr"], None,
                                   plan_only=True, **self._modes(group)))

    def _device_step(self, group: dict[str, Any], base: DeviceStep) -> DeviceStep:
        host = {"eps": float(group["eps"]), "weight_decay": float(group["weight_decay"])}
        return self._apex_device_step(base, group["lr"], host)

    def _run_device_update(  # type: ignore[override]
        self, group: dict[str, Any], rows: ApexRows, ds: DeviceStep, skip: torch.Tensor, *, verify: bool = False,
        check: StepVerify | None = None,
    ) -> None:
        adagrad_update(rows.params, rows.grads, rows.state("sum"), rows.models, ds, skip, verify=verify, check=check,
                       **self._modes(group))
