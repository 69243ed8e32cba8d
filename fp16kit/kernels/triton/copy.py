"""Triton kernel and launcher: multi-tensor cast copy ``dst_i = round_to_nearest_even(src_i)``.

Used to write fp32 master weights into fp16/bf16 model params after each optimizer step; works for
any pair of fp16/bf16/fp32. Bit-identical to ``dst.copy_(src)`` (NaN becomes the canonical NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..engine.chunks import chunk_span, load_chunk, row_pointer, store_chunk
from ..engine.rounding import round_to, to_fp32
from ..engine.table import chunk_table, num_programs, triton_dtype

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _copy_kernel: a cast has no multiply-add; pinned so that a Triton default cannot change the PTX.
    "_copy_kernel": {"num_warps": 16, "enable_fp_fusion": False},
}


@triton.jit
def _copy_kernel(
    ptrs,  # int64 [2 * T]: row 0 sources, row 1 destinations
    num_tensors,
    numels,
    chunk_tensor,
    chunk_start,
    num_chunks,
    SRC_DTYPE: tl.constexpr,
    DST_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        src = row_pointer(ptrs, 0, num_tensors, t, SRC_DTYPE, ALIGNED)
        dst = row_pointer(ptrs, 1, num_tensors, t, DST_DTYPE, ALIGNED)
        x = load_chunk(src, offs, mask, full)
        if SRC_DTYPE == DST_DTYPE:
            store_chunk(dst, offs, x, mask, full)
        else:
            store_chunk(dst, offs, round_to(to_fp32(x), DST_DTYPE), mask, full)

def launch_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """One launch for contiguous, non-empty pairs with one source dtype and one destination dtype."""
    table = chunk_table([src, dst])  # destinations checked by ops.copy_ (check_writes)
    grid = (num_programs(src[0].device, table.num_chunks),)
    _copy_kernel[grid](
        *table.leading_args(),
        SRC_DTYPE=triton_dtype(src[0].dtype),
        DST_DTYPE=triton_dtype(dst[0].dtype),
        BLOCK=table.block,
        ALIGNED=table.aligned,
        **LAUNCH["_copy_kernel"],
    )
