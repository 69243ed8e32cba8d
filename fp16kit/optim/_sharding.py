"""FusedLAMB and FusedAdam on sharded parameters: FSDP2 (DTensor) and ZeRO-1 (``process_group=``).

The kernels run on each rank's local shards. What a step sums over whole tensors is completed over the
shard group with **one batched all-reduce per norm stage** (the schedule of apex's DistributedFusedLAMB)::

    stage 0  (every rank)  local check-and-norm pass:   s = sum g^2 of the local grads,  f = local inf flag
    all-reduce #1          [s, f]  (2 float64, SUM)      -> global norm sqrt(S), skip when F > 0 (all ranks agree)
    stage 1  (LAMB)        m, v updated; per sharded param the partial sums sum p^2 (old p) and sum u^2
    all-reduce #2          [sum p^2 ..., sum u^2 ...] (2 float64 per sharded param, SUM)
    stage 2  (LAMB)        p -= lr * sqrt(P) / sqrt(U) * u   with the *full-tensor* norms

FusedAdam needs only #1 (the flag: every rank must skip together). #2 runs only when a trust ratio is
used (``weight_decay != 0`` or ``use_nvlamb``) and some parameter is split; under ZeRO-1 parameters are
whole on their owner, so their norms are local and only #1 runs, over the given ``process_group``.

Which tensors are "split" is decided from the param list alone (DTensor placements), so every rank issues
the same collectives with the same sizes, even a rank whose shard of some parameter is empty.

Kernel paths: rows the Triton kernels take run ``lamb_kernel.py``'s own stage-1 and stage-2 kernels with
the all-reduce between them (``_kernel_stage1``/``_kernel_stage2``: ``launch_lamb`` cut in two); the other
rows run the torch stages below (the math of ``fp16kit/kernels/optim_fallback.py``'s ``lamb_``, with ``u``
kept between the stages). Both keep the skip on the device (no host sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fp16kit.distributed import is_sharded, local, same_group, shard_group
from fp16kit.kernels import optim_fallback as fallback
from fp16kit.kernels._table import chunk_table, num_programs, triton_dtype

from . import functional as F

if TYPE_CHECKING:
    from ._base import FusedOptimizer, _Rows

__all__ = ["ShardPlan", "defer_lamb", "localize"]

F64 = torch.float64


@dataclass
class _Pending:
    """One param group's LAMB update, waiting for the stage-2 norms."""

    rows: _Rows
    hp64: torch.Tensor
    modes: dict[str, bool]
    split: list[bool]


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
        flag = found_inf.reshape(1)
        staged = [(job, _stage1(job, flag)) for job in self.pending]
        self.pending = []
        wanted = [
            (sums, [i for i, s in enumerate(job.split) if s])
            for job, (sums, _) in staged
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
        for job, (sums, parts) in staged:
            _stage2(job, sums, parts, flag)


def localize(optimizer: FusedOptimizer, all_rows: Sequence[_Rows]) -> ShardPlan | None:
    """Swap DTensors in ``all_rows`` for their local shards (in place) and plan this step's collectives.

    Returns None (and changes nothing) when no param is a DTensor and no ``process_group`` was given: the
    single-process step. The plan is also kept on ``optimizer._shard_plan`` for :func:`defer_lamb`.
    """
    explicit = getattr(optimizer, "process_group", None)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    any_dt, group = shard_group(optimizer._name, params)
    optimizer._shard_plan = None
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
        for name in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
            setattr(rows, name, [local(t) for t in getattr(rows, name)])
        rows.models = [None if m is None else local(m) for m in rows.models]
    device = local(params[0]).device if params else torch.device("cpu")
    plan = ShardPlan(optimizer._name, group if group is not None else explicit, device, split)
    optimizer._shard_plan = plan
    return plan


def defer_lamb(
    optimizer: FusedOptimizer,
    rows: _Rows,
    hp64: torch.Tensor,
    *,
    weight_decay: float,
    adam_w_mode: bool,
    use_nvlamb: bool,
) -> bool:
    """In a sharded step, queue one group's LAMB update for :meth:`ShardPlan.finish` and return True;
    return False (the caller updates at once) in a single-process step."""
    plan: ShardPlan | None = getattr(optimizer, "_shard_plan", None)
    if plan is None:
        return False
    modes = {
        "l2_mode": not adam_w_mode and weight_decay != 0,
        "decoupled": adam_w_mode and weight_decay != 0,
        "trust": use_nvlamb or weight_decay != 0,
    }
    plan.pending.append(_Pending(rows, hp64, modes, plan.split[id(rows)]))
    return True


# ---------------------------------------------------------------------------------------------------------
# the two stages, per group: kernel rows (Triton) and the rest (torch)


def _stage1(job: _Pending, flag: torch.Tensor) -> tuple[torch.Tensor, list[tuple[str, list[int], Any]]]:
    """Stage 1 over every row of one group: ``sums[0, i] = sum p_i^2`` (old p), ``sums[1, i] = sum u_i^2``
    (fp32, as the kernels keep them), and what stage 2 needs per subgroup of rows."""
    r = job.rows
    device = r.params[0].device
    sums = torch.zeros(2, len(r.params), dtype=torch.float32, device=device)
    kernel_groups, rest_groups = F._split_rows(device, r.params, r.grads, r.exp_avgs, r.exp_avg_sqs, r.models)
    parts: list[tuple[str, list[int], Any]] = []
    for idx in kernel_groups:
        state = _kernel_stage1(job, idx, flag)
        sums[0, idx], sums[1, idx] = state[1], state[2]
        parts.append(("kernel", idx, state))
    for idx in rest_groups:
        state = _torch_stage1(job, idx, flag)
        sums[:, idx] = state[-1].to(torch.float32)
        parts.append(("torch", idx, state))
    return sums, parts


def _stage2(
    job: _Pending, sums: torch.Tensor, parts: list[tuple[str, list[int], Any]], flag: torch.Tensor
) -> None:
    for kind, idx, state in parts:
        if kind == "kernel":
            _kernel_stage2(job, idx, state[0], sums[1, idx].contiguous(), sums[0, idx].contiguous(), flag)
        else:
            _torch_stage2(job, idx, state, sums[:, idx], flag)


def _pick(tensors: Sequence, idx: list[int]) -> list:
    return [tensors[i] for i in idx]


def _lists(job: _Pending, idx: list[int]) -> tuple[list, list, list, list, list]:
    r = job.rows
    return (_pick(r.params, idx), _pick(r.grads, idx), _pick(r.exp_avgs, idx), _pick(r.exp_avg_sqs, idx),
            _pick(r.models, idx))


def _kernel_stage1(job: _Pending, idx: list[int], flag: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``launch_lamb``'s first half: stage-1 kernel (m, v written) and per-tensor sums of p^2 and u^2."""
    from fp16kit.kernels.l2norm_kernel import segment_sums
    from fp16kit.kernels.lamb_kernel import LAUNCH, _lamb_stage1_kernel

    params, grads, exp_avgs, exp_avg_sqs, models = _lists(job, idx)
    table = chunk_table([params, grads, exp_avgs, exp_avg_sqs, params if models[0] is None else models],
                        written=(0, 2, 3) if models[0] is None else (0, 2, 3, 4))
    device = params[0].device
    u_partials = torch.empty(table.num_chunks, dtype=torch.float32, device=device)
    p_partials = torch.empty(table.num_chunks, dtype=torch.float32, device=device)
    _lamb_stage1_kernel[(num_programs(device, table.num_chunks),)](
        table.ptrs, table.num_tensors, table.numels, table.chunk_tensor, table.chunk_start, table.num_chunks,
        job.hp64.float(), flag, u_partials, p_partials,
        P_DTYPE=triton_dtype(params[0].dtype), G_DTYPE=triton_dtype(grads[0].dtype),
        L2_MODE=job.modes["l2_mode"], DECOUPLED=job.modes["decoupled"],
        BLOCK=table.block, ALIGNED=table.aligned, **LAUNCH["_lamb_stage1_kernel"],
    )
    return table, segment_sums(p_partials, table), segment_sums(u_partials, table)


def _kernel_stage2(
    job: _Pending, idx: list[int], table: Any, u_sumsq: torch.Tensor, p_sumsq: torch.Tensor, flag: torch.Tensor
) -> None:
    """``launch_lamb``'s second half with the completed (all-reduced) per-tensor sums."""
    from fp16kit.kernels.lamb_kernel import LAUNCH, _lamb_stage2_kernel

    params, _, _, _, models = _lists(job, idx)
    device = params[0].device
    p_dtype = triton_dtype(params[0].dtype)
    _lamb_stage2_kernel[(num_programs(device, table.num_chunks),)](
        table.ptrs, table.num_tensors, table.numels, table.chunk_tensor, table.chunk_start, table.num_chunks,
        job.hp64.float(), flag, u_sumsq, p_sumsq,
        P_DTYPE=p_dtype, MODEL_DTYPE=p_dtype if models[0] is None else triton_dtype(models[0].dtype),
        HAS_MODEL=models[0] is not None, DECOUPLED=job.modes["decoupled"], TRUST=job.modes["trust"],
        BLOCK=table.block, ALIGNED=table.aligned, **LAUNCH["_lamb_stage2_kernel"],
    )


def _torch_stage1(job: _Pending, idx: list[int], flag: torch.Tensor) -> tuple:
    """Stage 1 in torch ops (the math of ``optim_fallback.lamb_``), keeping ``u`` for stage 2.

    CPU (the skip read on the host, no queue to drain): nothing at all when skipped, else m, v updated in
    place with host-number hyper-parameters, as the kernel's stage 1 writes them. Elsewhere: m, v computed
    into copies, committed in stage 2 under ``torch.where(found_inf, old, new)``.
    """
    params, grads, exp_avgs, exp_avg_sqs, _ = _lists(job, idx)
    hp = job.hp64 if params[0].dtype == F64 else job.hp64.float()
    skip = fallback._skip(flag, None)
    sums = torch.zeros(2, len(idx), dtype=F64, device=hp.device)
    if skip is True:
        return hp, skip, None, None, None, None, sums
    _, beta1, beta2, beta3, one_minus_beta2, eps, wd, bc1, bc2, inv_scale, clip = (
        hp.tolist() if skip is False else hp.unbind()
    )
    in_place = skip is False
    p = [t.to(hp.dtype) for t in params]  # may alias the params: only out-of-place ops on it here
    g = torch._foreach_mul([t.to(hp.dtype) for t in grads], inv_scale)
    torch._foreach_div_(g, clip)
    if job.modes["l2_mode"]:
        torch._foreach_add_(g, torch._foreach_mul(p, wd))
    m = list(exp_avgs) if in_place else [t.clone() for t in exp_avgs]
    v = list(exp_avg_sqs) if in_place else [t.clone() for t in exp_avg_sqs]
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, torch._foreach_mul(g, beta3))
    torch._foreach_mul_(v, beta2)
    gg = torch._foreach_mul(g, one_minus_beta2)
    torch._foreach_mul_(gg, g)
    torch._foreach_add_(v, gg)
    u = torch._foreach_div(m, bc1)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    if job.modes["decoupled"]:
        torch._foreach_add_(u, torch._foreach_mul(p, wd))
    sums[0] = torch.stack(torch._foreach_norm(p)).to(F64).square()
    sums[1] = torch.stack(torch._foreach_norm(u)).to(F64).square()
    return hp, skip, p, m, v, u, sums


def _torch_stage2(job: _Pending, idx: list[int], state: tuple, sums: torch.Tensor, flag: torch.Tensor) -> None:
    """``p - ratio u`` with the completed norms; p and model copies written (masked off the CPU, with m, v)."""
    params, _, exp_avgs, exp_avg_sqs, models = _lists(job, idx)
    hp, skip, p, m, v, u, _ = state
    if skip is True:
        return
    lr = hp[0]
    if job.modes["trust"]:
        pn, un = sums[0].to(hp.dtype).sqrt(), sums[1].to(hp.dtype).sqrt()
        torch._foreach_mul_(u, list(torch.where((pn != 0) & (un != 0), lr * (pn / un), lr).unbind()))
    else:
        torch._foreach_mul_(u, lr)
    if skip is False:
        torch._foreach_sub_(p, u)
        fallback._write_params(params, models, p, False)
    else:
        fallback._finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, u, skip)
