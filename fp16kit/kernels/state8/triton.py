"""Triton device functions of the 8-bit state rule (``fp16kit/kernels/state8/rule.py`` states it; its float64 spec is
``fp16kit/numerics/reference/state8.py``): block quantize/dequantize in registers, the moment load/store helpers the
Adam and LAMB kernels call under their ``QSTATE`` flag, and a standalone kernel for one tensor (tests).

State layout the helpers rely on (``state8.new_state``): an 8-bit moment of a tensor of ``n >= SMALL_NUMEL``
elements is one byte buffer, ``n`` uint8 codes, padding to a multiple of 16 bytes, then ``ceil(n / 256)`` fp32
absmax values; the address table row holds the codes' address, so the absmax address is ``codes + align16(n)``. A
tensor below the threshold keeps fp32 moments (the row holds their address, typed uint8 in the table).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..engine.rounding import to_fp32
from ..engine.skeleton import load_param_moments, load_span, store_span, table_row
from ..engine.table import ChunkTable, chunk_table, step_block
from .rule import QBLOCK, SMALL_NUMEL, book, num_blocks

_QB = tl.constexpr(QBLOCK)
_QSMALL = tl.constexpr(SMALL_NUMEL)


# ---------------------------------------------------------------------------------------------------------------
# Triton device functions


@triton.jit
def _search(y, thr_ptr):
    """``#{k < 255 : y >= T_k}`` by binary search over the ascending thresholds at ``thr_ptr`` (8 gathers)."""
    idx = tl.zeros(y.shape, dtype=tl.int32)
    for s in tl.static_range(8):
        cand = idx + (128 >> s)
        idx = tl.where(y >= tl.load(thr_ptr + cand - 1), cand, idx)
    return idx


@triton.jit
def quantize_block(x, mask, book_ptr, SIGNED: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr):
    """Quantize a chunk of ``BLOCK`` fp32 values (lanes outside ``mask`` count as 0): ``(codes, absmax, values)``,
    the uint8 codes ``[BLOCK]``, the ``[BLOCK // QB]`` absmax and the dequantized values (0 outside ``mask``)."""
    NB: tl.constexpr = BLOCK // QB
    base = book_ptr + (0 if SIGNED else 512)
    x2 = tl.reshape(tl.where(mask, x, 0.0), (NB, QB))
    a = tl.abs(x2)
    amax = tl.max(tl.where(a == a, a, float("inf")), axis=1)  # a NaN counts as inf: the block is poisoned
    amax = tl.where(amax == float("inf"), float("nan"), amax)
    scale = amax[:, None]
    y = tl.div_rn(x2, tl.where(scale == 0.0, 1.0, scale))  # an all-zero block: 0 / 1
    idx = _search(y, base + 256)
    values = tl.load(base + idx) * scale
    values = tl.where(mask, tl.reshape(values, (BLOCK,)), 0.0)
    return tl.reshape(idx, (BLOCK,)).to(tl.uint8), amax, values


@triton.jit
def dequantize_block(codes, amax, mask, book_ptr, SIGNED: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr):
    """fp32 values ``book[code] * absmax`` of a chunk (``codes [BLOCK]``, ``amax [BLOCK // QB]``; 0 outside
    ``mask``)."""
    NB: tl.constexpr = BLOCK // QB
    base = book_ptr + (0 if SIGNED else 512)
    c = tl.reshape(tl.load(base + codes.to(tl.int32)), (NB, QB))
    return tl.where(mask, tl.reshape(c * amax[:, None], (BLOCK,)), 0.0)


@triton.jit
def _block_span(offs, numel, BLOCK: tl.constexpr, QB: tl.constexpr):
    """The chunk's quantization blocks: their indices and which of them start inside the tensor."""
    b = tl.min(offs, axis=0) // QB + tl.arange(0, BLOCK // QB)
    return b, b * QB < numel


@triton.jit
def _absmax_pointer(table, row, t, n):
    """The fp32 absmax of tensor ``t``'s 8-bit moment in row ``row``: ``align16(n)`` bytes after its codes."""
    addr = tl.load(table[0] + row * table[1] + t) + ((n + 15) // 16) * 16
    return tl.multiple_of(addr.to(tl.pointer_type(tl.float32)), 16)


@triton.jit
def _load_moment(table, row, n, span, book_ptr, SIGNED: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """The fp32 values of state row ``row`` in the chunk ``span``: dequantized for a tensor of ``n >= SMALL_NUMEL``
    elements (uint8 codes and its absmax), else the row's fp32 values."""
    if n >= _QSMALL:
        codes = load_span(table_row(table, row, span[0], tl.uint8, ALIGNED), span)
        b, bmask = _block_span(span[1], n, BLOCK, _QB)
        amax = tl.load(_absmax_pointer(table, row, span[0], n) + b, mask=bmask, other=0.0)
        x = dequantize_block(codes, amax, span[2], book_ptr, SIGNED, BLOCK, _QB)
    else:
        x = load_span(table_row(table, row, span[0], tl.float32, ALIGNED), span)
    return x


@triton.jit
def _store_moment(table, row, n, span, x, book_ptr, SIGNED: tl.constexpr, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """Store the chunk's new moment ``x`` into row ``row`` (quantized, codes and absmax, for a tensor of
    ``n >= SMALL_NUMEL`` elements, else as is); returns the values as stored."""
    if n >= _QSMALL:
        codes, amax, x = quantize_block(x, span[2], book_ptr, SIGNED, BLOCK, _QB)
        store_span(table_row(table, row, span[0], tl.uint8, ALIGNED), span, codes)
        b, bmask = _block_span(span[1], n, BLOCK, _QB)
        tl.store(_absmax_pointer(table, row, span[0], n) + b, amax, mask=bmask)
    else:
        store_span(table_row(table, row, span[0], tl.float32, ALIGNED), span, x)
    return x


@triton.jit
def load_state(table, span, p_ptr, m_ptr, v_ptr, state, QSTATE: tl.constexpr, BLOCK: tl.constexpr,
               ALIGNED: tl.constexpr):
    """``(p, m, v)`` of the chunk in fp32: ``load_param_moments``, or with ``QSTATE`` (``state_bits=8``) the
    moments dequantized where the tensor's state is 8-bit. ``state``: the state bundle (``state_rows``: the code
    book)."""
    if QSTATE:
        n = tl.load(table[2] + span[0])
        p = to_fp32(load_span(p_ptr, span))
        m = _load_moment(table, 2, n, span, state[0], True, BLOCK, ALIGNED)
        v = _load_moment(table, 3, n, span, state[0], False, BLOCK, ALIGNED)
    else:
        p, m, v = load_param_moments(p_ptr, m_ptr, v_ptr, span)
    return p, m, v


@triton.jit
def store_state(table, span, m_ptr, v_ptr, m, v, state, QSTATE: tl.constexpr, BLOCK: tl.constexpr,
                ALIGNED: tl.constexpr):
    """Write the chunk's new moments; returns them as stored (with ``QSTATE``, dequantized where 8-bit: LAMB's
    update and norms are computed from these, so stage 2, which reloads them, sees the same values)."""
    if QSTATE:
        n = tl.load(table[2] + span[0])
        m = _store_moment(table, 2, n, span, m, state[0], True, BLOCK, ALIGNED)
        v = _store_moment(table, 3, n, span, v, state[0], False, BLOCK, ALIGNED)
    else:
        store_span(m_ptr, span, m)
        store_span(v_ptr, span, v)
    return m, v


# ---------------------------------------------------------------------------------------------------------------
# Standalone kernels: one tensor quantized / dequantized (tests, checkpoint conversion on a GPU)


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, absmax_ptr, values_ptr, numel, book_ptr, SIGNED: tl.constexpr,
                     BLOCK: tl.constexpr, QB: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    codes, amax, values = quantize_block(x, mask, book_ptr, SIGNED, BLOCK, QB)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(values_ptr + offs, values, mask=mask)
    b, bmask = _block_span(offs, numel, BLOCK, QB)
    tl.store(absmax_ptr + b, amax, mask=bmask)


@triton.jit
def _dequantize_kernel(codes_ptr, absmax_ptr, out_ptr, numel, book_ptr, SIGNED: tl.constexpr, BLOCK: tl.constexpr,
                       QB: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    codes = tl.load(codes_ptr + offs, mask=mask, other=0)
    b, bmask = _block_span(offs, numel, BLOCK, QB)
    amax = tl.load(absmax_ptr + b, mask=bmask, other=0.0)
    tl.store(out_ptr + offs, dequantize_block(codes, amax, mask, book_ptr, SIGNED, BLOCK, QB), mask=mask)


#: Elements per program of the standalone kernels (a multiple of QBLOCK).
_KBLOCK = 1024


def launch_quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, absmax, values)`` of the contiguous fp32 tensor ``x`` by the Triton device functions
    (``values``: the dequantized result, as the optimizer kernels get it back from :func:`store_moment`)."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError("fp16kit: launch_quantize takes a contiguous float32 tensor.")
    n = x.numel()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(num_blocks(n), dtype=torch.float32, device=x.device)
    values = torch.empty_like(x)
    if n:
        _quantize_kernel[(triton.cdiv(n, _KBLOCK),)](x, codes, absmax, values, n, book(x.device), SIGNED=signed,
                                                     BLOCK=_KBLOCK, QB=QBLOCK)
    return codes, absmax, values


def launch_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of ``codes`` (contiguous uint8) and ``absmax`` by the Triton device functions."""
    n = codes.numel()
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    if n:
        _dequantize_kernel[(triton.cdiv(n, _KBLOCK),)](codes, absmax, out, n, book(codes.device), SIGNED=signed,
                                                       BLOCK=_KBLOCK, QB=QBLOCK)
    return out


#: ``id(fp32 moment) -> (weak reference to it, its byte view)``: the views are made once per moment, so a step makes
#: none (an entry leaves with its moment).
_byte_views: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    """An fp32 moment's first ``numel`` bytes as a uint8 tensor (the same address): the table row of a small
    tensor's fp32 state under ``QSTATE``, so that every entry of the row has one dtype and ``numel``."""
    key = id(x)
    hit = _byte_views.get(key)
    if hit is not None and hit[0]() is x and hit[1].data_ptr() == x.data_ptr():
        return hit[1]
    view = x.reshape(-1).view(torch.uint8)[: x.numel()]
    _byte_views[key] = (weakref.ref(x, lambda _, k=key: _byte_views.pop(k, None)), view)
    return view


def state_rows(
    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], state8: bool, device: torch.device
) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], tuple[torch.Tensor]]:
    """The moment rows as a launcher puts them in its table, and the kernels' state bundle (the argument ``state``
    of :func:`load_state`/:func:`store_state`: ``state8``, uint8 rows, fp32 moments of small tensors as their bytes,
    and the code book; else the rows as given and a placeholder)."""
    if not state8:
        return exp_avgs, exp_avg_sqs, (exp_avgs[0],)
    rows = [[x if x.dtype == torch.uint8 else _bytes_of(x) for x in xs] for xs in (exp_avgs, exp_avg_sqs)]
    return rows[0], rows[1], (book(device),)


def moment_table(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor], models: Sequence[torch.Tensor] | None, state8: bool,
) -> tuple[ChunkTable, tuple[torch.Tensor]]:
    """``(table, state)`` of an Adam or LAMB launch: the address table of rows ``0`` params, ``1`` grads, ``2``/``3``
    the moments as :func:`state_rows` puts them, ``4`` the model copies (the params again when there are none, never
    written then), and the kernels' state bundle."""
    device = params[0].device
    exp_avgs, exp_avg_sqs, state = state_rows(exp_avgs, exp_avg_sqs, state8, device)
    table = chunk_table(
        [params, grads, exp_avgs, exp_avg_sqs, params if models is None else models],
        step_block(device),
        written=(0, 2, 3) if models is None else (0, 2, 3, 4),
    )
    return table, state
