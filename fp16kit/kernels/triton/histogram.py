"""Triton kernel and launcher: per-tensor histograms of binary exponents, one launch per dtype group.

Math: for every element ``x`` of tensor ``t`` the kernel adds 1 to ``out[row(t), bin(x)]``::

    bin(x) = floor(log2|x|) - MIN_EXP     for finite nonzero x   (MIN_EXP = -149: fp32's smallest subnormal)
             ZERO_BIN, INF_BIN, NAN_BIN   for +-0, +-inf, NaN     (277, 278, 279)

(the column layout is defined in ``fp16kit/kernels/histogram.py``). The exponent is read from the bit
pattern, never from a float conversion: Triton's interpreter flushes bf16 subnormals when it widens
them (``fp16kit/kernels/engine/rounding.py``), and a floating ``log2`` can round up at the top of a binade.
With ``E`` exponent bits, ``M`` mantissa bits and bias ``B``::

    field = (bits >> M) & (2^E - 1),   mant = bits & (2^M - 1)
    field == 0, mant == 0      -> zero
    field == 0, mant != 0      -> subnormal: floor(log2|x|) = (1 - B - M) + floor(log2 mant)
    field == 2^E - 1           -> inf (mant == 0) or NaN
    otherwise                  -> floor(log2|x|) = field - B

``floor(log2 mant)`` of a subnormal's mantissa (below ``2^23``) is the exponent field of ``fp32(mant)``,
an exact integer-to-float conversion on every backend.

Each chunk's counts come from ``tl.histogram`` (masked past the tensor's end) and are added to the
output with integer atomics, only for bins that are not empty; integer sums do not depend on the
order, so results are deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..engine.chunks import chunk_span, row_pointer
from ..engine.histogram_bins import _FORMATS, MIN_EXP, NUM_BINS, ZERO_BIN, upload
from ..engine.table import BLOCK, num_programs

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _histogram_kernel: integer bit arithmetic only.
    "_histogram_kernel": {"num_warps": 8, "enable_fp_fusion": False},
}

_PADDED_BINS = 512  # tl.histogram and tl.arange need a power of two


@triton.jit
def _exponent_bins(
    bits, EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, BIAS: tl.constexpr, MIN_EXP: tl.constexpr,
    ZERO_BIN: tl.constexpr,
):
    """The histogram column of each element, from its IEEE bit pattern (int32, sign bit ignored)."""
    field = (bits >> MANT_BITS) & ((1 << EXP_BITS) - 1)
    mant = bits & ((1 << MANT_BITS) - 1)
    # floor(log2(mant)) for a subnormal: the exponent field of the exact fp32 conversion of mant.
    lead = ((mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.where(field == 0, (1 - BIAS - MANT_BITS) + lead, field - BIAS)
    bins = exponent - MIN_EXP
    bins = tl.where((field == 0) & (mant == 0), ZERO_BIN, bins)
    all_ones = (1 << EXP_BITS) - 1
    bins = tl.where(field == all_ones, tl.where(mant == 0, ZERO_BIN + 1, ZERO_BIN + 2), bins)
    return bins


@triton.jit
def _histogram_kernel(
    ptrs,
    numels,
    chunk_tensor,
    chunk_start,
    num_chunks,
    rows_ptr,
    out_ptr,
    INT_DTYPE: tl.constexpr,
    WIDTH: tl.constexpr,
    EXP_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    ZERO_BIN: tl.constexpr,
    NUM_BINS: tl.constexpr,
    PADDED_BINS: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, PADDED_BINS)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        src = row_pointer(ptrs, 0, 0, t, INT_DTYPE, ALIGNED)
        # A real branch: the unmasked load of a full chunk vectorizes (see _chunks.load_chunk).
        if full:  # noqa: SIM108
            raw = tl.load(src + offs)
        else:
            raw = tl.load(src + offs, mask=mask, other=0)
        bits = raw.to(tl.int32)
        if WIDTH == 16:
            bits = bits & 0xFFFF  # undo the sign extension of the 16-bit pattern
        bins = _exponent_bins(bits, EXP_BITS, MANT_BITS, BIAS, MIN_EXP, ZERO_BIN)
        counts = tl.histogram(bins, PADDED_BINS, mask=mask)
        row = tl.load(rows_ptr + t)
        tl.atomic_add(out_ptr + row * NUM_BINS + cols, counts.to(tl.int64), mask=(cols < NUM_BINS) & (counts > 0))


_tables: OrderedDict[tuple, tuple[torch.Tensor, int, bool]] = OrderedDict()


def _chunk_map(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int, bool]:
    """``(packed, num_chunks, aligned)``: the address table for one list, built on the host and uploaded
    without a host sync, cached by addresses.

    The doctor histograms gradients that autograd has just allocated, so a cache miss must not stall the step:
    the upload is ``_table.upload``'s (pinned, non-blocking), as ``_table.chunk_table``'s. ``packed`` holds
    ``[ptrs | numels | chunk_start | chunk_tensor]`` (int64).
    """
    device = tensors[0].device
    key = (device, tuple((t.data_ptr(), t.numel()) for t in tensors))
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    counts = (numels + BLOCK - 1) // BLOCK
    owners = torch.repeat_interleave(torch.arange(len(tensors)), counts)
    starts = (torch.arange(owners.numel()) - (torch.cumsum(counts, 0) - counts)[owners]) * BLOCK
    packed = torch.cat([ptrs, numels, starts, owners])
    hit = (upload(packed, device), owners.numel(), bool((ptrs % 16 == 0).all()))
    _tables[key] = hit
    if len(_tables) > 64:
        _tables.popitem(last=False)
    return hit


def launch_histogram(tensors: Sequence[torch.Tensor], rows: torch.Tensor, out: torch.Tensor) -> None:
    """One launch over contiguous, non-empty ``tensors`` of one dtype (fp16, bf16 or fp32).

    Adds tensor ``i``'s counts to row ``rows[i]`` of ``out`` (int64 ``[*, NUM_BINS]``, contiguous);
    ``rows`` is an int64 tensor on the tensors' device. No host sync.
    """
    int_dtype, exp_bits, mant_bits, bias = _FORMATS[tensors[0].dtype]
    packed, num_chunks, aligned = _chunk_map(tensors)
    n = len(tensors)
    device = tensors[0].device
    grid = (num_programs(device, num_chunks),)
    _histogram_kernel[grid](
        packed[:n],
        packed[n : 2 * n],
        packed[2 * n + num_chunks :],
        packed[2 * n : 2 * n + num_chunks],
        num_chunks,
        rows,
        out,
        INT_DTYPE=tl.int16 if int_dtype == torch.int16 else tl.int32,
        WIDTH=16 if int_dtype == torch.int16 else 32,
        EXP_BITS=exp_bits,
        MANT_BITS=mant_bits,
        BIAS=bias,
        MIN_EXP=MIN_EXP,
        ZERO_BIN=ZERO_BIN,
        NUM_BINS=NUM_BINS,
        PADDED_BINS=_PADDED_BINS,
        BLOCK=BLOCK,
        ALIGNED=aligned,
        **LAUNCH["_histogram_kernel"],
    )
