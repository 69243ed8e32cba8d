"""Hypothesis strategies for mixed-precision numerics: tensors with a controlled share of edge values.

Requires ``hypothesis`` (``pip install fp16kit[testing]``). Example::

    from hypothesis import given
    from fp16kit.numerics import strategies as fst

    @given(fst.tensor_lists(dtypes=(torch.float16, torch.float32)), fst.scales())
    def test_my_unscale(tensors, inv_scale): ...

Tensors are built from a drawn seed (fast, any size) and then edge values are written at drawn
positions, so Hypothesis shrinks towards fewer, simpler edge values and smaller shapes.

Edge classes (:data:`EDGE_CLASSES`), per dtype:

- ``zero``, ``neg_zero``: +0 and -0
- ``subnormal``: the smallest and largest subnormals, either sign
- ``min_normal``, ``max_finite``: the smallest normal and the largest finite value, either sign
- ``inf``, ``nan``: +-inf; NaN with several payloads (quiet, signalling, negative)
- ``overflow_after_scaling``: finite values whose product with ``scale`` overflows (needs ``scale > 1``)
- ``overflow_after_cast``: finite values of ``dtype`` that overflow when cast to ``cast_to``
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from .formats import format_of

__all__ = [
    "EDGE_CLASSES",
    "classify",
    "edge_values",
    "float_tensors",
    "scales",
    "shapes",
    "tensor_lists",
    "unscale_cases",
]

EDGE_CLASSES = (
    "zero",
    "neg_zero",
    "subnormal",
    "min_normal",
    "max_finite",
    "inf",
    "nan",
    "overflow_after_scaling",
    "overflow_after_cast",
)
_ALWAYS = EDGE_CLASSES[:7]

_NAN_BITS = {  # quiet, quiet with payload, signalling, negative quiet
    16: (0x7E00, 0x7E01, 0x7C01, -0x0200),  # fp16 patterns (as int16: 0xFE00 == -0x0200)
    32: (0x7FC00000, 0x7FC00001, 0x7F800001, -0x00400000),
}
_BF16_NAN_BITS = (0x7FC0, 0x7FC1, 0x7F81, -0x0040)


def edge_values(
    dtype: torch.dtype, kind: str, *, scale: float | None = None, cast_to: torch.dtype | None = None
) -> list[float]:
    """Representative values of one edge class for ``dtype`` (NaN payloads are set separately)."""
    fmt = format_of(dtype)
    if kind == "zero":
        return [0.0]
    if kind == "neg_zero":
        return [-0.0]
    if kind == "subnormal":
        largest = fmt.min_normal - fmt.min_subnormal
        return [fmt.min_subnormal, -fmt.min_subnormal, largest, -largest]
    if kind == "min_normal":
        return [fmt.min_normal, -fmt.min_normal]
    if kind == "max_finite":
        return [fmt.max, -fmt.max]
    if kind == "inf":
        return [math.inf, -math.inf]
    if kind == "nan":
        return [math.nan]
    if kind == "overflow_after_scaling":
        if scale is None or scale <= 1.0:
            return []
        limit = format_of(cast_to or dtype).max
        # The smallest and a larger finite x of dtype with |x * scale| > limit.
        lo = min(fmt.max, limit / scale * (1 + 4 * fmt.eps))
        return [v for v in (lo, -lo, fmt.max, -fmt.max) if abs(v) * scale > limit and abs(v) <= fmt.max]
    if kind == "overflow_after_cast":
        if cast_to is None or format_of(cast_to).max >= fmt.max:
            return []
        limit = format_of(cast_to).max
        # 65520 is the first value that rounds to inf in fp16; a little above it, and far above.
        first_inf = limit + 2.0 ** (math.floor(math.log2(limit)) - format_of(cast_to).mantissa_bits - 1)
        return [v for v in (first_inf, -first_inf, limit * 16, -limit * 16) if abs(v) <= fmt.max]
    raise ValueError(f"unknown edge class {kind!r}; choose from {EDGE_CLASSES}")


def _nan_bit_patterns(dtype: torch.dtype) -> tuple[int, ...]:
    if dtype == torch.bfloat16:
        return _BF16_NAN_BITS
    if dtype == torch.float16:
        return _NAN_BITS[16]
    if dtype == torch.float32:
        return _NAN_BITS[32]
    return ()


def shapes(max_numel: int = 64, max_dims: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes with at most ``max_numel`` elements (0-d and empty shapes included)."""

    def fits(shape: tuple[int, ...]) -> bool:
        return math.prod(shape) <= max_numel

    side = max(1, max_numel)
    return st.lists(st.integers(0, side), min_size=0, max_size=max_dims).map(tuple).filter(fits)


@st.composite
def float_tensors(
    draw: st.DrawFn,
    dtype: torch.dtype = torch.float32,
    shape: Sequence[int] | None = None,
    *,
    edge_fraction: float = 0.2,
    edges: Sequence[str] = _ALWAYS,
    scale: float | None = None,
    cast_to: torch.dtype | None = None,
    max_numel: int = 64,
    exponent_range: tuple[int, int] = (-12, 12),
) -> torch.Tensor:
    """A tensor of ``dtype``: random values over ``2^exponent_range`` plus edge values.

    Up to ``ceil(edge_fraction * numel)`` elements are replaced by values of the ``edges`` classes
    (``overflow_after_scaling`` needs ``scale``; ``overflow_after_cast`` needs ``cast_to``).
    """
    fmt = format_of(dtype)
    shape = tuple(shape) if shape is not None else draw(shapes(max_numel))
    n = math.prod(shape)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    lo, hi = exponent_range
    exps = torch.randint(lo, hi + 1, (n,), generator=gen).to(torch.float64)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * torch.pow(2.0, exps)
    values = values.clamp(-fmt.max, fmt.max)
    nan_positions: list[tuple[int, int]] = []
    pools = {k: edge_values(dtype, k, scale=scale, cast_to=cast_to) for k in edges}
    pools = {k: v for k, v in pools.items() if v}
    if n and pools and edge_fraction > 0:
        count = draw(st.integers(0, math.ceil(edge_fraction * n)))
        for _ in range(count):
            pos = draw(st.integers(0, n - 1))
            kind = draw(st.sampled_from(sorted(pools)))
            if kind == "nan" and _nan_bit_patterns(dtype):
                nan_positions.append((pos, draw(st.sampled_from(_nan_bit_patterns(dtype)))))
            values[pos] = draw(st.sampled_from(pools[kind]))
    out = values.to(dtype) if dtype != torch.float16 else _to_half_exact(values)
    if nan_positions:
        bits = out.view(format_of(dtype).int_dtype)
        for pos, pattern in nan_positions:
            bits[pos] = pattern
    return out.reshape(shape)


def _to_half_exact(values: torch.Tensor) -> torch.Tensor:
    # float64 -> float16 in torch goes through float32 (two roundings); round once, exactly.
    from .reference.kernels import round_to_format

    return round_to_format(values, torch.float16).to(torch.float16)


@st.composite
def tensor_lists(
    draw: st.DrawFn,
    dtypes: Sequence[torch.dtype] = (torch.float16, torch.bfloat16, torch.float32),
    *,
    min_size: int = 1,
    max_size: int = 4,
    max_numel: int = 64,
    edge_fraction: float = 0.2,
    edges: Sequence[str] = _ALWAYS,
    scale: float | None = None,
    cast_to: torch.dtype | None = None,
    exponent_range: tuple[int, int] = (-12, 12),
) -> list[torch.Tensor]:
    """A list of tensors, each of a dtype drawn from ``dtypes`` (mixed lists included)."""
    size = draw(st.integers(min_size, max_size))
    return [
        draw(
            float_tensors(
                draw(st.sampled_from(list(dtypes))),
                edge_fraction=edge_fraction,
                edges=edges,
                scale=scale,
                cast_to=cast_to,
                max_numel=max_numel,
                exponent_range=exponent_range,
            )
        )
        for _ in range(size)
    ]


def scales(
    *, powers_of_two_only: bool = False, min_exp: int = -24, max_exp: int = 24
) -> st.SearchStrategy[float]:
    """Positive scale factors: powers of two ``2^k`` (the loss-scaler case), and arbitrary floats."""
    powers = st.integers(min_exp, max_exp).map(lambda k: 2.0**k)
    if powers_of_two_only:
        return powers
    arbitrary = st.floats(min_value=2.0**min_exp, max_value=2.0**max_exp, allow_nan=False, allow_infinity=False)
    return st.one_of(powers, arbitrary)


@st.composite
def unscale_cases(
    draw: st.DrawFn,
    dtypes: Sequence[torch.dtype] = (torch.float16, torch.bfloat16, torch.float32),
    *,
    powers_of_two_only: bool = False,
    max_size: int = 4,
    max_numel: int = 64,
    edge_fraction: float = 0.2,
) -> tuple[list[torch.Tensor], float, list[torch.dtype] | None]:
    """``(tensors, inv_scale, out_dtypes)`` for an unscale call: in place (``out_dtypes=None``) or into
    drawn destination dtypes, with edge values that overflow only after this scale or this cast."""
    inv_scale = draw(scales(powers_of_two_only=powers_of_two_only, min_exp=-24, max_exp=8))
    in_place = draw(st.booleans())
    tensors, out_dtypes = [], []
    for _ in range(draw(st.integers(1, max_size))):
        dtype = draw(st.sampled_from(list(dtypes)))
        out_dtype = dtype if in_place else draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
        tensors.append(
            draw(
                float_tensors(
                    dtype,
                    edge_fraction=edge_fraction,
                    edges=EDGE_CLASSES,
                    scale=inv_scale,
                    cast_to=out_dtype,
                    max_numel=max_numel,
                )
            )
        )
        out_dtypes.append(out_dtype)
    return tensors, inv_scale, None if in_place else out_dtypes


def classify(
    t: torch.Tensor, *, scale: float | None = None, cast_to: torch.dtype | None = None
) -> set[str]:
    """The edge classes present in ``t`` (for checking strategies, or ``hypothesis.event`` stats)."""
    fmt = format_of(t.dtype)
    x = t.to(torch.float64).reshape(-1)
    bits = t.contiguous().view(fmt.int_dtype).reshape(-1)
    found = set()
    if bool(((x == 0) & (bits == 0)).any()):
        found.add("zero")
    if bool(((x == 0) & (bits != 0)).any()):
        found.add("neg_zero")
    finite = torch.isfinite(x)
    if bool(((x != 0) & (x.abs() < fmt.min_normal)).any()):
        found.add("subnormal")
    if bool((x.abs() == fmt.min_normal).any()):
        found.add("min_normal")
    if bool((x.abs() == fmt.max).any()):
        found.add("max_finite")
    if bool(torch.isinf(x).any()):
        found.add("inf")
    if bool(torch.isnan(x).any()):
        found.add("nan")
    target = format_of(cast_to or t.dtype)
    if scale is not None and scale > 1 and bool((finite & (x.abs() * scale > target.max)).any()):
        found.add("overflow_after_scaling")
    if cast_to is not None:
        from .reference.kernels import round_to_format

        if bool((finite & torch.isinf(round_to_format(x, cast_to))).any()):
            found.add("overflow_after_cast")
    return found
