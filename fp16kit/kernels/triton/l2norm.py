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

from ..engine.chunks import chunk_span, load_chunk, row_pointer
from ..engine.rounding import to_fp32
from ..engine.step_scalars import finish_ticket
from ..engine.table import (
    STEP_PROGRAMS_PER_SM,
    STEP_WARPS_GPU,
    ChunkTable,
    chunk_table,
    num_programs,
    step_block,
    triton_dtype,
)

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _sumsq_kernel: ``y * y`` must not contract into the float64 sum: the same bits as the unscale kernel's norm
    # partials and the torch fallback.
    "_sumsq_kernel": {"num_warps": STEP_WARPS_GPU, "enable_fp_fusion": False},
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
    ticket_ptr,
    bad_ptr,
    norm_ptr,
    count_ptr,
    check_factor,
    IN_DTYPE: tl.constexpr,
    CHECK: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    FINISH: tl.constexpr = False,
    NORM: tl.constexpr = True,
    OWN_FLAG: tl.constexpr = False,
    COUNT: tl.constexpr = False,
    SCALE_IS_GRAD_SCALE: tl.constexpr = False,
):
    pid = tl.program_id(0)
    if SCALE_IS_GRAD_SCALE:
        pre_scale = (1.0 / tl.load(pre_scale_ptr).to(tl.float64)).to(tl.float32)
    else:
        pre_scale = tl.load(pre_scale_ptr).to(tl.float32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        src = row_pointer(ptrs, 0, 0, t, IN_DTYPE, ALIGNED)
        x = to_fp32(load_chunk(src, offs, mask, full)) * pre_scale
        if NORM:
            x64 = x.to(tl.float64)
            tl.store(partials_ptr + c, tl.sum(x64 * x64, axis=0))
        if CHECK:  # check_factor: a power of two, so exact (1, or 2**65 to flag |x| >= 2**63 as well)
            bad = tl.maximum(bad, (mask & ~(tl.abs(x * check_factor) < float("inf"))).to(tl.int32))
    if FINISH:
        # The step's check pass finishes on the device (fp16kit/kernels/engine/step_scalars.py): the last program
        # writes the flag whole (an own flag needs no zero fill first) and the norm of the partials, summed
        # in chunk order (deterministic whichever program finishes).
        if CHECK:
            tl.atomic_max(bad_ptr, tl.max(bad, axis=0), sem="acq_rel")
        tl.debug_barrier()
        if finish_ticket(ticket_ptr):
            if CHECK:
                found = tl.atomic_xchg(bad_ptr, 0, sem="acq_rel").to(tl.float32)
                if not OWN_FLAG:
                    found = tl.maximum(found, tl.load(found_inf_ptr, cache_modifier=".cg"))
                tl.store(found_inf_ptr, found)
                if COUNT:
                    tl.store(count_ptr, tl.load(count_ptr) + (found != 0).to(tl.int64))
            if NORM:
                tl.store(norm_ptr, tl.sqrt(segment_total(partials_ptr, 0, num_chunks)).to(tl.float32))
    elif CHECK:
        tl.atomic_max(found_inf_ptr, tl.max(bad, axis=0).to(tl.float32))


@triton.jit
def segment_total(partials_ptr, first, count):
    """Sum of ``partials[first : first + count]`` in a fixed order: 1024 lanes, each adding every 1024th value in
    turn, then a tree over the lanes (deterministic, whichever program runs it). Loads bypass L1 (``.cg``): the
    callers that finish a reduction read partials other programs of the same launch just wrote."""
    acc = tl.zeros((1024,), dtype=partials_ptr.dtype.element_ty)
    for s in range(0, count, 1024):
        offs = s + tl.arange(0, 1024)
        acc += tl.load(partials_ptr + first + offs, mask=offs < count, other=0.0, cache_modifier=".cg")
    return tl.sum(acc, axis=0)


@triton.jit
def _segment_sum_kernel(partials_ptr, counts_ptr, first_ptr, out_ptr, num_tensors):
    pid = tl.program_id(0)
    for t in range(pid, num_tensors, tl.num_programs(0)):
        tl.store(out_ptr + t, segment_total(partials_ptr, tl.load(first_ptr + t), tl.load(counts_ptr + t)))


def segment_sums(partials: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """Per-tensor totals of per-chunk values (chunks of a tensor are adjacent in the table), in the partials'
    dtype (float32 for LAMB's update norms, float64 for ``l2norm``)."""
    out = torch.empty(table.num_tensors, dtype=partials.dtype, device=partials.device)
    grid = (num_programs(partials.device, table.num_tensors),)
    _segment_sum_kernel[grid](
        partials, table.chunk_counts, table.first_chunk, out, table.num_tensors,
        **LAUNCH["_segment_sum_kernel"],
    )
    return out


def launch_sumsq(
    tensors: Sequence[torch.Tensor],
    pre_scale: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> tuple[torch.Tensor, ChunkTable]:
    """One launch over contiguous, non-empty ``tensors`` of one dtype: per-chunk float64 sums of squares."""
    device = tensors[0].device
    table = chunk_table([tensors], step_block(device))
    partials = torch.empty(table.num_chunks, dtype=torch.float64, device=device)
    grid = (num_programs(device, table.num_chunks, STEP_PROGRAMS_PER_SM),)
    flag = found_inf if found_inf is not None else partials
    _sumsq_kernel[grid](
        *_sumsq_leading(table), pre_scale, flag, partials, partials, partials, partials, partials, 1.0,
        IN_DTYPE=triton_dtype(tensors[0].dtype),
        CHECK=found_inf is not None,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        **LAUNCH["_sumsq_kernel"],
    )
    return partials, table


def _sumsq_leading(table: ChunkTable) -> tuple:
    return (table.ptrs, table.numels, table.chunk_tensor, table.chunk_start, table.num_chunks)


def launch_step_check(
    grads: Sequence[torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    norm_out: torch.Tensor | None,
    *,
    own_flag: bool,
    skip_count: torch.Tensor | None,
    check_factor: float = 1.0,
) -> None:
    """The check pass of a device-resident optimizer step, finished on the device in the same launch: one launch
    over contiguous, non-empty ``grads`` of one dtype, unscaled by ``1 / grad_scale`` (float64, rounded once;
    none without a scaler).

    ``found_inf`` (float32 ``[1]``) is raised when an unscaled element is inf/NaN; with ``own_flag`` it is
    written whole (no need to zero it first). ``norm_out`` (float32 ``[1]``, optional) receives the global L2 norm
    (float64 squares and sums, rounded once). ``skip_count`` (int64 ``[1]``, optional) is increased by one when
    the flag ends up raised."""
    device = grads[0].device
    table = chunk_table([grads], step_block(device))
    norm = norm_out is not None
    partials = table.scratch_buffer("check_partials", table.num_chunks if norm else 1, torch.float64)
    bad = table.scratch_buffer("check_bad", 1, torch.int32, zero=True)
    if grad_scale is None:  # unscale by 1: a constant of the table, filled once
        scale = table.scratch.get("one")
        if scale is None:
            scale = table.scratch["one"] = torch.ones(1, dtype=torch.float32, device=device)
    else:
        scale = grad_scale
    _sumsq_kernel[(num_programs(device, table.num_chunks, STEP_PROGRAMS_PER_SM),)](
        *_sumsq_leading(table), scale, found_inf, partials, table.scratch_ticket(), bad,
        norm_out if norm else partials, skip_count if skip_count is not None else partials, float(check_factor),
        IN_DTYPE=triton_dtype(grads[0].dtype),
        CHECK=True,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        FINISH=True,
        NORM=norm,
        OWN_FLAG=own_flag,
        COUNT=skip_count is not None,
        SCALE_IS_GRAD_SCALE=grad_scale is not None,
        **LAUNCH["_sumsq_kernel"],
    )
