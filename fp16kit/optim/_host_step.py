"""The host-vector step: each group's hyper-parameters as a float64 vector, one check-and-norm pass over every
grad, then the subclass's update per group (``_update_group``), the skip applied on the device.

It serves three of the step's paths (``FusedOptimizer.step``): the eager step where the device step does not
apply (the torch fallback's backend, a grad scale the kernels cannot read), the compiled step (the passes are
then the ``fp16kit::`` dispatcher ops, and step counters set by hand are checked on the device) and the sharded
step (``_sharding.ShardedSteps``: the norm and the flag summed over the shard group between the passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fp16kit.kernels import (
    check_found_inf,
    flag_is_final,
    flag_nonfinite,
    library,
    new_found_inf,
    unscale_and_check,
    vouched_rows,
)

from . import functional as F
from ._rows import _Rows

__all__ = ["HostStepMixin"]


class HostStepMixin:
    """``FusedOptimizer``'s host-vector path (the subclass's ``_update_group`` is the update)."""

    @staticmethod
    def _updates() -> Any:
        """Where the passes come from: the dispatcher ops while ``torch.compile`` traces a step (Dynamo then
        sees one ``fp16kit::`` op per pass, not the launchers' ``data_ptr()`` reads), the eager functions
        (``fp16kit.optim.functional``: no dispatcher cost) otherwise. Both run the same implementation."""
        return library if torch.compiler.is_compiling() else F

    def _check_results(self, all_rows: list, inv_scale64: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Raise ``found_inf`` on the device when this step's update would store an inf/NaN (a finite grad
        can overflow it); runs before any group is written. A no-op here (subclasses: fp16kit/optim/_apex_common.py)."""

    def _update_group(self, group: dict[str, Any], rows: _Rows, step: torch.Tensor, inv_scale64: torch.Tensor,
                      found_inf: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The subclass's update of one group's rows (a no-op on the device where ``found_inf`` is set)."""
        raise NotImplementedError

    def _step_host_vector(
        self,
        all_rows: list[_Rows],
        device: torch.device,
        *,
        shards: Any = None,
        unchecked_steps: Sequence[torch.Tensor] = (),
    ) -> None:
        """The check pass, the skip, every group's update and the report. ``shards``: the sharded step's
        ``_sharding.ShardPlan`` (the norm and flag reduced over its group before the updates, its deferred stages
        finished after them); ``unchecked_steps``: step counters a compiled step checks on the device."""
        inv64 = F.inv_scale_from_grad_scale(getattr(self, "grad_scale", None), device)
        found_inf = getattr(self, "found_inf", None)
        own_flag = found_inf is None
        if own_flag:
            found_inf = new_found_inf(device)
        else:
            check_found_inf(f"{self._name}.step", found_inf, device)
        factor = self._check_factor()
        if shards is None and not self._needs_grad_norm() and not torch.compiler.is_compiling():
            grad_norm = torch.zeros((), dtype=torch.float32, device=device)  # not used
            if own_flag or not flag_is_final(self):
                # the check alone (no norm): fp16kit.kernels.flag_nonfinite, C-level on the CPU (a norm pass
                # there is per-tensor Python); the caller's final flag (fp16kit/kernels/found_inf.py, "Final
                # flags": amp O2's fused path) already covers these grads at this scale
                flag_nonfinite([g for rows in all_rows for g in rows.grads], inv64.float() * factor, found_inf)
        else:
            guard = inv64 if self._needs_grad_norm() else inv64 * factor  # the norm is then unused
            grad_norm = F.check_and_norm(
                [g for rows in all_rows for g in rows.grads], guard, found_inf, exact=self._exact_norm()
            )
        self._check_results(all_rows, inv64, found_inf)  # before any write and before the flag is shared
        if shards is not None:
            grad_norm = shards.reduce_norm_and_flag(grad_norm, found_inf)
        counters = [s.to(device, torch.float64) for s in unchecked_steps]
        bad_hp = F.bad_lr_flag([g["lr"] for g in self.param_groups] + counters, device)
        skip = found_inf if bad_hp is None else torch.maximum(found_inf.reshape(1), bad_hp)
        # The rows' tensors passed their group verdict's guard in _collect this step (eager, unsharded): the
        # planner may take that for its own metadata guard on the same lists (fp16kit.kernels.vouched_rows).
        verdicts = self.__dict__.get("_verdicts", {}) if shards is None and not torch.compiler.is_compiling() else {}
        for gi, (group, rows) in enumerate(zip(self.param_groups, all_rows)):
            step = self._own_step(gi, group, device)
            if rows.params:  # a group without grads keeps its counter (docs/optim.md, "Step counters")
                F.advance_step(step, skip)
            verdict = verdicts.get(id(group)) if verdicts else None  # (no id() while compiling)
            if verdict is None:
                self._update_group(group, rows, step, inv64, skip, grad_norm)
                continue
            with vouched_rows(verdict, (rows.params, rows.grads, rows.exp_avgs, rows.exp_avg_sqs, rows.models)):
                self._update_group(group, rows, step, inv64, skip, grad_norm)
        if shards is not None:
            shards.finish(skip)
        if self.unscale_grads and getattr(self, "grad_scale", None) is not None:
            self._write_unscaled_grads([g for rows in all_rows for g in rows.grads], inv64, device)
        self._count_and_report(bad_hp, found_inf if own_flag else None, device)

    def _write_unscaled_grads(self, grads: list[torch.Tensor], inv64: torch.Tensor, device: torch.device) -> None:
        """apex's semantics after a GradScaler step: ``p.grad`` holds unscaled gradients (one extra write pass,
        after the update has read them scaled). fp16kit's default leaves them scaled, as torch's fused
        optimizers do."""
        grads = [g for g in grads if g.numel()]
        if grads:
            unscale = library.unscale_and_check if torch.compiler.is_compiling() else unscale_and_check
            unscale(grads, inv64.float(), new_found_inf(device))
