"""Triton kernel and launcher: multi-tensor sum of squares, one fp32 partial per chunk.

Math: for chunk ``c`` of tensor ``t``, ``y = fp32(x) * pre_scale`` (one fp32 rounding, as the reference) and
``partials[c] = sum(float64(y)^2)`` over the chunk, reduced as a tree inside the block in float64. Squares of
fp32 values cannot overflow or underflow in float64 (``|y| <= 3.4e38`` squares to ``<= 1.2e77``; the smallest
fp32 subnormal to ``2e-90``), so norms of finite values are right over fp32's whole range, where fp32 squares
would overflow above a norm of 1.8e19 and vanish below 1e-19. The caller sums the partials (deterministically,
in a fixed order) into the global and per-tensor norms. With ``found_inf`` given, a non-finite ``y`` raises it
to 1: a large but finite norm never does.

A second, tiny kernel sums each tensor's chunk partials in order (deterministic, no atomics, no host
sync), giving per-tensor sums of squares; LAMB's trust ratios reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._chunks import chunk_span, load_chunk, row_pointer
from ._rounding import to_fp32
from ._table import ChunkTable, chunk_table, num_programs, triton_dtype

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _sumsq_kernel: ``y * y`` must not contract into the float64 sum: the same bits as the unscale kernel's norm
    # partials and the torch fallback.
    "_sumsq_kernel": {"num_warps": 16, "enable_fp_fusion": False},
    # _segment_sum_kernel: a plain sum, no multiply-add.
    "_segment_sum_kernel": {"num_warps": 8, "enable_fp_fusion": False},
}


@triton.jit
def _sumsq_kernel(
    ptrs,
    numels,
    chunk_tensor,
    chunk_start,
    num_chunks,
    pre_scale_ptr,
    found_inf_ptr,
    partials_ptr,
    IN_DTYPE: tl.constexpr,
    CHECK: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    pre_scale = tl.load(pre_scale_ptr).to(tl.float32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        src = row_pointer(ptrs, 0, 0, t, IN_DTYPE, ALIGNED)
        x = to_fp32(load_chunk(src, offs, mask, full)) * pre_scale
        x64 = x.to(tl.float64)
        tl.store(partials_ptr + c, tl.sum(x64 * x64, axis=0))
        if CHECK:
            bad = tl.maximum(bad, (mask & ~(tl.abs(x) < float("inf"))).to(tl.int32))
    if CHECK:
        tl.atomic_max(found_inf_ptr, tl.max(bad, axis=0).to(tl.float32))


@triton.jit
def _segment_sum_kernel(partials_ptr, counts_ptr, first_ptr, out_ptr, num_tensors, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for t in range(pid, num_tensors, tl.num_programs(0)):
        first = tl.load(first_ptr + t)
        count = tl.load(counts_ptr + t)
        acc = tl.zeros((BLOCK,), dtype=partials_ptr.dtype.element_ty)
        for s in range(0, count, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            acc += tl.load(partials_ptr + first + offs, mask=offs < count, other=0.0)
        tl.store(out_ptr + t, tl.sum(acc, axis=0))


def segment_sums(partials: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """Per-tensor totals of per-chunk values (chunks of a tensor are adjacent in the table), in the partials'
    dtype (float32 for LAMB's update norms, float64 for ``l2norm``)."""
    out = torch.empty(table.num_tensors, dtype=partials.dtype, device=partials.device)
    grid = (num_programs(partials.device, table.num_tensors),)
    _segment_sum_kernel[grid](
        partials, table.chunk_counts, table.first_chunk, out, table.num_tensors, BLOCK=1024,
        **LAUNCH["_segment_sum_kernel"],
    )
    return out


def launch_sumsq(
    tensors: Sequence[torch.Tensor],
    pre_scale: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> tuple[torch.Tensor, ChunkTable]:
    """One launch over contiguous, non-empty ``tensors`` of one dtype: per-chunk float64 sums of squares."""
    table = chunk_table([tensors])
    device = tensors[0].device
    partials = torch.empty(table.num_chunks, dtype=torch.float64, device=device)
    grid = (num_programs(device, table.num_chunks),)
    _sumsq_kernel[grid](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_start,
        table.num_chunks,
        pre_scale,
        found_inf if found_inf is not None else partials,
        partials,
        IN_DTYPE=triton_dtype(tensors[0].dtype),
        CHECK=found_inf is not None,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        **LAUNCH["_sumsq_kernel"],
    )
    return partials, table
