"""The strategies produce every class, shape and layout they promise, and their failures shrink to the
element that matters."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from fp16kit.numerics import FP8_DTYPES, format_of, reference
from fp16kit.numerics import strategies as fst

DTYPES = [torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES]
# `find` for existence: stop at the first example (no shrinking); SHRINK where the shrunk example is the point
FIND = settings(max_examples=500, database=None, deadline=None, phases=[Phase.generate])
SHRINK = settings(max_examples=500, database=None, deadline=None, derandomize=True)  # a fixed path: fixed time


def kwargs_for(kind: str, dtype: torch.dtype) -> dict | None:
    if kind == "overflow_after_scale":
        return {"scale": 1024.0}
    if kind == "overflow_after_cast":
        return {"cast_to": torch.float16} if format_of(dtype).max > 65504 else None
    if kind == "inf" and not format_of(dtype).has_inf:
        return None
    return {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", fst.EDGE_CLASSES)
def test_each_edge_class_is_produced(dtype, kind):
    kw = kwargs_for(kind, dtype)
    if kw is None:
        pytest.skip(f"{dtype} has no {kind} values")
    example = find(
        fst.float_tensors(dtype, edges=(kind,), exclude=("normal",), **kw),
        lambda t: t.numel() > 0 and kind in fst.classify(t, **kw),
        settings=FIND,
    )
    assert kind in fst.classify(example, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_are_representable_and_excluded_classes_absent(dtype):
    @settings(max_examples=25, deadline=None, database=None)
    @given(t=fst.float_tensors(dtype, exclude=("nan", "inf", "zeros")))
    def check(t):
        assert t.dtype == dtype
        x = t.double()
        assert bool(torch.isfinite(x).all()) and not bool((x == 0).any())
        assert torch.equal(reference.round_to_format(x, dtype), x)

    check()


def test_nan_payloads_vary():
    patterns = set()
    for want in (0x7E01, 0x7C01, -0x0200):
        t = find(
            fst.float_tensors(torch.float16, shape=(1,), edges=("nan",), exclude=("normal",)),
            lambda t, want=want: int(t.view(torch.int16)[0]) == want,
            settings=FIND,
        )
        patterns.add(int(t.view(torch.int16)[0]))
    assert len(patterns) == 3


def test_old_class_names_are_still_accepted():
    t = find(
        fst.float_tensors(torch.float16, edges=("neg_zero", "overflow_after_scaling"), exclude=("normal",), scale=4.0),
        lambda t: t.numel() > 1 and {"zeros", "overflow_after_scale"} <= fst.classify(t, scale=4.0),
        settings=SHRINK,
    )
    assert t.numel() == 2
    with pytest.raises(ValueError, match="unknown edge class"):
        fst.edge_values(torch.float16, "denormal")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown layouts"):
        find(fst.float_tensors(layouts=("strided",)), lambda t: True)
    # a range above fp16's is clamped to its largest value (lists of mixed dtypes share one range)
    t = find(fst.float_tensors(torch.float16, exponent_range=(20, 30), edge_fraction=0.0), lambda t: t.numel() > 0)
    assert bool((t.abs() == 65504).all())
    with pytest.raises(ValueError, match="nothing to draw"):
        find(fst.float_tensors(torch.float16, edges=(), exclude=("normal",)), lambda t: True)


# --- shrinking ----------------------------------------------------------------------------------------

def test_a_failure_on_one_value_shrinks_to_that_one_element():
    # property "no element is >= 200": the minimal failing tensor is [200.]
    t = find(fst.float_tensors(torch.float16), lambda t: bool((t.double() >= 200).any()), settings=SHRINK)
    assert t.shape == (1,) and float(t) == 200.0


def test_a_failure_on_an_edge_value_shrinks_to_that_edge_value():
    # an rms-norm-like sum of squares in fp32 overflows only for bf16 values near the top of the range
    def overflows(t: torch.Tensor) -> bool:
        return t.numel() > 0 and bool(torch.isinf(t.float().square().sum()))

    t = find(fst.float_tensors(torch.bfloat16, shape=fst.shapes(16, min_dims=2)), overflows, settings=SHRINK)
    # one element, bf16's largest value; the rank the shrinker stops at (2 or 3 of the allowed dims) depends on the
    # path it took, which differs between processes (pytest-xdist workers), so only the element count is pinned
    assert t.dim() >= 2 and t.numel() == 1 and float(t) == format_of(torch.bfloat16).max


def test_a_naive_softmax_nan_shrinks_to_twelve():
    def naive_softmax_has_nan(t: torch.Tensor) -> bool:
        e = t.exp()  # fp16 exp overflows above ~11.09; inf / inf is NaN
        return bool(torch.isnan(e / e.sum(-1, keepdim=True)).any())

    t = find(fst.float_tensors(torch.float16, exclude=("nan", "inf")), naive_softmax_has_nan, settings=SHRINK)
    assert t.shape == (1,) and float(t) == 12.0


# --- shapes and layouts -------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(s=fst.shapes(100, 4, min_dims=2, min_side=2, max_side=5))
def test_shape_bounds(s):
    assert 2 <= len(s) <= 4 and all(2 <= side <= 5 for side in s) and math.prod(s) <= 100


def test_default_shapes_are_not_dominated_by_0d_and_empty():
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=300, deadline=None, database=None)
    @given(s=fst.shapes())
    def count(s):
        seen["0-d" if s == () else "empty" if math.prod(s) == 0 else "other"] += 1

    count()
    total = sum(seen.values())
    assert seen["0-d"] <= 3 and seen["empty"] / total < 0.15 and seen["other"] / total > 0.8, seen


@settings(max_examples=60, deadline=None)
@given(pair=fst.broadcastable_shapes())
def test_broadcastable_shapes_broadcast(pair):
    a, b = pair
    out = torch.broadcast_shapes(a, b)
    assert out in (a, b)


@pytest.mark.parametrize("layout", ["non_contiguous", "transposed", "channels_last"])
def test_layouts_store_the_same_values_differently(layout):
    shape = (2, 3, 4, 5) if layout == "channels_last" else (3, 4)
    t = find(
        fst.float_tensors(torch.bfloat16, shape=shape, layouts=(layout,)),
        lambda t: True,
        settings=FIND,
    )
    assert not t.is_contiguous()
    if layout == "channels_last":
        assert t.is_contiguous(memory_format=torch.channels_last)
    if layout == "non_contiguous":  # the gaps between elements hold NaN, so a kernel that reads them shows it
        assert t.stride()[-1] == 2
        gaps = t.untyped_storage()
        whole = torch.empty(0, dtype=t.dtype).set_(gaps).reshape(3, 8)
        assert bool(torch.isnan(whole[:, 1::2]).all())


@settings(max_examples=30, deadline=None)
@given(t=fst.float_tensors(fst.dtypes(fp8=True), shape=fst.shapes(min_dims=4, max_dims=4, max_numel=48),
                           layouts=fst.LAYOUTS))
def test_any_layout_and_fp8_values_are_representable(t):
    assert t.dim() == 4 and t.dtype in (torch.float16, torch.bfloat16, torch.float32, *FP8_DTYPES)
    x = t.double()
    same = reference.round_to_format(x, t.dtype) == x
    assert bool((same | torch.isnan(x)).all())


def test_large_tensors_get_a_seeded_background_and_drawn_edges():
    t = find(
        fst.float_tensors(torch.float16, shape=(40, 50), edges=("inf",)),
        lambda t: bool(torch.isinf(t).any()),
        settings=SHRINK,
    )
    assert t.shape == (40, 50) and int(torch.isinf(t).sum()) == 1


# --- the older strategies still work ----------------------------------------------------------------------

@settings(max_examples=20, deadline=None)
@given(ts=fst.tensor_lists(dtypes=(torch.bfloat16,), min_size=2, max_size=3, edge_fraction=0.0))
def test_tensor_lists_respects_dtypes_and_sizes(ts):
    assert 2 <= len(ts) <= 3 and all(t.dtype == torch.bfloat16 for t in ts)
    assert all(bool(torch.isfinite(t).all()) for t in ts)


@settings(max_examples=30, deadline=None)
@given(s=fst.scales(powers_of_two_only=True))
def test_power_of_two_scales(s):
    assert math.log2(s) == int(math.log2(s))


def test_unscale_cases_reach_overflow_classes():
    def overflows_after_scaling(case):
        tensors, inv_scale, outs = case
        return any(
            "overflow_after_scale" in fst.classify(t, scale=inv_scale, cast_to=None if outs is None else outs[i])
            for i, t in enumerate(tensors)
        )

    find(fst.unscale_cases(), overflows_after_scaling,
         settings=settings(max_examples=2000, database=None, phases=[Phase.generate]))


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_shape_strategy_for_row_wise_ops(data):
    # rows of a drawn width, without flatmap: pass a shape strategy
    x = data.draw(fst.float_tensors(torch.float16, shape=fst.shapes(min_dims=2, max_dims=2, min_side=1)))
    assert x.dim() == 2 and x.numel() > 0
