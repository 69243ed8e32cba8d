"""Triton kernel and launcher: fused unscale + inf/NaN check (+ optional squared norm) over many tensors.

Math, per element ``x`` of every tensor:  ``y = fp32(x) * inv_scale``; ``out = round_to(y, out.dtype)``.
``found_inf`` is raised to 1 when any written ``out`` is inf/NaN. Checking the written value covers
every case: a non-finite input stays non-finite after scaling, and a finite input that overflows
after scaling (``inv_scale > 1``) or after the cast (fp32 -> fp16) is caught too.
With ``WITH_NORM`` each chunk also writes ``sum(float64(y)^2)`` (tree-reduced in float64, where squares of fp32
values neither overflow nor underflow) into ``partials[c]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..engine.chunks import chunk_span, load_chunk, row_pointer, store_chunk
from ..engine.rounding import round_to, to_fp32
from ..engine.table import STEP_PROGRAMS_PER_SM, STEP_WARPS_GPU, chunk_table, num_programs, step_block, triton_dtype

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _unscale_kernel: the unscale result must be bit-exact against the float64 reference, and its float64 norm
    # partials must equal ``l2norm``'s (no contraction of ``y * y`` into the sum).
    "_unscale_kernel": {"num_warps": STEP_WARPS_GPU, "enable_fp_fusion": False},
}


@triton.jit
def _unscale_kernel(
    ptrs,  # int64 [2 * T]: row 0 inputs, row 1 outputs (the same addresses when in place)
    num_tensors,
    numels,
    chunk_tensor,
    chunk_start,
    num_chunks,
    inv_scale_ptr,
    found_inf_ptr,
    partials_ptr,
    IN_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    WITH_NORM: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    inv_scale = tl.load(inv_scale_ptr).to(tl.float32)
    # Per-program flag, published with one atomic at the end instead of one per chunk.
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        src = row_pointer(ptrs, 0, num_tensors, t, IN_DTYPE, ALIGNED)
        dst = row_pointer(ptrs, 1, num_tensors, t, OUT_DTYPE, ALIGNED)
        y = to_fp32(load_chunk(src, offs, mask, full)) * inv_scale
        written = round_to(y, OUT_DTYPE)
        store_chunk(dst, offs, written, mask, full)
        # `abs(v) < inf` is false for +-inf and for NaN (an ordered comparison).
        bad = tl.maximum(bad, (mask & ~(tl.abs(written.to(tl.float32)) < float("inf"))).to(tl.int32))
        if WITH_NORM:
            y64 = tl.where(mask, y, 0.0).to(tl.float64)
            tl.store(partials_ptr + c, tl.sum(y64 * y64, axis=0))
    tl.atomic_max(found_inf_ptr, tl.max(bad, axis=0).to(tl.float32))


def launch_unscale(
    pairs: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    with_norm: bool,
) -> torch.Tensor | None:
    """One launch over ``pairs = (inputs, outputs)``: contiguous, non-empty ``inputs`` of one dtype and ``outputs``
    of one dtype.

    Returns the per-chunk partial sums of squares (float64, one per chunk) when ``with_norm``.
    """
    inputs, outputs = pairs
    device = inputs[0].device
    table = chunk_table([inputs, outputs], step_block(device))  # outputs checked by ops.unscale_and_check
    partials = torch.empty(table.num_chunks if with_norm else 1, dtype=torch.float64, device=device)
    grid = (num_programs(device, table.num_chunks, STEP_PROGRAMS_PER_SM),)
    _unscale_kernel[grid](
        *table.leading_args(),
        inv_scale,
        found_inf,
        partials,
        IN_DTYPE=triton_dtype(inputs[0].dtype),
        OUT_DTYPE=triton_dtype(outputs[0].dtype),
        WITH_NORM=with_norm,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        **LAUNCH["_unscale_kernel"],
    )
    return partials if with_norm else None
