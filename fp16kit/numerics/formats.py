"""Facts about the floating-point formats of mixed-precision training, and ulp arithmetic.

=========  ====  ========  ===========  ==============  ===============  ========
format     bits  mantissa  max finite   smallest normal smallest subnorm  eps
=========  ====  ========  ===========  ==============  ===============  ========
float16    16    10        65504        2^-14           2^-24            2^-10
bfloat16   16    7         ~3.39e38     2^-126          2^-133           2^-7
float32    32    23        ~3.40e38     2^-126          2^-149           2^-23
float64    64    52        ~1.80e308    2^-1022         2^-1074          2^-52
e4m3fn     8     3         448          2^-6            2^-9             2^-3
e5m2       8     2         57344        2^-14           2^-16            2^-2
=========  ====  ========  ===========  ==============  ===============  ========

The two fp8 formats (``torch.float8_e4m3fn`` and ``torch.float8_e5m2``) are present when torch has them.
``e4m3fn`` has no infinities (its one NaN pattern per sign takes the top code), so ``has_inf`` is false
and a cast to it saturates: torch 2.13 converts anything beyond 448, infinities included, to +-448 (torch 2.11
casts them to NaN; fp16kit's reference saturates on every torch).

``ulp(x, dtype)`` is the spacing of ``dtype``'s representable numbers at ``|x|``: ``2^(e - mantissa_bits)``
for a normal ``x`` with exponent ``e``, and the smallest subnormal below the normal range.
``ulp_distance(a, b)`` counts the representable values between two tensors of one dtype, via the
standard order-preserving map from IEEE bit patterns to integers (so -0 and +0 are 0 apart and the
distance across zero is the number of subnormal steps in between).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FORMATS", "FP8_DTYPES", "FloatFormat", "format_of", "gamma", "ulp", "ulp_distance", "unit_roundoff"]


@dataclass(frozen=True)
class FloatFormat:
    """One IEEE-like binary floating-point format."""

    dtype: torch.dtype
    name: str
    bits: int
    mantissa_bits: int  # stored fraction bits (the implicit leading 1 not counted)
    exponent_bits: int
    max: float  # largest finite value
    min_normal: float
    min_subnormal: float
    eps: float  # ulp(1.0) = 2^-mantissa_bits
    has_inf: bool = True  # False for float8_e4m3fn, whose casts saturate at +-max

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number (``min_normal = 2**min_exponent``)."""
        return int(math.log2(self.min_normal))

    @property
    def int_dtype(self) -> torch.dtype:
        """Signed integer dtype of the same width, for bit-level views."""
        return {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[self.bits]


_FP8 = tuple(
    (getattr(torch, attr), name, mantissa, has_inf)
    for attr, name, mantissa, has_inf in (
        ("float8_e4m3fn", "float8_e4m3fn", 3, False),
        ("float8_e5m2", "float8_e5m2", 2, True),
    )
    if hasattr(torch, attr)
)


def _make(dtype: torch.dtype, name: str) -> FloatFormat:
    info = torch.finfo(dtype)
    mantissa = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}.get(dtype)
    fp8 = {d: (m, inf) for d, _, m, inf in _FP8}
    if mantissa is None:
        mantissa = fp8[dtype][0]
    return FloatFormat(
        dtype=dtype,
        name=name,
        bits=info.bits,
        mantissa_bits=mantissa,
        exponent_bits=info.bits - 1 - mantissa,
        max=float(info.max),
        min_normal=float(info.smallest_normal),
        min_subnormal=float(info.smallest_normal) * 2.0**-mantissa,
        eps=float(info.eps),
        has_inf=fp8.get(dtype, (0, True))[1],
    )


FORMATS: dict[torch.dtype, FloatFormat] = {
    d: _make(d, n)
    for d, n in (
        (torch.float16, "float16"),
        (torch.bfloat16, "bfloat16"),
        (torch.float32, "float32"),
        (torch.float64, "float64"),
        *((d, n) for d, n, _, _ in _FP8),
    )
}
#: The fp8 dtypes this torch has (empty on a torch without them).
FP8_DTYPES: tuple[torch.dtype, ...] = tuple(d for d, _, _, _ in _FP8)


def format_of(dtype: torch.dtype) -> FloatFormat:
    """The :class:`FloatFormat` of a torch floating dtype (TypeError for anything else)."""
    try:
        return FORMATS[dtype]
    except KeyError:
        raise TypeError(f"no floating-point format facts for {dtype}; expected one of {list(FORMATS)}") from None


def ulp(x: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype``'s representable numbers at ``|x|``, as float64 (``x`` is any real value).

    For ``|x|`` in ``[2^e, 2^(e+1))`` with ``e >= min_exponent`` this is ``2^(e - mantissa_bits)``;
    below the normal range it is the smallest subnormal. Non-finite ``x`` gives NaN.
    """
    fmt = format_of(dtype)
    xs = torch.as_tensor(x, dtype=torch.float64).abs()
    finite = torch.isfinite(xs)
    safe = torch.where(finite & (xs > 0), xs, torch.ones_like(xs))
    # frexp: safe = m * 2^k with m in [0.5, 1), so the binary exponent is k - 1 (exact, no log2 rounding).
    _, k = torch.frexp(safe)
    e = torch.clamp(k.to(torch.float64) - 1, min=fmt.min_exponent)
    spacing = torch.pow(2.0, e - fmt.mantissa_bits)
    spacing = torch.where(xs > 0, spacing, torch.full_like(xs, fmt.min_subnormal))
    return torch.where(finite, spacing, torch.full_like(xs, math.nan))


def _ordered_ints(t: torch.Tensor) -> torch.Tensor:
    """Map IEEE bit patterns to int64 so that numeric order equals integer order (-0 == +0)."""
    fmt = format_of(t.dtype)
    bits = t.contiguous().view(fmt.int_dtype).to(torch.int64)
    sign_bit = 1 << (fmt.bits - 1)
    magnitude = bits & (sign_bit - 1)
    return torch.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values of ``a.dtype`` from ``a`` to ``b``, elementwise (int64, >= 0).

    Both tensors must have the same floating dtype. Where either side is NaN the result is -1
    (compare NaN-ness separately); ``inf`` counts as one step past the largest finite value.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance needs tensors of one dtype, got {a.dtype} and {b.dtype}")
    a, b = torch.broadcast_tensors(a, b)
    dist = (_ordered_ints(a) - _ordered_ints(b)).abs()
    return torch.where(torch.isnan(a) | torch.isnan(b), torch.full_like(dist, -1), dist)


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one round-to-nearest operation in ``dtype``."""
    return format_of(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: relative error bound of ``n`` chained roundings.

    Summing ``n`` non-negative terms in any order (serial, tree or blocked) has relative error at
    most ``gamma_(n-1)``; a tree of depth ``d`` has at most ``gamma_d``. Use it to derive tolerances
    for reductions such as norms.
    """
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) is unbounded in {dtype}: n * u >= 1")
    return nu / (1 - nu)
