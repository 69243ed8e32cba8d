"""fp16kit on ``torch.distributed``: which ranks hold the pieces of a sharded tensor.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns every parameter, its gradient and (through
``torch.zeros_like``) its optimizer state into a ``DTensor`` split on dim 0 over a device mesh; each rank
holds one local shard. fp16kit's kernels run on those local shards (``local``). Whatever is a sum over
*all* elements of a tensor or of the model — LAMB's global gradient norm, each parameter's ``||p||`` and
``||u||``, and the loss scaler's inf/NaN flag — must then be combined over the ranks that hold the other
shards: the *shard group* (``shard_group``). ZeRO-1 (``ZeroRedundancyOptimizer``) partitions whole
parameters instead; there the group is given explicitly (``process_group=``) and only the model-wide
sums (global norm, inf flag) are combined. See ``docs/distributed.md``.

May import: torch and ``fp16kit._versions`` / ``fp16kit._lazy`` only (the optimizers and amp build on it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .. import _versions

__all__ = ["is_dtensor", "is_sharded", "local", "same_group", "shard_group"]

DTensor = _versions.dtensor_class()  # None on a build without torch.distributed


def is_dtensor(t: Any) -> bool:
    """Is ``t`` a ``torch.distributed.tensor.DTensor``?"""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own elements: ``t.to_local()`` for a DTensor (same storage: in-place writes land in ``t``),
    ``t`` itself otherwise."""
    return t.to_local() if is_dtensor(t) else t


def is_sharded(t: torch.Tensor) -> bool:
    """Is ``t`` a DTensor whose elements are split over ranks (some ``Shard`` placement)?"""
    return is_dtensor(t) and any(pl.is_shard() for pl in t.placements)


def _group_of(fn: str, t: torch.Tensor) -> Any:
    dims = [i for i, pl in enumerate(t.placements) if pl.is_shard()]
    if len(dims) > 1:
        raise NotImplementedError(
            f"{fn}: a parameter is sharded over {len(dims)} mesh dimensions ({t.placements}); fp16kit supports "
            f"one sharded dimension (FSDP2's dim-0 sharding, HSDP's (Replicate, Shard)). Flatten the mesh."
        )
    return t.device_mesh.get_group(dims[0])


def same_group(a: Any, b: Any) -> bool:
    """Do two process groups span the same ranks (in the same order)?"""
    import torch.distributed as dist

    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def shard_group(fn: str, tensors: Iterable[torch.Tensor]) -> tuple[bool, Any]:
    """``(any_dtensor, group)``: whether any tensor is a DTensor, and the one process group over which the
    sharded ones are split (``None`` when none is split). Raises ValueError when two tensors are split over
    different groups: one step combines its sums over one group."""
    any_dt, group = False, None
    for t in tensors:
        if not is_dtensor(t):
            continue
        any_dt = True
        if not is_sharded(t):
            continue
        g = _group_of(fn, t)
        if group is None:
            group = g
        elif not same_group(group, g):
            raise ValueError(
                f"{fn}: parameters are sharded over different process groups; one optimizer combines its norms "
                f"over one group. Use one optimizer per device mesh."
            )
    return any_dt, group
