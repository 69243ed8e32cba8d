"""8-bit optimizer state (``state_bits=8``): block-wise dynamic quantization of Adam's and LAMB's moments.

The rule (its float64 spec: ``fp16kit/numerics/reference/state8.py``; docs/optim.md, "8-bit moments"):

* a moment tensor is flattened and cut into blocks of :data:`QBLOCK` = 256 elements (the last one ragged); each
  block keeps one fp32 ``absmax = max |x|`` and one uint8 code per element;
* ``y = x / absmax`` (IEEE fp32 quotient; 0 when ``absmax == 0``); the code is the index of the nearest entry of a
  256-entry code book, a tie going to the higher index; a block holding a NaN or an infinity gets ``absmax = NaN``
  and code 0 everywhere;
* dequantized value ``fp32(book[code] * absmax)``;
* code books, built from the eight fp32 constants :data:`EIGHTHS` = ``fp32(2 ** (-f / 8))`` (``f = 0..7``) scaled
  by exact powers of two, so ``c_k = EIGHTHS[k % 8] * 2 ** -(k // 8) = fp32(2 ** (-k / 8))``:
  signed (``exp_avg``) ``[-c_0 .. -c_126, 0, c_127 .. c_0]``, unsigned (``exp_avg_sq``) ``[0, c_254 .. c_0]``.

Nearest-with-ties-up is computed without any float64: ``T_k``, the smallest fp32 not below the exact midpoint of
entries ``k`` and ``k + 1``, satisfies ``y >= T_k  <=>  y >= midpoint_k`` for every fp32 ``y``, so
``code = #{k < 255 : y >= T_k}``: a binary search of 8 steps in the kernels, ``torch.searchsorted`` in torch.

Here: the code books (:func:`book`, one fp32 device tensor per device), the torch implementation
(:func:`quantize`, :func:`dequantize`), the Triton device functions the optimizer kernels call
(:func:`quantize_block`, :func:`dequantize_block`, and the moment load/store helpers), and a small standalone
kernel (:func:`launch_quantize`, :func:`launch_dequantize`) that tests and checkpoint conversion use.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._chunks import load_chunk, row_pointer, store_chunk
from ._table import BLOCK, STEP_BLOCK_GPU, _capturing, upload

__all__ = [
    "EIGHTHS",
    "QBLOCK",
    "SMALL_NUMEL",
    "book",
    "dequantize",
    "launch_dequantize",
    "launch_quantize",
    "num_blocks",
    "quantize",
]

#: Elements per quantization block. It divides every step chunk size (4096 on CPU, 2048 on GPU), so a block never
#: straddles two programs' chunks and its absmax is a register reduction.
QBLOCK = 256
assert BLOCK % QBLOCK == 0 and STEP_BLOCK_GPU % QBLOCK == 0

#: Tensors with fewer elements than this keep fp32 moments under ``state_bits=8`` (their absmax overhead and error
#: would buy little memory), as bitsandbytes does with its own threshold.
SMALL_NUMEL = 4096

#: ``fp32(2 ** (-f / 8))`` for ``f = 0..7`` (each the correctly rounded value; checked against the float64 spec).
EIGHTHS = tuple(
    float.fromhex(h)
    for h in ("0x1p+0", "0x1.d5818ep-1", "0x1.ae89fap-1", "0x1.8ace54p-1",
              "0x1.6a09e6p-1", "0x1.4bfdaep-1", "0x1.306fe0p-1", "0x1.172b84p-1")
)

# Layout of the book tensor: signed codes, signed thresholds, unsigned codes, unsigned thresholds (256 each; the
# 256th threshold is +inf padding, never read).
_SIGNED, _UNSIGNED = 0, 512


def _host_book() -> np.ndarray:
    """The fp32 ``[1024]`` book: codes and thresholds of both books (module docstring)."""
    c = np.array([EIGHTHS[k % 8] * 2.0 ** -(k // 8) for k in range(255)], dtype=np.float64)  # exact scalings
    out = []
    for codes in (np.concatenate([-c[:127], [0.0], c[:128][::-1]]), np.concatenate([[0.0], c[::-1]])):
        mid = (codes[:-1] + codes[1:]) / 2  # exact (neighbours within a factor 2, or one of them zero)
        thr = mid.astype(np.float32)
        thr = np.where(thr.astype(np.float64) < mid, np.nextafter(thr, np.float32(np.inf)), thr)
        out += [codes.astype(np.float32), thr, np.array([np.inf], dtype=np.float32)]
    return np.concatenate(out).astype(np.float32)


_books: dict[torch.device, torch.Tensor] = {}


def book(device: torch.device) -> torch.Tensor:
    """The fp32 ``[1024]`` code-book tensor on ``device``, uploaded once (no host sync) and kept for the process.
    Raises ``RuntimeError`` when its first upload would happen during CUDA graph capture (make the optimizer state
    first: creating 8-bit state fetches the book)."""
    device = torch.device(device)
    hit = _books.get(device)
    if hit is None:
        if _capturing(device):
            raise RuntimeError(
                "fp16kit: the 8-bit state code book would be uploaded during CUDA graph capture; run one step "
                "eagerly before capturing."
            )
        hit = _books[device] = upload(torch.from_numpy(_host_book()), device)[0]
    return hit


def num_blocks(numel: int) -> int:
    """Quantization blocks (absmax entries) of a tensor of ``numel`` elements."""
    return -(-numel // QBLOCK)


# ---------------------------------------------------------------------------------------------------------------
# torch implementation


def _offset(signed: bool) -> int:
    return _SIGNED if signed else _UNSIGNED


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of the fp32 tensor ``x``: uint8 codes shaped like ``x`` and fp32 ``absmax`` of
    :func:`num_blocks` entries (module docstring). ``signed``: the ``exp_avg`` book, else ``exp_avg_sq``'s."""
    if x.dtype != torch.float32:
        raise TypeError(f"fp16kit: 8-bit state quantizes float32 tensors, got {x.dtype}.")
    n = x.numel()
    nb = num_blocks(n)
    flat = x.reshape(-1)
    if nb * QBLOCK != n:
        flat = torch.cat([flat, flat.new_zeros(nb * QBLOCK - n)])
    blocks = flat.view(nb, QBLOCK)
    a = blocks.abs()
    absmax = torch.where(torch.isfinite(a).all(1), a.amax(1) if n else a.new_zeros(0), float("nan"))
    scale = absmax[:, None]
    y = blocks / torch.where(scale == 0, 1.0, scale)  # an all-zero block: 0 / 1
    o = _offset(signed)
    thr = book(x.device)[o + 256 : o + 511]
    idx = torch.searchsorted(thr, y.reshape(-1), right=True)  # #{k : T_k <= y}
    idx = torch.where(torch.isnan(y.reshape(-1)), 0, idx)
    return idx[:n].to(torch.uint8).view(x.shape), absmax


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values ``book[code] * absmax`` shaped like ``codes`` (module docstring)."""
    o = _offset(signed)
    n = codes.numel()
    values = book(codes.device)[o : o + 256][codes.reshape(-1).long()]
    return (values * absmax.repeat_interleave(QBLOCK)[:n]).view(codes.shape)


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
def load_moment(ptrs, qptrs, row, num_tensors, numels, t, offs, mask, full, book_ptr, SIGNED: tl.constexpr,
                BLOCK: tl.constexpr, QB: tl.constexpr, ALIGNED: tl.constexpr):
    """The fp32 values of state row ``row`` (2: exp_avg, 3: exp_avg_sq) in the chunk: dequantized when tensor
    ``t``'s state is 8-bit (its absmax address ``qptrs[(row - 2) * num_tensors + t]`` is non-zero; the row then
    holds uint8 codes), else the row's fp32 values."""
    qaddr = tl.load(qptrs + (row - 2) * num_tensors + t)
    if qaddr != 0:
        codes = load_chunk(row_pointer(ptrs, row, num_tensors, t, tl.uint8, ALIGNED), offs, mask, full)
        b, bmask = _block_span(offs, tl.load(numels + t), BLOCK, QB)
        amax = tl.load(qaddr.to(tl.pointer_type(tl.float32)) + b, mask=bmask, other=0.0)
        x = dequantize_block(codes, amax, mask, book_ptr, SIGNED, BLOCK, QB)
    else:
        x = load_chunk(row_pointer(ptrs, row, num_tensors, t, tl.float32, ALIGNED), offs, mask, full)
    return x


@triton.jit
def store_moment(ptrs, qptrs, row, num_tensors, numels, t, offs, mask, full, x, book_ptr, SIGNED: tl.constexpr,
                 BLOCK: tl.constexpr, QB: tl.constexpr, ALIGNED: tl.constexpr):
    """Store the chunk's new fp32 moment ``x`` into state row ``row``: quantized (codes and the blocks' absmax)
    for an 8-bit tensor, else as is. Returns the values as stored (dequantized for an 8-bit tensor)."""
    qaddr = tl.load(qptrs + (row - 2) * num_tensors + t)
    if qaddr != 0:
        codes, amax, x = quantize_block(x, mask, book_ptr, SIGNED, BLOCK, QB)
        store_chunk(row_pointer(ptrs, row, num_tensors, t, tl.uint8, ALIGNED), offs, codes, mask, full)
        b, bmask = _block_span(offs, tl.load(numels + t), BLOCK, QB)
        tl.store(qaddr.to(tl.pointer_type(tl.float32)) + b, amax, mask=bmask)
    else:
        store_chunk(row_pointer(ptrs, row, num_tensors, t, tl.float32, ALIGNED), offs, x, mask, full)
    return x


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
