"""GradScaler on sharded gradients (FSDP2 DTensor grads, or an explicit ``process_group``).

Each rank checks only its own shard of the gradients, so ranks disagree about ``found_inf`` unless the
flags are combined before anyone decides to step: one ``all_reduce(MAX)`` of each per-device flag over
the shard group (torch's ``ShardedGradScaler`` does the same with SUM). The collective is stream-ordered
on NCCL: no host sync is added; the only sync stays the one torch has (reading the flag to decide
whether to call a plain optimizer's ``step``). Under DDP the gradients are identical on every rank after
their all-reduce, so nothing is combined there (no group: plain tensors, no ``process_group``).
"""

from __future__ import annotations

from typing import Any

import torch

from fp16kit.distributed import local, same_group, shard_group

__all__ = ["flag_group", "local", "optimizer_combines_flag", "reduce_found_inf"]


def flag_group(optimizer: torch.optim.Optimizer, process_group: Any) -> Any:
    """The group over which this optimizer's inf flags must be combined: the scaler's ``process_group``
    when given, else the group the DTensor params are sharded over, else None (nothing to combine)."""
    if process_group is not None:
        return process_group
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return shard_group("GradScaler", params)[1]


def reduce_found_inf(found: dict[torch.device, torch.Tensor], group: Any) -> None:
    """``all_reduce(MAX)`` of every per-device flag over ``group``, in place (a no-op for None)."""
    if group is None:
        return
    import torch.distributed as dist

    for flag in found.values():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)


def optimizer_combines_flag(optimizer: torch.optim.Optimizer, process_group: Any) -> bool:
    """Does the optimizer combine the flag itself over the right group (fp16kit's FusedLAMB/FusedAdam in a
    sharded step do, inside their norm all-reduce)? When not, the scaler runs its own check pass and
    combines the flags before the step (torch's fused-optimizer contract)."""
    group = flag_group(optimizer, process_group)
    if group is None:
        return True
    own = getattr(optimizer, "process_group", None)
    if own is None:
        own = flag_group(optimizer, None)
    return own is not None and same_group(own, group)

