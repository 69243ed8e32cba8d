"""``FusedLAMB``: apex's FusedLAMB (same constructor, same math) on multi-tensor Triton kernels.

Improvements over apex (``docs/specs/lamb.md``): ``p.grad`` is never overwritten; optimizer state is fp32
for fp16/bf16 params; bf16 works; a non-finite gradient never reaches the weights (under a loss scaler
the step is skipped on the device, without one it is skipped and reported per ``on_nonfinite``);
``master_weights=True`` keeps fp32 masters of fp16/bf16 params (apex's FusedMixedPrecisionLamb).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fp16kit.kernels import DeviceStep

from . import _sharding
from . import functional as F
from ._base import FusedOptimizer
from ._rows import _Rows
from ._sharding import ShardedSteps
from ._validate import check_hyperparams, refuse_amsgrad

__all__ = ["FusedLAMB"]


class FusedLAMB(ShardedSteps, FusedOptimizer):
    """LAMB (You et al., 2019) exactly as apex's ``FusedLAMB`` computes it.

    One step, with ``gnorm`` the L2 norm of all (unscaled) gradients of all groups::

        clip = gnorm / max_grad_norm if 0 < max_grad_norm < gnorm else 1      # constructor's max_grad_norm
        per group:  step += 1;  bc1, bc2 = 1 - b1^step, 1 - b2^step (or 1, 1);  beta3 = 1 - b1 (or 1)
        per param:  g = grad / clip            [+ wd * p  when adam_w_mode=False: L2 decay]
                    m = b1 m + beta3 g;  v = b2 v + (1 - b2) g^2
                    u = (m / bc1) / (sqrt(v / bc2) + eps)   [+ wd * p  when adam_w_mode=True]
                    ratio = lr |p| / |u|  if (use_nvlamb or wd != 0) and |p| != 0 and |u| != 0  else lr
                    p = p - ratio u

    With ``weight_decay=0`` and ``use_nvlamb=False`` no trust ratio is applied (apex's behaviour): the
    step is Adam with global clipping.

    Args:
        params: parameters or param groups (groups may override lr, betas, eps, weight_decay,
            bias_correction, grad_averaging; ``max_grad_norm`` is global, as in apex).
        lr, bias_correction, betas, eps, weight_decay, adam_w_mode, grad_averaging, max_grad_norm,
            use_nvlamb: apex's hyper-parameters and defaults. ``lr`` may be a one-element device tensor.
        amsgrad: must be False (RuntimeError otherwise, as in apex).
        set_grad_none: ``zero_grad()`` sets grads to None (default) instead of zeroing them.
        master_weights: ``True``: keep an fp32 master copy (and fp32 moments) of every fp16/bf16 param; each step
            updates the master and writes its round-to-nearest-even copy into the param, in the same pass
            (14 B/param with the moments). For bf16 params without an fp32 master (docs/optim.md, "bf16 weights
            without fp32 masters"): ``"split"`` keeps the master's low 16 bits in ``state["master_low"]`` (int16)
            and the high half, rounded to nearest with ties away from zero, in the param: the reassembled master
            is bit for bit that of ``True`` (12 B/param); ``"stochastic"`` rounds each updated param to bf16
            stochastically (unbiased; Philox keyed by ``rounding_seed``, the group and the device step counter;
            10 B/param). fp32 params are updated directly; fp16/fp64 params raise TypeError in these modes. Both
            modes step FSDP2 (DTensor) shards: split's masters bit for bit those of ``True`` on the same shards (the
            sharded stages reassemble, update and split), stochastic rounding with the bits one process draws for
            the same elements (a shard that is not a contiguous range of its param, unlike FSDP2's ``Shard(0)``,
            raises NotImplementedError).
        rounding_seed: ``"stochastic"`` only: the 63-bit key of the random bits, kept in each group as
            ``"rounding_seed"`` (checkpointed); None draws one from torch's default generator.
        on_nonfinite: without a loss scaler, what to do after skipping a step whose grads hold inf/NaN:
            ``"warn"`` (default; on CUDA the warning comes one step later, without a host sync),
            ``"raise"`` (RuntimeError; reads the flag on the host: one sync per step) or ``"skip"``.
        process_group: ZeRO-1 (each rank steps only its own whole params): the group whose ranks together
            hold every param; the global norm (hence the clip) and the inf flag are summed over it. Not
            needed for FSDP2: DTensor params carry their group (``docs/distributed.md``).

    Loss scalers: ``_step_supports_amp_scaling = True``, so ``torch.amp.GradScaler`` and fp16kit's
    GradScaler pass ``grad_scale``/``found_inf`` instead of unscaling the grads: the step unscales them
    in its first pass, takes the global norm of the unscaled values, and skips on the device when
    ``found_inf`` is set (the step counter included). Nothing syncs with the host.

    Validation (``docs/optim.md``): hyper-parameters are checked at every step too (``ValueError`` naming
    ``param_groups[i]['key']``); a tensor ``lr`` that is NaN, inf or negative skips the step on the device
    (counted in ``hparam_skips``, reported per ``on_nonfinite``); grads and state that do not fit their
    params, and corrupt checkpoints, raise before anything changes.

    ``torch.compile(opt.step)`` captures the step in one graph, bit-identical to eager (docs/optim.md).
    ``state_bits=8``: 8-bit moments for params of at least 4096 elements; the trust-ratio norms come from the update
    computed from the moments as stored (docs/optim.md, "8-bit moments"). FSDP2 (DTensor) shards that start at a
    multiple of 256 elements step with the whole tensor's blocks (other offsets raise ValueError naming the fix); not
    with ``torch.compile`` (``NotImplementedError``).
    """

    _bf16_modes = True
    _name = "FusedLAMB"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float = 1.0,
        use_nvlamb: bool = False,
        *,
        master_weights: bool | str = False,
        on_nonfinite: str = "warn",
        process_group: Any = None,
        capturable: bool = False,
        rounding_seed: int | None = None,
        state_bits: int = 32,
    ) -> None:
        refuse_amsgrad("FusedLAMB", amsgrad)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_averaging": grad_averaging,
            "max_grad_norm": max_grad_norm,
        }
        self._check_group(defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)
        # accepted as torch's and FusedAdam's: every eager step on the Triton backend is already capturable
        # (docs/optim.md, "The step on the device")
        self.capturable = bool(capturable)
        options = {"master_weights": master_weights, "on_nonfinite": on_nonfinite, "process_group": process_group,
                   "rounding_seed": rounding_seed, "state_bits": state_bits}
        super().__init__(params, defaults, set_grad_none=set_grad_none, **options)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_hyperparams(self._name, **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "max_grad_norm")})

    def _check_factor(self) -> float:
        # clipping divides every gradient by gnorm / max_grad_norm: what the moments see is then bounded
        return self._SQUARE_GUARD if float(self.defaults["max_grad_norm"]) <= 0 else 1.0

    def _needs_grad_norm(self) -> bool:
        return float(self.defaults["max_grad_norm"]) > 0  # the clip reads the norm; 0 disables clipping

    def _update_group(
        self,
        group: dict[str, Any],
        rows: _Rows,
        step: torch.Tensor,
        inv_scale64: torch.Tensor,
        found_inf: torch.Tensor,
        grad_norm: torch.Tensor,
    ) -> None:
        if not rows.params:
            return
        clip64 = F.clip_factor(grad_norm, float(self.defaults["max_grad_norm"]))
        hp64 = self._hparams64(group, step, inv_scale64, clip64, rows.params[0].device)
        modes = {"weight_decay": float(group["weight_decay"]), "adam_w_mode": self.adam_w_mode}
        weights = self._weights(group)
        # ZeRO-1 (process_group=, whole params on their owner): the trust-ratio norms are local, so the bf16 modes run
        # the one-process update after the step's all-reduce of the grad norm and flag (defer_lamb says False)
        if _sharding.defer_lamb(self, rows, hp64, **modes, use_nvlamb=self.use_nvlamb, weights=weights):
            return  # sharded params: stages 1 and 2 run after all groups, around one norm all-reduce
        self._run_update(
            F if weights is not None else self._updates(), group, rows, hp64, found_inf,
            step=step, **({} if weights is None else {"weights": weights}),
        )

    def _hparams64(
        self, group: dict[str, Any], step: torch.Tensor, inv_scale64: torch.Tensor, clip64: torch.Tensor,
        device: torch.device,
    ) -> torch.Tensor:
        """The host-vector step's float64 hyper-parameters (``functional.lamb_hparams``) of ``group``."""
        return F.lamb_hparams(
            lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], grad_averaging=group["grad_averaging"], step=step,
            inv_scale64=inv_scale64, clip64=clip64, device=device,
        )

    def _run_update(self, ops: Any, group: dict[str, Any], rows: _Rows, hp: Any, found_inf: torch.Tensor,
                    **kw: Any) -> None:
        """``ops.lamb_update`` (the functional API or the configured update ops) of ``group``'s rows."""
        ops.lamb_update(
            rows.params, rows.grads, rows.exp_avgs, rows.exp_avg_sqs, rows.models, hp, found_inf,
            weight_decay=float(group["weight_decay"]), adam_w_mode=self.adam_w_mode, use_nvlamb=self.use_nvlamb,
            **kw, **self._state_kw(),
        )

    def _device_step(self, group: dict[str, Any], base: DeviceStep) -> DeviceStep:
        max_norm = float(self.defaults["max_grad_norm"])
        device = base.step.device

        def legacy() -> torch.Tensor:
            inv_scale64 = F.inv_scale_from_grad_scale(base.scale, device)
            return self._hparams64(group, base.step + 1, inv_scale64, F.clip_factor(base.gnorm, max_norm), device)

        beta3 = 1.0 - float(group["betas"][0]) if group["grad_averaging"] else 1.0
        return self._adam_like_step(group, base, legacy, beta3=beta3, max_grad_norm=max_norm)

    def _run_device_update(self, group: dict[str, Any], rows: _Rows, ds: DeviceStep, skip: torch.Tensor) -> None:
        self._run_update(F, group, rows, ds, skip, weights=self._weights(group))
