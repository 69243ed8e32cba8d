"""What FusedLAMB and FusedAdam share: state, master weights, the loss-scaler hand-over, checkpoints.

The step skeleton (``FusedOptimizer.step``)::

    rows    = params with a grad, per group (the fp32 master instead of the param in master-weights mode)
    inv     = 1 / optimizer.grad_scale            (set by a GradScaler; 1 without one)
    flag    = optimizer.found_inf                 (set by a GradScaler; else a fresh zeroed flag)
    gnorm   = check-and-norm pass over all grads  (raises flag on any inf/NaN: one read of the grads)
    for each group: step += (flag == 0); the subclass's update (a no-op on the device when flag is set)

Nothing here reads a device value on the host, except the ``on_nonfinite="raise"`` policy when no scaler
provides ``found_inf``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from fp16kit.kernels._checks import check_flag, common_device

from . import _sharding
from . import functional as F
from ._validate import check_param_tensor, check_sparse_grad

__all__ = ["FusedOptimizer"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_POLICIES = ("skip", "warn", "raise")


@dataclass
class _Rows:
    """The tensors one group's update works on, paired by position."""

    params: list[torch.Tensor] = field(default_factory=list)  # masters in master-weights mode
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    models: list[torch.Tensor | None] = field(default_factory=list)  # low-precision params that get a copy


class FusedOptimizer(torch.optim.Optimizer):
    """Base class: subclasses define ``_name``, ``_check_group`` and ``_update_group``."""

    # torch.amp.GradScaler (and fp16kit's) hands us grad_scale/found_inf instead of unscaling grads itself.
    _step_supports_amp_scaling = True
    # fp16kit's GradScaler then passes a zeroed found_inf and lets our norm pass detect inf/NaN.
    _fp16kit_checks_inf = True
    _name = "FusedOptimizer"

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        set_grad_none: bool,
        master_weights: bool,
        on_nonfinite: str,
        process_group: Any = None,
    ) -> None:
        if on_nonfinite not in _POLICIES:
            raise ValueError(
                f"{self._name}: on_nonfinite={on_nonfinite!r} is not understood; choose 'skip' (skip the step "
                f"silently), 'warn' (skip and warn) or 'raise' (skip and raise RuntimeError)."
            )
        self.set_grad_none = bool(set_grad_none)
        self.master_weights = bool(master_weights)
        self.on_nonfinite = on_nonfinite
        # ZeRO-1: the ranks whose params together form the model (global norm and inf flag summed over them).
        self.process_group = process_group
        self._pending: list[tuple[Any, torch.Tensor]] = []
        super().__init__(params, defaults)

    # -- param groups ---------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated: dense real float params, valid hyper-parameters)."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):
            check_param_tensor(self._name, i, p)
        self._check_group(group)

    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear grads; ``set_to_none`` defaults to the constructor's ``set_grad_none`` (apex semantics)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # -- state ----------------------------------------------------------------------------------------------

    def _state_for(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Lazily created state: fp32 moments (fp64 for fp64 params) and, in master-weights mode, an fp32
        master copy of each fp16/bf16 param."""
        state = self.state[p]
        if not state:
            math = torch.float64 if p.dtype == torch.float64 else torch.float32
            if self.master_weights and p.dtype in _LOW_PRECISION:
                state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            state["exp_avg"] = torch.zeros_like(p, dtype=math, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=math, memory_format=torch.contiguous_format)
        return state

    def _collect(self) -> list[_Rows]:
        """Rows of every group (params without a grad are left out)."""
        out = []
        for group in self.param_groups:
            rows = _Rows()
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                check_sparse_grad(self._name, i, p.grad)
                state = self._state_for(p)
                master = state.get("master")
                rows.params.append(p if master is None else master)
                rows.models.append(None if master is None else p)
                rows.grads.append(p.grad)
                rows.exp_avgs.append(state["exp_avg"])
                rows.exp_avg_sqs.append(state["exp_avg_sq"])
            out.append(rows)
        return out

    @staticmethod
    def _group_step(group: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The group's step counter: a one-element fp32 tensor on the device (apex keeps it per group)."""
        step = group.get("step")
        if not isinstance(step, torch.Tensor) or step.device != device or step.dtype != torch.float32:
            value = step if step is not None else 0
            step = torch.as_tensor(value, dtype=torch.float32).reshape(1).to(device)
            group["step"] = step
        return step

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates: fp32 masters where they exist, else the params themselves."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state[p].get("master") if p in self.state else None
                out.append(p if master is None else master)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint, keeping the saved dtypes: fp32 moments and masters stay fp32 for fp16 params
        (``torch.optim.Optimizer`` would cast them to the param dtype, losing bits)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(idx, {}).items():
                if isinstance(value, torch.Tensor):
                    self.state[p][key] = value.detach().to(p.device, copy=True)
        for group in self.param_groups:
            if group["params"] and "step" in group:
                self._group_step(group, group["params"][0].device)

    # -- step -----------------------------------------------------------------------------------------------

    def _update_group(
        self,
        group: dict[str, Any],
        rows: _Rows,
        step: torch.Tensor,
        inv_scale64: torch.Tensor,
        found_inf: torch.Tensor,
        grad_norm: torch.Tensor,
    ) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step over every group (see the class docstring for the math).

        Under a GradScaler (``optimizer.grad_scale``/``optimizer.found_inf`` set by it) the grads are
        unscaled inside the step and a set ``found_inf`` makes the step a no-op on the device. Without a
        scaler, a non-finite grad skips the step and then warns, raises or stays silent per ``on_nonfinite``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._flush_warnings()
        all_rows = self._collect()
        shards = _sharding.localize(self, all_rows)  # FSDP2/ZeRO: local shards and the group to sum over
        device = common_device(
            self._name, [p for rows in all_rows for p in rows.params], [g for rows in all_rows for g in rows.grads]
        )
        if device is None and shards is not None:
            device = shards.device  # no grads here, but this rank must still join the collectives
        if device is None:
            return loss
        inv64 = F.inv_scale_from_grad_scale(getattr(self, "grad_scale", None), device)
        found_inf = getattr(self, "found_inf", None)
        own_flag = found_inf is None
        if own_flag:
            found_inf = F.new_flag(device)
        else:
            check_flag(f"{self._name}.step", found_inf, device)
        grad_norm = F.check_and_norm([g for rows in all_rows for g in rows.grads], inv64, found_inf)
        if shards is not None:
            grad_norm = shards.reduce_norm_and_flag(grad_norm, found_inf)
        for group, rows in zip(self.param_groups, all_rows):
            step = self._group_step(group, device)
            F.advance_step(step, found_inf)
            self._update_group(group, rows, step, inv64, found_inf, grad_norm)
        if shards is not None:
            shards.finish(found_inf)
        if own_flag:
            self._handle_nonfinite(found_inf)
        return loss

    # -- non-finite grads without a scaler ------------------------------------------------------------------

    def _message(self) -> str:
        return (
            f"{self._name}: a gradient holds inf or NaN; the step was skipped (params, moments and the step "
            f"counter are unchanged). Use a GradScaler for fp16 training, or lower the learning rate."
        )

    def _handle_nonfinite(self, found_inf: torch.Tensor) -> None:
        if self.on_nonfinite == "skip":
            return
        if self.on_nonfinite == "raise" or found_inf.device.type != "cuda":
            # A CPU tensor is read without any queue to drain; elsewhere "raise" is a documented sync.
            if bool(found_inf.reshape(())):
                if self.on_nonfinite == "raise":
                    raise RuntimeError(self._message())
                warnings.warn(self._message(), RuntimeWarning, stacklevel=3)
            return
        # "warn" on CUDA: copy the flag to pinned host memory without a sync; look at it next step.
        host = torch.empty(1, dtype=found_inf.dtype, pin_memory=True)
        host.copy_(found_inf.reshape(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host))

    def _flush_warnings(self) -> None:
        """Warn for earlier skipped steps whose flag has reached the host (never waits)."""
        still = []
        for event, host in self._pending:
            if not event.query():
                still.append((event, host))
            elif bool(host[0] != 0):
                warnings.warn(self._message(), RuntimeWarning, stacklevel=3)
        self._pending = still
