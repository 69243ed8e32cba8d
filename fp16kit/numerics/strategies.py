"""Hypothesis strategies for mixed-precision numerics: tensors whose elements Hypothesis draws and shrinks.

Requires ``hypothesis`` (``pip install fp16kit[testing]``). Example::

    from hypothesis import given
    from fp16kit.numerics import strategies as fst

    @given(fst.float_tensors(torch.bfloat16, shape=fst.shapes(min_dims=2), exclude=("nan",)))
    def test_my_rms_norm(x): ...

**Every element is drawn by Hypothesis** (for tensors of up to ``max_drawn`` elements, 64 by default).
Elements are drawn in order, each one an ordinary ``normal`` value or, with probability about
``edge_fraction``, a value of one of the edge classes, or (rarely while generating, often while
shrinking) a "stop": the rest of the tensor then repeats the elements drawn so far. So a failure caused by
one value shrinks to a minimal shape filled with that value (``[[12.]]``), and a failure that needs two
values to a tensor of those two. Hypothesis favours simple draws, so the measured share of edge values at
the default ``edge_fraction=0.2`` is about 0.1, and about two thirds of a tensor's elements are distinct. Larger
tensors (a fixed ``shape`` above ``max_drawn`` elements) get a background from a drawn seed and edge values
at drawn positions; their failures shrink the seed and the edge values, not the background.

Edge classes (:data:`EDGE_CLASSES`), per dtype, named to include (``edges=``) or leave out (``exclude=``):

- ``normal``: finite normal values with binary exponents in ``exponent_range`` (the background class)
- ``zeros``: +0 and -0
- ``subnormals``: the smallest and the largest subnormal, either sign
- ``min_normal``, ``max_finite``: the smallest normal and the largest finite value, either sign
- ``inf``: +-inf (none for ``float8_e4m3fn``, which has no infinities)
- ``nan``: NaN with several bit patterns (quiet, with payload, signalling, negative)
- ``overflow_after_scale``: finite values whose product with ``scale`` overflows (given ``scale > 1``)
- ``overflow_after_cast``: finite values of ``dtype`` that overflow when cast to ``cast_to`` (given ``cast_to``)

Shapes (:func:`shapes`) are drawn by rank and side. Measured over 300 default ``float_tensors()`` draws:
about 3% are 0-d, 4% empty, and the rest have rank 1 to 3 (roughly evenly), 30 elements on average.
Layouts (:data:`LAYOUTS`): ``contiguous``, ``non_contiguous`` (every other element of a larger buffer whose
gaps hold NaN, so reading a gap shows), ``transposed`` (dimensions stored in reverse order) and
``channels_last`` (4-d and 5-d tensors).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

from .formats import FP8_DTYPES, format_of

__all__ = [
    "DEFAULT_EDGES",
    "EDGE_CLASSES",
    "LAYOUTS",
    "broadcastable_shapes",
    "classify",
    "dtypes",
    "edge_values",
    "float_tensors",
    "scales",
    "shapes",
    "tensor_lists",
    "unscale_cases",
]

EDGE_CLASSES = (
    "zeros",
    "subnormals",
    "min_normal",
    "max_finite",
    "inf",
    "nan",
    "overflow_after_scale",
    "overflow_after_cast",
)
#: The classes drawn when ``edges`` is not given; the overflow classes join them when ``scale`` or
#: ``cast_to`` is given.
DEFAULT_EDGES = EDGE_CLASSES[:6]
_CLASSES = ("normal", *EDGE_CLASSES)
# Earlier names, still accepted.
_ALIASES = {
    "zero": "zeros",
    "neg_zero": "zeros",
    "subnormal": "subnormals",
    "overflow_after_scaling": "overflow_after_scale",
}

LAYOUTS = ("contiguous", "non_contiguous", "transposed", "channels_last")

_NAN_BITS = {  # quiet, quiet with payload, signalling, negative quiet (as signed integers of the width)
    torch.float16: (0x7E00, 0x7E01, 0x7C01, -0x0200),
    torch.bfloat16: (0x7FC0, 0x7FC1, 0x7F81, -0x0040),
    torch.float32: (0x7FC00000, 0x7FC00001, 0x7F800001, -0x00400000),
    torch.float64: (0x7FF8000000000000, 0x7FF8000000000001, 0x7FF0000000000001, -0x0008000000000000),
}
if len(FP8_DTYPES) == 2:
    _NAN_BITS[FP8_DTYPES[0]] = (0x7F, -0x01)  # e4m3fn: one NaN per sign
    _NAN_BITS[FP8_DTYPES[1]] = (0x7E, 0x7F, 0x7D, -0x02)


def _canonical(kind: str) -> str:
    kind = _ALIASES.get(kind, kind)
    if kind not in _CLASSES:
        raise ValueError(f"unknown edge class {kind!r}; choose from {_CLASSES}")
    return kind


def edge_values(
    dtype: torch.dtype, kind: str, *, scale: float | None = None, cast_to: torch.dtype | None = None
) -> list[float]:
    """Representative values of one edge class for ``dtype`` (NaN payloads are set separately)."""
    fmt = format_of(dtype)
    kind = _canonical(kind)
    if kind == "normal":
        raise ValueError("'normal' values are drawn from a range, not a list; see float_tensors(exponent_range=)")
    if kind == "zeros":
        return [0.0, -0.0]
    if kind == "subnormals":
        largest = fmt.min_normal - fmt.min_subnormal
        return [fmt.min_subnormal, -fmt.min_subnormal, largest, -largest]
    if kind == "min_normal":
        return [fmt.min_normal, -fmt.min_normal]
    if kind == "max_finite":
        return [fmt.max, -fmt.max]
    if kind == "inf":
        return [math.inf, -math.inf] if fmt.has_inf else []
    if kind == "nan":
        return [math.nan]
    if kind == "overflow_after_scale":
        if scale is None or scale <= 1.0:
            return []
        limit = format_of(cast_to or dtype).max
        # The smallest and a larger finite x of dtype with |x * scale| > limit.
        lo = min(fmt.max, limit / scale * (1 + 4 * fmt.eps))
        return [v for v in (lo, -lo, fmt.max, -fmt.max) if abs(v) * scale > limit and abs(v) <= fmt.max]
    # overflow_after_cast
    if cast_to is None or format_of(cast_to).max >= fmt.max:
        return []
    target = format_of(cast_to)
    # The first value that rounds past the largest finite one (65520 for fp16), and far above it.
    first = target.max + 2.0 ** (math.floor(math.log2(target.max)) - target.mantissa_bits - 1)
    if not target.has_inf:
        first += 2.0 ** (math.floor(math.log2(target.max)) - target.mantissa_bits - 1)  # a tie there rounds down
    return [v for v in (first, -first, target.max * 16, -target.max * 16) if abs(v) <= fmt.max]


@dataclass(frozen=True)
class _Spec:
    """What one element of a tensor may be: a normal value and/or a value of some edge classes."""

    dtype: torch.dtype
    normal: tuple[float, float] | None  # magnitude range of normal values, or None when excluded
    pools: tuple[tuple[str, tuple[float, ...]], ...]  # edge classes with their values
    cut: int  # an element whose selector k in [0, 1000) is below cut is a normal value, else an edge value
    # The strategies each element draws from, built once per tensor (building them per element is slow).
    selector: st.SearchStrategy[int] = field(init=False, repr=False, compare=False)
    magnitude: st.SearchStrategy[float] = field(init=False, repr=False, compare=False)
    edge: st.SearchStrategy[tuple[str, float]] = field(init=False, repr=False, compare=False)
    payload: st.SearchStrategy[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        width = {torch.float32: 32, torch.bfloat16: 32, torch.float64: 64}.get(self.dtype, 16)
        lo, hi = self.normal or (1.0, 1.0)
        pairs = [(kind, v) for kind, vs in self.pools for v in vs]
        object.__setattr__(self, "selector", st.integers(0, 999))
        object.__setattr__(self, "magnitude", st.floats(min_value=lo, max_value=hi, width=width))
        object.__setattr__(self, "edge", st.sampled_from(pairs) if pairs else st.nothing())
        object.__setattr__(self, "payload", st.sampled_from(_NAN_BITS.get(self.dtype, (0,))))


def _spec(
    dtype: torch.dtype,
    *,
    edges: Sequence[str] | None,
    exclude: Sequence[str],
    edge_fraction: float,
    scale: float | None,
    cast_to: torch.dtype | None,
    exponent_range: tuple[int, int],
) -> _Spec:
    if not 0.0 <= edge_fraction <= 1.0:
        raise ValueError(f"edge_fraction must be in [0, 1], got {edge_fraction}")
    fmt = format_of(dtype)
    excluded = {_canonical(k) for k in exclude}
    if edges is None:
        chosen = list(DEFAULT_EDGES)
        chosen += ["overflow_after_scale"] if scale is not None else []
        chosen += ["overflow_after_cast"] if cast_to is not None else []
    else:
        chosen = [_canonical(k) for k in edges]
    pools = []
    for kind in dict.fromkeys(chosen):
        if kind in excluded or kind == "normal":
            continue
        values = edge_values(dtype, kind, scale=scale, cast_to=cast_to)
        if values:
            pools.append((kind, tuple(values)))
    normal = None
    if "normal" not in excluded:
        lo_e, hi_e = exponent_range
        # clamped into the format: a range reaching below its normal range gives subnormals, one above it
        # gives +-max (a list of mixed dtypes can share one range)
        lo = min(max(2.0**lo_e, fmt.min_subnormal), fmt.max)
        hi = max(min(2.0**hi_e, fmt.max), lo)
        normal = (lo, hi)
    if normal is None and not pools:
        raise ValueError(f"nothing to draw for {fmt.name}: every class is excluded or empty for these arguments")
    cut = 1000 if not pools else 0 if normal is None else max(1, round((1 - edge_fraction) * 1000))
    return _Spec(dtype, normal, tuple(pools), cut)


_STOP = None


def _draw_value(draw: st.DrawFn, spec: _Spec, first: bool) -> tuple[float, int | None] | None:
    """One element: ``(value, NaN bit pattern or None)``, or ``None`` (``_STOP``) for "repeat the elements
    drawn so far". The selector shrinks towards 0: stop (so a shrunk tensor repeats one element), or for the
    first element a normal value; a normal value shrinks towards a simple one (``1.0``)."""
    k = draw(spec.selector)
    if k == 0 and not first:
        return _STOP
    if k < spec.cut:
        negative = draw(st.booleans())
        magnitude = draw(spec.magnitude)
        return (-magnitude if negative else magnitude), None
    kind, value = draw(spec.edge)
    pattern = draw(spec.payload) if kind == "nan" and spec.dtype in _NAN_BITS else None
    return value, pattern


def _background(spec: _Spec, n: int, seed: int) -> torch.Tensor:
    """``n`` float64 values from a seed: normal values log-uniform over the range, or edge values."""
    gen = torch.Generator().manual_seed(seed)
    if spec.normal is None:
        pool = torch.tensor([v for _, vs in spec.pools for v in vs if not math.isnan(v)] or [math.nan],
                            dtype=torch.float64)
        return pool[torch.randint(0, len(pool), (n,), generator=gen)]
    lo, hi = (math.log2(v) for v in spec.normal)
    mags = torch.pow(2.0, lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64))
    signs = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    return (mags * signs).clamp(-spec.normal[1], spec.normal[1])


def _layout(values: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values stored in another layout (``values`` is contiguous)."""
    nd = values.dim()
    if layout == "non_contiguous" and nd >= 1 and values.numel() > 1:
        buf = torch.full((*values.shape[:-1], 2 * values.shape[-1]), math.nan, dtype=torch.float64)
        out = buf.to(values.dtype)[..., ::2]
        out.copy_(values)
        return out
    if layout == "transposed" and nd >= 2:
        perm = tuple(range(nd - 1, -1, -1))
        return values.permute(perm).contiguous().permute(perm)
    if layout == "channels_last" and nd in (4, 5):
        fmt = torch.channels_last if nd == 4 else torch.channels_last_3d
        return values.contiguous(memory_format=fmt)
    return values


@st.composite
def shapes(
    draw: st.DrawFn,
    max_numel: int = 64,
    max_dims: int = 3,
    *,
    min_dims: int = 0,
    min_side: int = 0,
    max_side: int | None = None,
) -> tuple[int, ...]:
    """Shapes of rank ``min_dims..max_dims``, sides ``min_side..max_side``, at most ``max_numel`` elements.

    Distribution: a 0-d shape is weighted 2 in 19 when ``min_dims == 0`` (there is only one, and Hypothesis
    does not repeat an example, so a run of shapes alone sees it once or twice), an empty shape (a side of 0)
    1 in 19 when ``min_side == 0`` (about 7% of draws, measured); the rest have rank at least
    ``max(min_dims, 1)`` and sides at least ``max(min_side, 1)``, each side bounded so the product stays
    within ``max_numel``; half the shapes draw each side in a drawn binade (side lengths log-uniform), half
    uniformly up to that bound. Shapes shrink towards the lowest rank with the smallest sides (``(1,)`` by default).
    """
    max_side = max_numel if max_side is None else max_side
    if min_dims > max_dims or max_numel < 1 or max(min_side, 1) > max_side:
        raise ValueError(f"no shape fits min_dims={min_dims}, max_dims={max_dims}, min_side={min_side}, "
                         f"max_side={max_side}, max_numel={max_numel}")
    # weights by repetition; sampled_from shrinks towards the first entry, a regular shape
    kinds = ["regular"] * 16 + (["scalar"] * 2 if min_dims == 0 else [])
    kinds += ["empty"] if min_side == 0 and max_dims else []
    kind = draw(st.sampled_from(kinds))
    if kind == "scalar" or max_dims == 0:
        return ()
    rank = draw(st.integers(max(min_dims, 1), max_dims))
    side_lo = max(min_side, 1)
    if side_lo**rank > max_numel:
        raise ValueError(f"no shape of rank {rank} with sides >= {side_lo} has at most {max_numel} elements")
    sides: list[int] = []
    # half the shapes draw each side in a drawn binade (log-uniform: small sides common), half uniformly up to
    # what the element budget leaves (large tensors common); shrinking prefers the first
    uniform = draw(st.booleans())
    for i in range(rank):
        cap = max(side_lo, min(max_side, max_numel // (math.prod(sides) * side_lo ** (rank - i - 1))))
        if not uniform:
            cap = max(side_lo, min(cap, 2 ** (draw(st.integers(0, cap.bit_length() - 1)) + 1) - 1))
        sides.append(draw(st.integers(side_lo, cap)))
    if kind == "empty":
        sides[draw(st.integers(0, rank - 1))] = 0
    return tuple(sides)


@st.composite
def broadcastable_shapes(
    draw: st.DrawFn, max_numel: int = 64, max_dims: int = 3, *, min_dims: int = 0, min_side: int = 1,
    max_side: int | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A pair of shapes that broadcast together: one drawn by :func:`shapes`, the other with some leading
    dimensions dropped and some sides set to 1 (in either order)."""
    full = draw(shapes(max_numel, max_dims, min_dims=min_dims, min_side=min_side, max_side=max_side))
    drop = draw(st.integers(0, len(full)))
    other = tuple(1 if draw(st.booleans()) else s for s in full[drop:])
    return (other, full) if draw(st.booleans()) else (full, other)


def dtypes(*, fp8: bool = False, float64: bool = False) -> st.SearchStrategy[torch.dtype]:
    """fp16, bf16 and fp32 (shrinking towards fp16); with ``fp8`` the fp8 formats this torch has, with
    ``float64`` float64."""
    out = [torch.float16, torch.bfloat16, torch.float32]
    out += list(FP8_DTYPES) if fp8 else []
    out += [torch.float64] if float64 else []
    return st.sampled_from(out)


@st.composite
def float_tensors(
    draw: st.DrawFn,
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] = torch.float32,
    shape: Sequence[int] | st.SearchStrategy[tuple[int, ...]] | None = None,
    *,
    edge_fraction: float = 0.2,
    edges: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    scale: float | None = None,
    cast_to: torch.dtype | None = None,
    max_numel: int = 64,
    exponent_range: tuple[int, int] = (-12, 12),
    layouts: Sequence[str] = ("contiguous",),
    max_drawn: int = 64,
) -> torch.Tensor:
    """A tensor of ``dtype`` (a dtype or a strategy of dtypes) whose elements Hypothesis draws.

    Each element is a ``normal`` value (binary exponent in ``exponent_range``, clamped to the format) or,
    with probability about ``edge_fraction``, a value of one of the ``edges`` classes (default
    :data:`DEFAULT_EDGES`, plus ``overflow_after_scale`` given ``scale`` and ``overflow_after_cast`` given
    ``cast_to``) that is not in ``exclude`` (which may name ``normal`` to draw edge values only).
    ``shape`` is a tuple, a strategy of tuples (see :func:`shapes`) or ``None`` for ``shapes(max_numel)``.
    ``layouts`` lists the memory layouts to draw from (:data:`LAYOUTS`; a layout that does not apply to
    the rank, such as ``channels_last`` for a 2-d tensor, gives a contiguous tensor).
    """
    dtype = draw(dtype) if isinstance(dtype, st.SearchStrategy) else dtype
    if shape is None:
        shape = draw(shapes(max_numel))
    elif isinstance(shape, st.SearchStrategy):
        shape = draw(shape)
    shape = tuple(int(s) for s in shape)
    unknown = set(layouts) - set(LAYOUTS)
    if unknown or not layouts:
        raise ValueError(f"unknown layouts {sorted(unknown)}; choose from {LAYOUTS}")
    spec = _spec(dtype, edges=edges, exclude=exclude, edge_fraction=edge_fraction, scale=scale, cast_to=cast_to,
                 exponent_range=exponent_range)
    n = math.prod(shape)
    nan_at: list[tuple[int, int]] = []
    if n <= max_drawn:
        drawn: list[tuple[float, int | None]] = []
        for i in range(n):
            element = _draw_value(draw, spec, first=i == 0)
            if element is _STOP:
                break
            drawn.append(element)
        drawn = [drawn[i % len(drawn)] for i in range(n)] if drawn else []
        values = torch.tensor([v for v, _ in drawn], dtype=torch.float64)
        nan_at = [(i, p) for i, (_, p) in enumerate(drawn) if p is not None]
    else:
        values = _background(spec, n, draw(st.integers(0, 2**31 - 1)))
        if spec.pools and spec.cut < 1000:
            for _ in range(draw(st.integers(0, min(max_drawn, math.ceil(edge_fraction * n))))):
                pos = draw(st.integers(0, n - 1))
                kind, pool = draw(st.sampled_from(spec.pools))
                values[pos] = draw(st.sampled_from(pool))
                if kind == "nan" and dtype in _NAN_BITS:
                    nan_at.append((pos, draw(st.sampled_from(_NAN_BITS[dtype]))))
    out = _to_dtype(values, dtype)
    if nan_at:
        bits = out.view(format_of(dtype).int_dtype)
        for pos, pattern in nan_at:
            bits[pos] = pattern
    layout = draw(st.sampled_from(list(layouts)))
    return _layout(out.reshape(shape), layout)


def _to_dtype(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Round once, exactly (torch's float64 -> float16 conversion goes through float32: two roundings).
    from .reference.kernels import round_to_format

    return round_to_format(values, dtype).to(dtype)


@st.composite
def tensor_lists(
    draw: st.DrawFn,
    dtypes: Sequence[torch.dtype] = (torch.float16, torch.bfloat16, torch.float32),
    *,
    min_size: int = 1,
    max_size: int = 4,
    max_numel: int = 64,
    edge_fraction: float = 0.2,
    edges: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    scale: float | None = None,
    cast_to: torch.dtype | None = None,
    exponent_range: tuple[int, int] = (-12, 12),
    layouts: Sequence[str] = ("contiguous",),
    max_drawn: int = 64,
) -> list[torch.Tensor]:
    """A list of tensors (see :func:`float_tensors`), each of a dtype drawn from ``dtypes`` (mixed lists included)."""
    size = draw(st.integers(min_size, max_size))
    return [
        draw(
            float_tensors(
                draw(st.sampled_from(list(dtypes))),
                edge_fraction=edge_fraction,
                edges=edges,
                exclude=exclude,
                scale=scale,
                cast_to=cast_to,
                max_numel=max_numel,
                exponent_range=exponent_range,
                layouts=layouts,
                max_drawn=max_drawn,
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
    """The classes present in ``t`` (``normal`` and the edge classes; for checks or ``hypothesis.event``)."""
    fmt = format_of(t.dtype)
    x = t.to(torch.float64).reshape(-1)
    found = set()
    finite = torch.isfinite(x)
    mag = x.abs()
    if bool((finite & (mag > fmt.min_normal) & (mag < fmt.max)).any()):
        found.add("normal")
    if bool((x == 0).any()):
        found.add("zeros")
    if bool(((x != 0) & (mag < fmt.min_normal)).any()):
        found.add("subnormals")
    if bool((mag == fmt.min_normal).any()):
        found.add("min_normal")
    if bool((mag == fmt.max).any()):
        found.add("max_finite")
    if bool(torch.isinf(x).any()):
        found.add("inf")
    if bool(torch.isnan(x).any()):
        found.add("nan")
    target = format_of(cast_to or t.dtype)
    if scale is not None and scale > 1 and bool((finite & (mag * scale > target.max)).any()):
        found.add("overflow_after_scale")
    if cast_to is not None:
        from .formats import ulp

        # past the rounding midpoint above the largest finite value of cast_to (inf, or saturated for e4m3fn)
        limit = target.max + float(ulp(target.max, cast_to)) / 2
        if bool((finite & ((mag > limit) | ((mag == limit) & target.has_inf))).any()):
            found.add("overflow_after_cast")
    return found
