"""FusedLAMB, FusedAdam, FusedSGD and FusedAdagrad on sharded parameters: FSDP2 (DTensor) and ZeRO-1
(``process_group=``, LAMB and Adam).

The kernels run on each rank's local shards. What a step sums over whole tensors is completed over the
shard group with **one batched all-reduce per norm stage** (the schedule of apex's DistributedFusedLAMB)::

    stage 0  (every rank)  local check-and-norm pass:   s = sum g^2 of the local grads,  f = local inf flag
    all-reduce #1          [s, f]  (2 float64, SUM)      -> global norm sqrt(S), skip when F > 0 (all ranks agree)
    stage 1  (LAMB)        m, v updated; per sharded param the partial sums sum p^2 (old p) and sum u^2
    all-reduce #2          [sum p^2 ..., sum u^2 ...] (2 float64 per sharded param, SUM)
    stage 2  (LAMB)        p -= lr * sqrt(P) / sqrt(U) * u   with the *full-tensor* norms

FusedAdam, FusedSGD and FusedAdagrad need only #1 (the flag: every rank must skip together; their updates are
elementwise, so a shard's step is bit for bit the single-process step of those elements; the result check of
the apex optimizers, ``_apex_common.py``, raises the flag before #1, so an overflow in one rank's shard skips
every rank). #2 runs only when a trust ratio is
used (``weight_decay != 0`` or ``use_nvlamb``) and some parameter is split; under ZeRO-1 parameters are
whole on their owner, so their norms are local and only #1 runs, over the given ``process_group``.

Which tensors are "split" is decided from the param list alone (DTensor placements), so every rank issues
the same collectives with the same sizes, even a rank whose shard of some parameter is empty.

The two stages are public ops of ``fp16kit.kernels`` (``lamb_stage1``/``lamb_stage2``,
fp16kit/kernels/optimizers.py): rows the Triton kernels take run ``triton/lamb.py``'s own stage-1 and stage-2
kernels with the all-reduce between them; the other rows run torch stages (the math of
``optim_fallback.py``'s ``lamb_``, with ``u`` kept between the stages). Both keep the skip on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fp16kit.distributed import is_dtensor, is_sharded, local, same_group, shard_group
from fp16kit.kernels import Bf16Weights, LambStaged, lamb_stage1, lamb_stage2

if TYPE_CHECKING:
    from ._base import FusedOptimizer
    from ._rows import _Rows

__all__ = ["ShardPlan", "ShardedSteps", "defer_lamb", "element_offsets", "localize", "refuse_dtensors"]

F64 = torch.float64


@dataclass
class _Pending:
    """One param group's LAMB update, waiting for the stage-2 norms."""

    rows: _Rows
    hp64: torch.Tensor
    modes: dict[str, bool]
    split: list[bool]
    state_bits: int = 32
    weights: Bf16Weights | None = None  # bf16 params without fp32 masters (split or stochastic rounding)


@dataclass
class ShardPlan:
    """How this step's sums are completed: over ``group`` (None: nothing to combine), per-row split flags."""

    name: str
    group: Any
    device: torch.device
    split: dict[int, list[bool]]  # id(rows) -> per row: the param's elements are spread over ``group``
    pending: list[_Pending] = field(default_factory=list)
    all_reduces: int = 0  # collectives issued this step (read by tests and the benchmark)
    bytes_reduced: int = 0

    def _all_reduce(self, buf: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
        self.all_reduces += 1
        self.bytes_reduced += buf.numel() * buf.element_size()

    def reduce_norm_and_flag(self, grad_norm: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
        """All-reduce #1: the global grad norm ``sqrt(sum_ranks norm_r^2)`` (fp32, 0-dim); ``found_inf`` is
        set in place on every rank when it was set on any. A no-op without a group."""
        if self.group is None:
            return grad_norm
        buf = torch.stack([grad_norm.reshape(()).to(F64).square(), found_inf.reshape(()).to(F64)])
        self._all_reduce(buf)
        found_inf.copy_((buf[1:] > 0).to(found_inf.dtype).reshape(found_inf.shape))
        return buf[0].sqrt().float()

    def finish(self, found_inf: torch.Tensor) -> None:
        """Stage 1 of every deferred LAMB group, all-reduce #2 of the split rows' partial norms, stage 2.

        ``found_inf`` is the step's flag, already combined by :meth:`reduce_norm_and_flag`: when it is set
        both stages are no-ops on the device (the all-reduce still runs, so every rank issues the same
        collectives)."""
        staged = [(job, _stage1(job, found_inf)) for job in self.pending]
        self.pending = []
        wanted = [
            (done.sums, [i for i, s in enumerate(job.split) if s])
            for job, done in staged
            if job.modes["trust"] and any(job.split)
        ]
        if self.group is not None and wanted:
            buf = torch.cat([sums[:, rows].to(F64).reshape(-1) for sums, rows in wanted])
            self._all_reduce(buf)
            start = 0
            for sums, rows in wanted:
                n = 2 * len(rows)
                sums[:, rows] = buf[start:start + n].reshape(2, len(rows)).to(sums.dtype)
                start += n
        for job, done in staged:
            lamb_stage2(done, found_inf, decoupled=job.modes["decoupled"], trust=job.modes["trust"])


def localize(optimizer: FusedOptimizer, all_rows: Sequence[_Rows]) -> ShardPlan | None:
    """Swap DTensors in ``all_rows`` for their local shards (in place) and plan this step's collectives.

    Returns None (and changes nothing) when no param is a DTensor and no ``process_group`` was given: the
    single-process step. The plan is also kept in ``optimizer._step_cache`` (``optimizer._shard_plan``) for
    :func:`defer_lamb`.
    """
    explicit = getattr(optimizer, "process_group", None)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    any_dt, group = shard_group(optimizer._name, params)
    cache = optimizer._step_cache  # a dict: Dynamo drops (torch 2.13) or fails on (2.11) an attribute store
    cache["shard_plan"] = None
    if explicit is None and not any_dt:
        return None
    if explicit is not None and group is not None and not same_group(explicit, group):
        raise ValueError(
            f"{optimizer._name}: process_group spans other ranks than the device mesh the DTensor params are "
            f"sharded over. DTensor params carry their group; pass process_group only for plain params "
            f"partitioned across ranks (ZeRO-1)."
        )
    split: dict[int, list[bool]] = {}
    for rows in all_rows:
        split[id(rows)] = [is_sharded(p if m is None else m) for p, m in zip(rows.params, rows.models)]
        _localize_rows(rows)
    device = local(params[0]).device if params else torch.device("cpu")
    plan = ShardPlan(optimizer._name, group if group is not None else explicit, device, split)
    cache["shard_plan"] = plan
    return plan


def _localize_rows(rows: Any) -> None:
    """Every DTensor of one group's rows replaced by its local shard (the same storage: writes land in the
    DTensor). LAMB/Adam rows (``_Rows``) list their moments; apex rows (``_apex_common.ApexRows``) keep each
    param's state in a dict: the row gets its own dict of local tensors, the optimizer's state is untouched."""
    for name in ("params", "grads"):
        if hasattr(rows, name):
            setattr(rows, name, [local(t) for t in getattr(rows, name)])
    for name in ("exp_avgs", "exp_avg_sqs"):
        if hasattr(rows, name):
            setattr(rows, name, [_local_moment(t) for t in getattr(rows, name)])
    rows.models = [None if m is None else local(m) for m in rows.models]
    if hasattr(rows, "states"):
        rows.states = [{k: local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in rows.states]


def _local_moment(t: torch.Tensor) -> torch.Tensor:
    """A moment's local shard; the empty shard of an 8-bit moment (``state_bits=8``) as an empty fp32 tensor: the
    kernels apply the small-tensor rule (fp32 below ``SMALL_NUMEL`` elements) to the shard they are given, and an
    empty row is a no-op either way."""
    x = local(t)
    if x.dtype == torch.uint8 and x.numel() == 0:
        return torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return x


def refuse_dtensors(name: str, param_group: Any, why: str) -> None:
    """A clear ``ValueError`` at construction (or ``add_param_group``) when a param of ``param_group`` is a
    DTensor (FSDP2) and the optimizer's math needs what a shard alone cannot give (``why``): better than a
    wrong step or an error deep in a step. An iterator of params is materialized into the group's list."""
    if not isinstance(param_group, dict):
        return  # the optimizer's own add_param_group names that error
    params = param_group.get("params")
    if not isinstance(params, (torch.Tensor, list, tuple, set)) and params is not None:
        params = param_group["params"] = list(params)
    if any(is_dtensor(p) for p in ([params] if isinstance(params, torch.Tensor) else params or ())):
        raise ValueError(
            f"{name} does not support FSDP2/DTensor parameters: {why}. Use FusedAdam, FusedLAMB, FusedSGD or "
            f"FusedAdagrad on sharded parameters (they step the local shards, combining what is needed across "
            f"ranks), or keep this optimizer for unsharded models."
        )


def defer_lamb(
    optimizer: FusedOptimizer,
    rows: _Rows,
    hp64: torch.Tensor,
    *,
    weight_decay: float,
    adam_w_mode: bool,
    use_nvlamb: bool,
    weights: Bf16Weights | None = None,
) -> bool:
    """In a sharded step, queue one group's LAMB update for :meth:`ShardPlan.finish` and return True;
    return False (the caller updates at once) in a single-process step. ``weights`` (the bf16 modes): queued only
    when some row is split over ranks (FSDP2); whole params (ZeRO-1) run the one-process update at once, their
    trust-ratio norms being local."""
    plan: ShardPlan | None = optimizer._shard_plan
    if plan is None or (weights is not None and not any(plan.split[id(rows)])):
        return False
    modes = {
        "l2_mode": not adam_w_mode and weight_decay != 0,
        "decoupled": adam_w_mode and weight_decay != 0,
        "trust": use_nvlamb or weight_decay != 0,
    }
    plan.pending.append(_Pending(rows, hp64, modes, plan.split[id(rows)], optimizer.state_bits, weights))
    return True


def _stage1(job: _Pending, found_inf: torch.Tensor) -> LambStaged:
    """Stage 1 of one deferred group (``fp16kit.kernels.lamb_stage1``): m, v updated, per-row sums of p^2, u^2."""
    r = job.rows
    return lamb_stage1(
        r.params, r.grads, r.exp_avgs, r.exp_avg_sqs, r.models, job.hp64, found_inf,
        l2_mode=job.modes["l2_mode"], decoupled=job.modes["decoupled"], state_bits=job.state_bits,
        weights=job.weights,
    )


def element_offsets(name: str, params: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """Each param's local shard's first element's index in its whole flattened tensor (0 for a plain tensor or an
    empty shard), or None when every one is 0: where stochastic rounding's element counter starts on this rank
    (``kernels/bf16_weights/modes.py``). A shard must be a contiguous range of its tensor: DTensor's ``Shard(d)``
    (torch.chunk's split) on one mesh dimension, whole in every dimension after ``d`` and one element thick in
    every dimension before it (FSDP2's dim-0 sharding, HSDP); else ``NotImplementedError``."""
    from torch.distributed.tensor import Shard

    out = []
    for i, p in enumerate(params):
        if not is_sharded(p) or not local(p).numel():
            out.append(0)
            continue
        shape, loc = list(p.shape), list(local(p).shape)
        start = [0] * len(shape)
        coords = p.device_mesh.get_coordinate()
        for mesh_dim, pl in enumerate(p.placements):
            if pl.is_shard():
                if type(pl) is not Shard:
                    start = None
                    break
                d = pl.dim % len(shape)
                size = -(-shape[d] // p.device_mesh.size(mesh_dim))  # torch.chunk's piece
                start[d] += coords[mesh_dim] * size
        first = next((d for d, n in enumerate(loc) if n != 1), len(loc))
        if start is None or loc[first + 1:] != shape[first + 1:] or any(
            s + n > full for s, n, full in zip(start, loc, shape)
        ):
            raise NotImplementedError(
                f"{name}: master_weights='stochastic' needs each local shard to be a contiguous range of its param "
                f"(FSDP2's Shard(0)); param {i} of shape {tuple(shape)} is placed {p.placements} (local shape "
                f"{tuple(loc)}). Use master_weights='split' there."
            )
        stride, flat = 1, 0
        for s, full in zip(reversed(start), reversed(shape)):
            flat += s * stride
            stride *= full
        out.append(flat)
    return tuple(out) if any(out) else None


class ShardedSteps:
    """Mixed in before ``FusedOptimizer`` (``class FusedAdam(ShardedSteps, FusedOptimizer)``): the optimizer steps
    FSDP2 (DTensor) params and ZeRO-1 partitions (``process_group=``). Implements the base's two hooks of the
    sharded step: the shard plan and the element offsets of stochastic rounding."""

    def _plan_shards(self: FusedOptimizer, all_rows: Sequence[_Rows]) -> ShardPlan | None:
        """``localize``: local shards and the group to sum over (None for a single-process step)."""
        return localize(self, all_rows)

    def _shard_offsets(self: FusedOptimizer, present: list[torch.Tensor]) -> tuple[int, ...] | None:
        """``element_offsets`` of ``present`` (the rows of a group: its params with a grad, in order), kept per
        param list in the step cache."""
        known = self._step_cache.setdefault("bf16_offsets", {})
        key = tuple(map(id, present))
        if key not in known:
            known[key] = element_offsets(self._name, present)
        return known[key]
