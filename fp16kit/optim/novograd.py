"""``FusedNovoGrad``: apex's FusedNovoGrad (same constructor, same math) on multi-tensor Triton kernels."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from fp16kit.kernels import DeviceStep, novograd_update
from fp16kit.kernels.optimizers import StepVerify

from . import functional as F
from ._apex_common import ApexRows, ApexStateOptimizer, check_range, hparams64
from ._sharding import refuse_dtensors
from ._validate import check_hyperparams, refuse_amsgrad

__all__ = ["FusedNovoGrad"]

F64 = torch.float64
_SHARDED_WHY = "its second moment is the norm of each whole gradient tensor, which no shard holds"


class FusedNovoGrad(ApexStateOptimizer):
    """NovoGrad (Ginsburg et al. 2019, used for Jasper/QuartzNet) exactly as apex's ``FusedNovoGrad`` computes it:
    the second moment is one number per tensor (per layer), a running norm of its gradient.

    Per group, ``t`` = the group's step counter after the increment; per param, ``n`` = the L2 norm of its
    (unscaled) gradient (``norm_type=2``) or its max |g| (``norm_type=0``)::

        v = n on the first step taken (v = 0 with init_zero=True), else the stored value (state "exp_avg_sq")
        v = sqrt(b2 v^2 + (1 - b2) n^2)   (L2)        v = b2 v + (1 - b2) n   (inf-norm)
        bc1, bc2 = (1 - b1^t, sqrt(1 - b2^t)) if bias_correction else (1, 1);  beta3 = 1 - b1 or 1 (grad_averaging)
        denom = v / bc2 + eps
        reg_inside_moment=True:   g = g / denom + wd p;  m = b1 m + beta3 g;  u = m / bc1
        reg_inside_moment=False:  m = b1 m + beta3 g;    u = (m / bc1) / denom + wd p      (apex's default)
        p = p - lr u

    The per-tensor norms are one multi-tensor pass over the grads (``fp16kit.kernels.l2norm`` or the inf-norm
    kernel of ``kernels/triton/novograd.py``), the blend of ``v`` is float64 arithmetic on the N norms (rounded once to
    fp32: no overflow of ``n^2`` for large fp32 norms), and the update one fused pass reading g, p, m and
    writing p, m. A non-finite gradient skips the step (``v`` included) instead of writing NaN, and so does a
    step whose result would be non-finite (a norm beyond fp32, an overflowing moment: the result check,
    docs/guarantees.md 2.15). A new ``v`` is -0.0, "no step taken yet": a step skipped on the device leaves it
    so, and the first step taken sets ``v = n`` (apex's amp skips the whole ``step()``, with the same effect).
    FSDP2/DTensor params are refused (the norms are of whole tensors).

    Args:
        params: parameters or param groups (groups may override lr, bias_correction, betas, eps, weight_decay,
            grad_averaging, norm_type, init_zero).
        lr, bias_correction, betas, eps, weight_decay, reg_inside_moment, grad_averaging, norm_type, init_zero:
            apex's hyper-parameters and defaults. ``eps`` must be > 0 (a tensor with an all-zero gradient has
            ``v = 0``, and 0/0 would be NaN). ``norm_type`` is 2 (L2) or 0 (inf-norm).
        amsgrad: must be False (RuntimeError otherwise, as in apex).
        set_grad_none: ``zero_grad()`` sets grads to None (default) instead of zeroing them.
        master_weights, on_nonfinite: as in :class:`fp16kit.optim.FusedLAMB`.
        capturable: accepted (torch's capture recipe passes it); the step is capturable either way.

    Difference from apex: apex keeps ``v`` of all fp16 and of all fp32 params as two tensors in
    ``group["exp_avg_sq"]``; here each param has its own one-element ``state[p]["exp_avg_sq"]`` (fp32), so
    params may gain or lose gradients between steps and the state is checked against the params.
    """

    _name = "FusedNovoGrad"
    _state_spec: ClassVar[dict[str, str]] = {"exp_avg": "param", "exp_avg_sq": "scalar"}
    _accepts: ClassVar[tuple[str, ...]] = ("FusedNovoGrad",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        reg_inside_moment: bool = False,
        grad_averaging: bool = True,
        norm_type: int = 2,
        init_zero: bool = False,
        set_grad_none: bool = True,
        *,
        master_weights: bool = False,
        on_nonfinite: str = "warn",
        capturable: bool = False,
    ) -> None:
        refuse_amsgrad("FusedNovoGrad", amsgrad)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_averaging": grad_averaging,
            "norm_type": norm_type,
            "init_zero": init_zero,
        }
        self._check_group(defaults)
        self.reg_inside_moment = bool(reg_inside_moment)
        # apex's name for the same switch (0: regularization inside the moment, 1: decoupled)
        self.moment_mode = 0 if reg_inside_moment else 1
        super().__init__(
            params, defaults, set_grad_none=set_grad_none, master_weights=master_weights, on_nonfinite=on_nonfinite,
            capturable=capturable,
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (each group at construction too); FSDP2/DTensor params are refused."""
        refuse_dtensors(self._name, param_group, _SHARDED_WHY)
        super().add_param_group(param_group)

    def _check_hparams(self, group: dict[str, Any]) -> None:
        fn = self._name
        check_hyperparams(fn, lr=0.0, betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
        check_range(fn, "eps", group["eps"], low_open=True, hint=" (e.g. 1e-8; 0 turns all-zero gradients into NaN)")
        check_range(fn, "weight_decay", group["weight_decay"])
        if group["norm_type"] not in (0, 2) or isinstance(group["norm_type"], bool):
            raise ValueError(
                f"{fn}: norm_type={group['norm_type']!r} is not supported; use 2 (L2 norm) or 0 (infinity norm), "
                f"the two norms apex's FusedNovoGrad supports."
            )

    def _init_state(self, p: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any]) -> None:
        math = self._math_dtype(p)
        state["exp_avg"] = torch.zeros_like(p, dtype=math, memory_format=torch.contiguous_format)
        # -0.0: "no step taken yet"; the first step that is not skipped sets v = n (apex), on the device
        state["exp_avg_sq"] = torch.full((1,), -0.0, dtype=math, device=p.device)

    def _host_update(
        self, group: dict[str, Any], rows: ApexRows, step: torch.Tensor, inv_scale64: torch.Tensor,
        found_inf: torch.Tensor, device: torch.device, *, verify: bool = False,
    ) -> None:
        b1, b2 = float(group["betas"][0]), float(group["betas"][1])
        lr64 = F._scalar64("lr", group["lr"], device)
        bc1, bc2 = F._bias_corrections(step, (b1, b2), group["bias_correction"], lr64)
        bc2 = bc2.sqrt()  # apex's NovoGrad divides the norm by sqrt(1 - b2^t)
        beta3 = 1.0 - b1 if group["grad_averaging"] else 1.0
        hp64 = hparams64(lr64, (b1, beta3, float(group["weight_decay"])), device, (bc1, inv_scale64))
        self._device_update(group, rows, hp64, found_inf, bc2_sqrt=bc2, verify=verify)

    # -- the device-resident step (docs/optim.md, "The step on the device") ---------------------------------

    def _device_ready(self, group: dict[str, Any], rows: ApexRows) -> bool:
        """The L2 norm (apex's default; the inf-norm keeps the host-vector step), no state made in this step (a
        step that creates state, the first, takes the host-vector step), every row in the kernels' groups."""
        if int(group["norm_type"]) != 2 or any(rows.new):
            return False
        return bool(self._device_update(group, rows, group["lr"], None, bc2_sqrt=None, plan_only=True))

    def _device_step(self, group: dict[str, Any], base: DeviceStep) -> DeviceStep:
        b1, b2 = float(group["betas"][0]), float(group["betas"][1])
        host = {
            "beta1": b1,
            "beta3": 1.0 - b1 if group["grad_averaging"] else 1.0,
            "weight_decay": float(group["weight_decay"]),
            "beta2": b2,
            "one_minus_beta2": 1.0 - b2,
            "eps": float(group["eps"]),
        }
        return self._apex_device_step(base, group["lr"], host, bias_correction=bool(group["bias_correction"]))

    def _run_device_update(  # type: ignore[override]
        self, group: dict[str, Any], rows: ApexRows, ds: DeviceStep, skip: torch.Tensor, *, verify: bool = False,
        check: StepVerify | None = None,
    ) -> None:
        self._device_update(group, rows, ds, skip, bc2_sqrt=None, verify=verify, check=check)

    def _device_update(self, group: dict[str, Any], rows: ApexRows, hp: Any, found_inf: Any, **kwargs: Any) -> Any:
        """``novograd_update`` of the group's rows (``kwargs``: ``bc2_sqrt``, a host step's bias correction, and
        the op's launch options)."""
        return novograd_update(
            rows.params, rows.grads, rows.state("exp_avg"), rows.state("exp_avg_sq"), rows.models, hp, found_inf,
            new=rows.new, beta2=float(group["betas"][1]), eps=float(group["eps"]),
            norm_type=int(group["norm_type"]), init_zero=bool(group["init_zero"]),
            reg_inside_moment=self.reg_inside_moment, **kwargs,
        )
