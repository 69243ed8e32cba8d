"""float64 reference of the 8-bit optimizer-state quantizer (``state_bits=8``; docs/optim.md, "8-bit moments").

The spec, written from the definition and independently of ``fp16kit/kernels/state8/triton.py`` (which hard-codes the
same code books as hex constants; the tests check that both agree bit for bit):

*Magnitudes.* ``c_k = fp32(2 ** (-k / 8))`` for ``k >= 0``: the power rounded once, to the nearest fp32 (computed
here with 60 significant decimal digits). Consecutive magnitudes are ``2 ** (1/8)`` (about 9 %) apart.

*Code books* (256 entries each, strictly ascending):

- signed (``exp_avg``): ``-c_0, -c_1, ..., -c_126`` (indices 0..126), ``0`` (index 127), ``c_127, ..., c_1, c_0``
  (indices 128..255). So index 0 is -1, index 255 is +1, and the smallest non-zero magnitudes are
  ``c_126 = 2**-15.75`` (negative) and ``c_127 = 2**-15.875`` (positive).
- unsigned (``exp_avg_sq``): ``0`` (index 0), then ``c_254, ..., c_0`` (indices 1..255); ``c_254 = 2**-31.75``.

*Blocks.* A tensor is flattened and cut into blocks of :data:`QBLOCK` = 256 consecutive elements (the last one
ragged). Each block stores one fp32 ``absmax = max |x|`` over its elements, and one uint8 code per element.

*Quantize* (per element ``x`` of a block with ``absmax``):

- ``y = 0`` when ``absmax == 0``, else ``y = fp32(x / absmax)`` (the IEEE fp32 quotient, so ``|y| <= 1``);
- the code is the index of the code-book entry nearest to ``y``; a ``y`` exactly halfway between two entries takes
  the higher index (toward +inf). Equivalently, with the exact float64 midpoints ``mid_k = (b_k + b_{k+1}) / 2``,
  ``index = #{k : y >= mid_k}``;
- a block holding a NaN or an infinity gets ``absmax = NaN`` and every code 0 (it dequantizes to NaN throughout).
  ``-0.0`` quantizes to the zero code (dequantized ``+0.0``).

*Dequantize*: ``fp32(b[code] * absmax)`` (the product is exact in float64, so this is one rounding).

*Resolution.* With nearest rounding on a ratio-``r`` grid (``r = 2 ** (1/8)``, widened by the fp32 rounding of the
magnitudes), ``|dequantize(quantize(x)) - x| <= ERR_REL * |x| + c_min * absmax / 2 + 2 ** -24 * absmax`` where
``ERR_REL = (r - 1) / (r + 1)`` rounded up to 0.0434, and ``c_min`` is the gap next to zero: the larger of the
book's smallest positive and smallest negative magnitudes (signed ``c_126 = 2**-15.75``, unsigned ``c_254``;
:func:`resolution`).
"""

from __future__ import annotations

from decimal import Decimal, getcontext

import numpy as np
import torch

__all__ = ["ERR_REL", "QBLOCK", "code_book", "dequantize", "magnitudes", "midpoints", "quantize", "resolution"]

#: Elements per quantization block (one fp32 absmax each).
QBLOCK = 256
#: Relative error bound of the nearest code above the book's smallest non-zero magnitude: (r - 1) / (r + 1) with
#: r = 2 ** (1/8) is 0.04329; rounded up to cover the fp32 rounding of the magnitudes and of ``x / absmax``.
ERR_REL = 0.0434


def _nearest_fp32(d: Decimal) -> float:
    """The fp32 value nearest to the positive decimal ``d`` (ties cannot occur for these irrational powers)."""
    x = np.float32(float(d))
    cands = (np.nextafter(x, np.float32(0)), x, np.nextafter(x, np.float32(np.inf)))
    return float(min(cands, key=lambda c: abs(Decimal(float(c)) - d)))


def magnitudes(count: int) -> np.ndarray:
    """``[c_0, ..., c_{count-1}]`` with ``c_k = fp32(2 ** (-k / 8))``, as float64 (each an fp32 value)."""
    getcontext().prec = 60
    return np.array([_nearest_fp32(Decimal(2) ** (Decimal(-k) / 8)) for k in range(count)], dtype=np.float64)


def code_book(signed: bool) -> np.ndarray:
    """The 256 ascending code values (float64, each an fp32 value) of the signed or unsigned book."""
    if signed:
        c = magnitudes(128)
        return np.concatenate([-c[:127], [0.0], c[::-1]])
    c = magnitudes(255)
    return np.concatenate([[0.0], c[::-1]])


def midpoints(signed: bool) -> np.ndarray:
    """The 255 exact midpoints between consecutive entries (float64: neighbours are within a factor 2, or one is
    zero, so the sum is exact)."""
    b = code_book(signed)
    return (b[:-1] + b[1:]) / 2


def resolution(signed: bool) -> tuple[float, float]:
    """``(ERR_REL, c_min)``: the relative bound and the gap next to zero (module docstring)."""
    b = code_book(signed)
    neg = b[b < 0]
    return ERR_REL, float(max(b[b > 0].min(), -neg.max() if neg.size else 0.0))


def _blocks(x: torch.Tensor) -> np.ndarray:
    flat = x.detach().reshape(-1).to(torch.float64).numpy()
    nb = -(-flat.size // QBLOCK)
    out = np.zeros(nb * QBLOCK, dtype=np.float64)
    out[: flat.size] = flat
    return out.reshape(nb, QBLOCK)


def quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` of fp32 ``x`` (any shape): uint8 codes shaped like ``x`` and fp32 ``absmax`` of
    ``ceil(numel / QBLOCK)`` blocks (module docstring)."""
    if x.dtype != torch.float32:
        raise TypeError(f"quantize: x must be float32, got {x.dtype}")
    blocks = _blocks(x)
    a = np.abs(blocks)
    bad = ~np.isfinite(a).all(axis=1)
    absmax = np.where(bad, np.nan, np.where(np.isfinite(a), a, 0.0).max(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(absmax[:, None] == 0, 0.0, blocks / absmax[:, None])
    y = y.astype(np.float32).astype(np.float64)  # the fp32 quotient: float64 division, then one rounding
    idx = np.searchsorted(midpoints(signed), y, side="right")  # #{k : mid_k <= y}: ties to the higher index
    idx = np.where(np.isnan(y), 0, idx)
    codes = torch.from_numpy(idx.reshape(-1)[: x.numel()].astype(np.uint8)).reshape(x.shape)
    return codes, torch.from_numpy(absmax.astype(np.float32))


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values ``fp32(book[code] * absmax)`` shaped like ``codes``."""
    book = code_book(signed)
    idx = codes.reshape(-1).to(torch.int64).numpy()
    scale = np.repeat(absmax.to(torch.float64).numpy(), QBLOCK)[: idx.size]
    out = (book[idx] * scale).astype(np.float32)
    return torch.from_numpy(out).reshape(codes.shape)
