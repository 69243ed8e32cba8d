"""Triton kernel and launcher: multi-tensor cast copy ``dst_i = round_to_nearest_even(src_i)``.

Used to write fp32 master weights into fp16/bf16 model params after each optimizer step; works for
any pair of fp16/bf16/fp32. Bit-identical to ``dst.copy_(src)`` (NaN becomes the canonical NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._chunks import chunk_span
from ._rounding import round_to, to_fp32
from ._table import chunk_table, num_programs, triton_dtype


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
):
    pid = tl.program_id(0)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        t, offs, mask = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK)
        src = tl.load(ptrs + t).to(tl.pointer_type(SRC_DTYPE))
        dst = tl.load(ptrs + num_tensors + t).to(tl.pointer_type(DST_DTYPE))
        x = tl.load(src + offs, mask=mask, other=0.0)
        if SRC_DTYPE == DST_DTYPE:
            tl.store(dst + offs, x, mask=mask)
        else:
            tl.store(dst + offs, round_to(to_fp32(x), DST_DTYPE), mask=mask)


def launch_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """One launch for contiguous, non-empty pairs with one source dtype and one destination dtype."""
    table = chunk_table([src, dst])
    grid = (num_programs(src[0].device, table.num_chunks),)
    _copy_kernel[grid](
        table.ptrs,
        table.num_tensors,
        table.numels,
        table.chunk_tensor,
        table.chunk_start,
        table.num_chunks,
        SRC_DTYPE=triton_dtype(src[0].dtype),
        DST_DTYPE=triton_dtype(dst[0].dtype),
        BLOCK=table.block,
        num_warps=8,
    )
