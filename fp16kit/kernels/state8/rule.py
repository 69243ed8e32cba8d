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
``code = #{k < 255 : y >= T_k}``: a binary search of 8 steps in the kernels; in torch a table look-up on the high 16
bits of ``y`` and one comparison (``_host_lut``: equal to ``torch.searchsorted`` on the thresholds).

Here: the code books (:func:`book`, one fp32 device tensor per device), the torch implementation
(:func:`quantize`, :func:`dequantize`) and the state layout (:func:`new_state`, :func:`absmax_of`). The Triton
device functions of the same rule, which the Adam and LAMB kernels call, are in ``fp16kit/kernels/state8/triton.py``.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from ..engine.table import BLOCK, STEP_BLOCK_GPU, _capturing, upload

__all__ = [
    "EIGHTHS",
    "QBLOCK",
    "SMALL_NUMEL",
    "ZERO_CODE",
    "absmax_of",
    "book",
    "check_room",
    "dequantize",
    "from_state8",
    "new_state",
    "num_blocks",
    "quantize",
    "quantize_into",
    "to_state8",
    "uses_state8",
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


def _host_lut(signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(base, thr)`` over the ``2^16`` high halves ``h`` of fp32 patterns (sign, exponent, top 7 mantissa bits):
    every fp32 ``y`` whose high half is ``h`` has ``#{k : T_k <= y} = base[h] + (y >= thr[h])``, ``thr[h]`` being
    the only threshold inside that interval of fp32 values (NaN: none). Each interval spans 1/128 of an octave and
    neighbouring thresholds are at least 2^(1/8) apart (or 0 and a tiny midpoint), so one interval holds at most one
    threshold (asserted). NaN patterns (a poisoned block's ``x / NaN``) get code 0; ``+-inf`` never occur
    (``|y| <= 1``)."""
    o = _offset(signed)
    thr = _host_book()[o + 256 : o + 511].astype(np.float64)
    h = np.arange(1 << 16, dtype=np.uint32)
    with np.errstate(invalid="ignore"):
        lo = (h << 16).view(np.float32).astype(np.float64)
        hi = ((h << 16) | 0xFFFF).view(np.float32).astype(np.float64)
    neg = h >= 1 << 15
    low, high = np.where(neg, hi, lo), np.where(neg, lo, hi)
    finite = np.isfinite(low) & np.isfinite(high)
    base = np.where(finite, np.searchsorted(thr, low, side="right"), 0)
    top = np.where(finite, np.searchsorted(thr, high, side="right"), 0)
    assert (top - base).max() <= 1
    nxt = np.where(top > base, thr[np.minimum(base, 254)], np.nan)
    return base.astype(np.uint8), nxt.astype(np.float32)


_luts: dict[tuple[torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}


def _lut(device: torch.device, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantizer's lookup tables (:func:`_host_lut`) on ``device``, made once."""
    key = (device, signed)
    hit = _luts.get(key)
    if hit is None:
        base, thr = _host_lut(signed)
        hit = _luts[key] = (torch.from_numpy(base).to(device), torch.from_numpy(thr).to(device))
    return hit


def _high_halves(y: torch.Tensor) -> torch.Tensor:
    """int32 ``bits(y) >> 16`` (0..65535) of the contiguous fp32 ``y``, flat (on a little-endian CPU one conversion
    of the high uint16 halves; elsewhere a shift and a mask, ops every backend has)."""
    if sys.byteorder == "little" and y.device.type == "cpu":
        return y.view(-1).view(torch.uint16)[1::2].to(torch.int32)
    return torch.bitwise_right_shift(y.view(-1).view(torch.int32), 16).bitwise_and_(0xFFFF)


def _codes(y: torch.Tensor, signed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 ``#{k : T_k <= y}`` of the contiguous fp32 quotients ``y`` (``|y| <= 1``, or NaN: code 0), flat (into
    ``out`` when given: uint8, ``y.numel()`` elements): a table look-up on the high half of each fp32 pattern and
    one comparison (:func:`_host_lut`), equal to ``torch.searchsorted`` on the thresholds."""
    base, thr = _lut(y.device, signed)
    idx = _high_halves(y)
    codes = base.index_select(0, idx) if out is None else torch.index_select(base, 0, idx, out=out)
    return codes.add_(torch.ge(y.view(-1), thr.index_select(0, idx)))


def _quotients(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(y, absmax, n)``: the fp32 quotients ``x / absmax`` of ``x`` padded to whole blocks (``[blocks, QBLOCK]``),
    the absmax (NaN for a block holding a NaN or an infinity: its quotients are NaN, code 0) and ``x.numel()``."""
    if x.dtype != torch.float32:
        raise TypeError(f"fp16kit: 8-bit state quantizes float32 tensors, got {x.dtype}.")
    n = x.numel()
    nb = num_blocks(n)
    flat = x.reshape(-1)
    if nb * QBLOCK != n:
        flat = torch.cat([flat, flat.new_zeros(nb * QBLOCK - n)])
    blocks = flat.view(nb, QBLOCK)
    absmax = blocks.abs().amax(1) if n else flat.new_zeros(0)  # NaN if the block holds one, inf if an inf
    absmax.masked_fill_(~torch.isfinite(absmax), float("nan"))
    # an all-zero block: 0 / 1; a poisoned one: x / NaN = NaN
    return blocks / absmax.masked_fill(absmax == 0, 1.0)[:, None], absmax, n


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of the fp32 tensor ``x``: uint8 codes shaped like ``x`` and fp32 ``absmax`` of
    :func:`num_blocks` entries (module docstring). ``signed``: the ``exp_avg`` book, else ``exp_avg_sq``'s."""
    y, absmax, n = _quotients(x)
    return _codes(y, signed)[:n].view(x.shape), absmax


def quantize_into(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> None:
    """:func:`quantize` of the fp32 tensor ``x`` written into ``codes`` (contiguous uint8, ``x.numel()`` elements)
    and ``absmax`` (fp32, ``num_blocks`` entries)."""
    y, a, n = _quotients(x)
    absmax.copy_(a)
    if y.numel() == n:
        _codes(y, signed, out=codes.view(-1))
    else:
        codes.view(-1).copy_(_codes(y, signed)[:n])


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values ``book[code] * absmax`` shaped like ``codes`` (module docstring)."""
    o = _offset(signed)
    n = codes.numel()
    values = book(codes.device)[o : o + 256].index_select(0, codes.reshape(-1).int())
    full = n // QBLOCK * QBLOCK
    values[:full].view(-1, QBLOCK).mul_(absmax[: full // QBLOCK, None])
    values[full:].mul_(absmax[full // QBLOCK :])  # the ragged last block (at most one absmax)
    return values.view(codes.shape)


# ---------------------------------------------------------------------------------------------------------------
# state layout


#: The code of 0: index 127 of the signed book, 0 of the unsigned one.
ZERO_CODE = {True: 127, False: 0}


def uses_state8(p: torch.Tensor) -> bool:
    """Whether a param's moments are 8-bit under ``state_bits=8``: fp16/bf16/fp32 params of at least
    :data:`SMALL_NUMEL` elements (float64 params and smaller tensors keep their fp32/fp64 moments)."""
    return p.dtype != torch.float64 and p.numel() >= SMALL_NUMEL


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


def new_state(shape: torch.Size | tuple[int, ...], device: torch.device, signed: bool) -> torch.Tensor:
    """A zero 8-bit moment shaped ``shape``: uint8 codes (the zero code) whose storage holds, ``align16(numel)``
    bytes after the first code, the ``num_blocks(numel)`` fp32 absmax values (:func:`absmax_of`; all 0). The
    kernels find the absmax from the codes' address, so the two must live in this one buffer."""
    n = 1
    for d in shape:
        n *= int(d)
    buf = torch.zeros(_align16(n) + 4 * num_blocks(n), dtype=torch.uint8, device=device)
    codes = buf[:n].view(shape)
    codes.fill_(ZERO_CODE[signed])
    return codes


def absmax_of(codes: torch.Tensor) -> torch.Tensor:
    """The fp32 absmax view of an 8-bit moment made by :func:`new_state` (raises ``ValueError`` for a uint8
    tensor that is not such a moment: its storage has no room for the absmax)."""
    check_room(codes)
    n = codes.numel()
    flat = codes.as_strided((_align16(n) + 4 * num_blocks(n),), (1,), codes.storage_offset())
    return flat[_align16(n) :].view(torch.float32)


def check_room(codes: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``codes`` is a contiguous uint8 tensor whose storage holds its absmax after it
    (:func:`new_state`); reads metadata only (no tensor op)."""
    n = codes.numel()
    need = _align16(n) + 4 * num_blocks(n)
    start = codes.storage_offset()
    if codes.dtype != torch.uint8 or codes.untyped_storage().nbytes() < start + need or not codes.is_contiguous():
        raise ValueError(
            "fp16kit: an 8-bit moment must be made by fp16kit.kernels.to_state8 (uint8 codes followed by their fp32 "
            "absmax in one buffer); got a tensor without room for the absmax. Rebuild the optimizer state (or load "
            "the checkpoint into an optimizer constructed with state_bits=8)."
        )


def to_state8(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """An 8-bit moment (:func:`new_state`) holding ``quantize(x)`` (``x`` fp32)."""
    codes = new_state(x.shape, x.device, signed)
    q, a = quantize(x.contiguous(), signed)
    codes.copy_(q)
    absmax_of(codes).copy_(a)
    return codes


def from_state8(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """The fp32 values of an 8-bit moment."""
    return dequantize(codes, absmax_of(codes), signed)
