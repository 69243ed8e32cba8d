"""``FusedAdam``: Adam/AdamW (apex's constructor, torch.optim's numbers) on one multi-tensor Triton pass."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fp16kit.kernels import DeviceStep

from . import functional as F
from ._base import FusedOptimizer
from ._rows import _Rows
from ._sharding import ShardedSteps
from ._validate import check_hyperparams, refuse_amsgrad

__all__ = ["FusedAdam"]


class FusedAdam(ShardedSteps, FusedOptimizer):
    """Adam (``adam_w_mode=False``) or AdamW (default), matching ``torch.optim.Adam``/``AdamW`` to fp32 rounding.

    Per param, with ``t`` the group's step counter after the increment::

        g = grad / grad_scale           [+ wd * p  when adam_w_mode=False: L2 penalty]
        m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd)               when adam_w_mode=True (decoupled decay)
        p = p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    One fused pass reads g, p, m, v and writes p, m, v (and the rounded model copy in master-weights
    mode), after a read-only check pass over the grads that detects inf/NaN. Constructor as apex's
    FusedAdam (``capturable`` is accepted and ignored: every step is already device-side and sync-free);
    ``master_weights`` (``True``, or bf16 params without fp32 masters: ``"split"``, exact, and ``"stochastic"``),
    ``rounding_seed``, ``on_nonfinite`` and ``process_group`` as in :class:`fp16kit.optim.FusedLAMB`
    (DTensor params step on their local shards; the inf flag is combined over the shard group, so every
    rank skips together; in both bf16 modes too: split steps each shard's masters bit for bit as ``True`` does,
    stochastic rounding draws the one-process bits of each shard's elements, so a sharded run is the one-process
    run bit for bit; a shard that is not a contiguous range of its param raises NotImplementedError).
    ``amsgrad=True`` raises RuntimeError. ``load_state_dict`` accepts ``torch.optim.Adam``/``AdamW`` checkpoints
    (``docs/optim.md``). ``torch.compile(opt.step)`` captures the
    step in one graph, bit-identical to eager (docs/optim.md, "torch.compile").
    ``state_bits=8``: 8-bit moments (block-wise dynamic quantization, 256-element blocks, fp32 absmax) for params
    of at least 4096 elements, dequantized and requantized in the same pass (docs/optim.md, "8-bit moments");
    FSDP2 (DTensor) shards that start at a multiple of 256 elements step with the whole tensor's blocks (bit for bit
    the one-process step; other offsets raise ValueError naming the fix); not with ``torch.compile``
    (``NotImplementedError``).
    """

    _bf16_modes = True
    _name = "FusedAdam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool | str = False,
        *,
        on_nonfinite: str = "warn",
        process_group: Any = None,
        rounding_seed: int | None = None,
        state_bits: int = 32,
    ) -> None:
        refuse_amsgrad("FusedAdam", amsgrad)
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        self._check_group(defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.capturable = bool(capturable)
        options = {"master_weights": master_weights, "on_nonfinite": on_nonfinite, "process_group": process_group,
                   "rounding_seed": rounding_seed, "state_bits": state_bits}
        super().__init__(params, defaults, set_grad_none=set_grad_none, **options)

    def _check_group(self, group: dict[str, Any]) -> None:
        check_hyperparams(self._name, **{k: group[k] for k in ("lr", "betas", "eps", "weight_decay")})

    def _check_factor(self) -> float:
        return self._SQUARE_GUARD  # v = beta2 * v + (1 - beta2) * g * g, unclipped

    def _needs_grad_norm(self) -> bool:
        return False  # no clipping

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
        hp64 = self._hparams64(group, step, inv_scale64, rows.params[0].device)
        weights = self._weights(group)
        self._run_update(
            F if weights is not None else self._updates(), group, rows, hp64, found_inf,
            step=step, **({} if weights is None else {"weights": weights}),
        )

    def _hparams64(
        self, group: dict[str, Any], step: torch.Tensor, inv_scale64: torch.Tensor, device: torch.device
    ) -> torch.Tensor:
        """The host-vector step's float64 hyper-parameters (``functional.adam_hparams``) of ``group``."""
        return F.adam_hparams(
            lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"], step=step, inv_scale64=inv_scale64, device=device,
        )

    def _run_update(self, ops: Any, group: dict[str, Any], rows: _Rows, hp: Any, found_inf: torch.Tensor,
                    **kw: Any) -> None:
        """``ops.adam_update`` (the functional API or the configured update ops) of ``group``'s rows."""
        ops.adam_update(
            rows.params, rows.grads, rows.exp_avgs, rows.exp_avg_sqs, rows.models, hp, found_inf,
            weight_decay=float(group["weight_decay"]), adam_w_mode=self.adam_w_mode, **kw, **self._state_kw(),
        )

    def _device_step(self, group: dict[str, Any], base: DeviceStep) -> DeviceStep:
        device = base.step.device

        def legacy() -> torch.Tensor:
            return self._hparams64(group, base.step + 1, F.inv_scale_from_grad_scale(base.scale, device), device)

        return self._adam_like_step(group, base, legacy)

    def _run_device_update(self, group: dict[str, Any], rows: _Rows, ds: DeviceStep, skip: torch.Tensor) -> None:
        self._run_update(F, group, rows, ds, skip, weights=self._weights(group))
