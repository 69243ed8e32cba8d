"""float64 reference implementations of the multi-tensor kernels: the spec, written to be read.

Rounding is done by :func:`round_to_format`, a direct implementation of IEEE round-to-nearest-even
for any of the formats in :mod:`fp16kit.numerics.formats`, so a reference never relies on a library
conversion (torch converts float64 -> float16 through float32, which rounds twice).

The kernels compute ``y = fp32(x) * inv_scale`` in fp32 arithmetic. A product of two fp32 numbers
is exact in float64 (24 + 24 significant bits < 53), so the reference computes it exactly and then
rounds it to fp32 once (what an fp32 multiply does), and then to the destination format. With that,
kernel and reference agree bit for bit for every scale, not only for powers of two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..formats import format_of

__all__ = ["UnscaleResult", "copy", "l2norm", "round_to_format", "unscale_and_check"]


def round_to_format(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 values to the nearest ``dtype`` value, ties to even; returned as float64.

    For finite ``x`` with binary exponent ``e`` (clamped below at the format's smallest normal
    exponent, which yields subnormals), the representable neighbours are multiples of
    ``q = 2^(e - mantissa_bits)``; ``round_half_even(x / q) * q`` is exact in float64. A result above
    the largest finite value overflows to inf with x's sign. inf and NaN pass through. For a format
    without infinities (``float8_e4m3fn``) the result saturates instead, as torch's cast does: anything
    that rounds above the largest finite value, inf included, becomes +-max.
    """
    fmt = format_of(dtype)
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    mag = torch.where(finite & (x != 0), x.abs(), torch.ones_like(x))
    _, k = torch.frexp(mag)
    e = torch.clamp(k.to(torch.float64) - 1, min=fmt.min_exponent)
    q = torch.pow(2.0, e - fmt.mantissa_bits)
    rounded = torch.round(x / q) * q  # torch.round: half to even
    top = float("inf") if fmt.has_inf else fmt.max
    rounded = torch.where(rounded.abs() > fmt.max, torch.copysign(torch.full_like(x, top), x), rounded)
    rounded = torch.where(x == 0, x, rounded)  # keeps the sign of zero
    rounded = torch.where(finite, rounded, x)
    if not fmt.has_inf:
        rounded = torch.where(torch.isinf(x), torch.copysign(torch.full_like(x, fmt.max), x), rounded)
    return rounded


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale`` as the kernels compute it: exact product, rounded once to the math format."""
    math = _math_dtype(x.dtype)
    s = float(round_to_format(torch.tensor(scale, dtype=torch.float64), math))
    return round_to_format(x.to(torch.float64) * s, math)


@dataclass
class UnscaleResult:
    """What ``unscale_and_check`` must produce."""

    outputs: list[torch.Tensor]  # in the destination dtypes
    found_inf: bool
    sq_norm: float  # sum of y*y over all elements, in float64


def unscale_and_check(
    tensors: Sequence[torch.Tensor],
    inv_scale: float,
    out_dtypes: Sequence[torch.dtype] | None = None,
) -> UnscaleResult:
    """Reference for :func:`fp16kit.kernels.unscale_and_check`.

    ``y = round_fp32(x * round_fp32(inv_scale))`` (float64 math for float64 tensors); the written
    value is ``round(y, destination dtype)``; ``found_inf`` is whether any written value is inf/NaN;
    ``sq_norm = sum(y^2)`` in float64. ``out_dtypes`` defaults to the inputs' own (in place).
    """
    dtypes = [t.dtype for t in tensors] if out_dtypes is None else list(out_dtypes)
    outputs, found, sq = [], False, 0.0
    for x, dtype in zip(tensors, dtypes):
        y = _scaled(x, inv_scale)
        written = round_to_format(y, dtype)
        found = found or not bool(torch.isfinite(written).all())
        sq += float((y * y).sum())
        outputs.append(written.to(dtype))
    return UnscaleResult(outputs, found, sq)


def _norm(values: Sequence[float]) -> float:
    """``sqrt(sum v^2)`` without intermediate overflow or underflow (``math.hypot`` scales, as BLAS ``nrm2``);
    NaN if any value is NaN (as a sum of squares would be), else inf if any is inf."""
    if any(v != v for v in values):
        return math.nan
    return math.hypot(*values)


def l2norm(
    tensors: Sequence[torch.Tensor], pre_scale: float = 1.0
) -> tuple[float, list[float], bool]:
    """Reference for :func:`fp16kit.kernels.l2norm`: ``(global norm, per-tensor norms, any non-finite)``.

    Each element is ``y = round_fp32(x * round_fp32(pre_scale))`` (float64 math for float64 tensors); norms
    are ``sqrt(sum y^2)`` computed in float64 with scaling, so they are right (to float64 rounding) for every
    finite ``y``, however large or small: the kernels are held to this, within 1 ulp of their fp32 output.
    """
    per, found = [], False
    for x in tensors:
        y = _scaled(x, pre_scale)
        found = found or not bool(torch.isfinite(y).all())
        per.append(_norm(y.reshape(-1).tolist()))
    return _norm(per), per, found


def copy(src: Sequence[torch.Tensor], dst_dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Reference for :func:`fp16kit.kernels.copy_`: each source rounded (nearest even) to its destination dtype."""
    return [round_to_format(s.to(torch.float64), d).to(d) for s, d in zip(src, dst_dtypes)]
