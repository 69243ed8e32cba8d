"""The strategies really produce every edge class they promise (and respect their parameters)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import find, given, settings

from fp16kit.numerics import strategies as fst

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def kwargs_for(kind: str, dtype: torch.dtype) -> dict | None:
    if kind == "overflow_after_scaling":
        return {"scale": 1024.0}
    if kind == "overflow_after_cast":
        return {"cast_to": torch.float16} if dtype != torch.float16 else None
    return {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", fst.EDGE_CLASSES)
def test_each_edge_class_is_produced(dtype, kind):
    kw = kwargs_for(kind, dtype)
    if kw is None:
        pytest.skip("nothing of fp16 overflows when cast to fp16")
    example = find(
        fst.float_tensors(dtype, edges=(kind,), edge_fraction=1.0, **kw),
        lambda t: kind in fst.classify(t, **kw),
        settings=settings(max_examples=500, database=None),
    )
    assert kind in fst.classify(example, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_nan_payloads_vary(dtype):
    payloads = set()
    for seed_tensor in [
        find(
            fst.float_tensors(dtype, edges=("nan",), edge_fraction=1.0),
            lambda t, want=want: bool(torch.isnan(t).any())
            and int(t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])[0]) == want,
            settings=settings(max_examples=2000, database=None),
        )
        for want in ([0x7E01, 0x7C01] if dtype == torch.float16 else [0x7FC00001, 0x7F800001])
    ]:
        payloads.add(int(seed_tensor.reshape(-1).view(torch.int16 if dtype == torch.float16 else torch.int32)[0]))
    assert len(payloads) == 2


@settings(max_examples=50, deadline=None)
@given(t=fst.float_tensors(torch.float32, edge_fraction=0.0, max_numel=32))
def test_no_edges_when_fraction_is_zero(t):
    assert t.numel() <= 32
    assert bool(torch.isfinite(t).all())


@settings(max_examples=30, deadline=None)
@given(ts=fst.tensor_lists(dtypes=(torch.bfloat16,), min_size=2, max_size=3))
def test_tensor_lists_respects_dtypes_and_sizes(ts):
    assert 2 <= len(ts) <= 3 and all(t.dtype == torch.bfloat16 for t in ts)


@settings(max_examples=50, deadline=None)
@given(s=fst.scales(powers_of_two_only=True))
def test_power_of_two_scales(s):
    assert math.log2(s) == int(math.log2(s))


def test_unscale_cases_reach_overflow_classes():
    def overflows_after_scaling(case):
        tensors, inv_scale, outs = case
        return any(
            "overflow_after_scaling" in fst.classify(t, scale=inv_scale, cast_to=None if outs is None else outs[i])
            for i, t in enumerate(tensors)
        )

    find(fst.unscale_cases(), overflows_after_scaling, settings=settings(max_examples=2000, database=None))


def test_unknown_edge_class():
    with pytest.raises(ValueError, match="unknown edge class"):
        fst.edge_values(torch.float16, "denormal")
