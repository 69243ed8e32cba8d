"""Format facts and ulp arithmetic, checked against torch.finfo and numpy's nextafter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.numerics import FORMATS, format_of, gamma, ulp, ulp_distance, unit_roundoff


def test_fp16_facts():
    f = format_of(torch.float16)
    assert (f.max, f.min_normal, f.min_subnormal, f.eps) == (65504.0, 2.0**-14, 2.0**-24, 2.0**-10)
    assert (f.bits, f.mantissa_bits, f.exponent_bits) == (16, 10, 5)


def test_bf16_and_fp32_facts():
    b = format_of(torch.bfloat16)
    assert (b.min_normal, b.min_subnormal, b.eps, b.mantissa_bits) == (2.0**-126, 2.0**-133, 2.0**-7, 7)
    assert b.max == (2 - 2.0**-7) * 2.0**127
    f = format_of(torch.float32)
    assert (f.min_subnormal, f.eps, f.max) == (2.0**-149, 2.0**-23, float(np.finfo(np.float32).max))


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no fp8 dtypes")
def test_fp8_facts():
    e4 = format_of(torch.float8_e4m3fn)
    assert (e4.max, e4.min_normal, e4.min_subnormal, e4.eps, e4.has_inf) == (448.0, 2.0**-6, 2.0**-9, 2.0**-3, False)
    e5 = format_of(torch.float8_e5m2)
    assert (e5.max, e5.min_normal, e5.min_subnormal, e5.eps, e5.has_inf) == (57344.0, 2.0**-14, 2.0**-16, 0.25, True)
    assert e4.int_dtype == torch.int8 and float(ulp(1.0, torch.float8_e4m3fn)) == 0.125
    one = torch.tensor([1.0, 448.0]).to(torch.float8_e4m3fn)
    assert ulp_distance(one, torch.tensor([1.125, 416.0]).to(torch.float8_e4m3fn)).tolist() == [1, 1]


def test_unknown_dtype():
    with pytest.raises(TypeError, match="no floating-point format facts"):
        format_of(torch.int32)


@pytest.mark.parametrize("np_dtype,dtype", [(np.float16, torch.float16), (np.float32, torch.float32)])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_ulp_is_gap_to_next_value(np_dtype, dtype, data):
    fmt = FORMATS[dtype]
    x = np_dtype(data.draw(st.floats(0, fmt.max, width=16 if dtype == torch.float16 else 32, exclude_max=True)))
    gap = float(np.nextafter(x, np_dtype(np.inf))) - float(x)
    assert float(ulp(float(x), dtype)) == gap


def test_ulp_special_values():
    assert float(ulp(0.0, torch.float16)) == 2.0**-24
    assert float(ulp(1.0, torch.bfloat16)) == 2.0**-7
    assert math.isnan(float(ulp(math.inf, torch.float32)))


def test_ulp_distance_counts_representable_steps():
    h = torch.float16
    assert int(ulp_distance(torch.tensor(1.0, dtype=h), torch.tensor(1.0 + 2**-10, dtype=h))) == 1
    assert int(ulp_distance(torch.tensor(-0.0, dtype=h), torch.tensor(0.0, dtype=h))) == 0
    # across zero: -tiny .. +tiny is 2 steps
    tiny = 2.0**-24
    assert int(ulp_distance(torch.tensor(-tiny, dtype=h), torch.tensor(tiny, dtype=h))) == 2
    assert int(ulp_distance(torch.tensor(65504.0, dtype=h), torch.tensor(math.inf, dtype=h))) == 1
    assert int(ulp_distance(torch.tensor(math.nan, dtype=h), torch.tensor(0.0, dtype=h))) == -1
    with pytest.raises(TypeError, match="one dtype"):
        ulp_distance(torch.ones(1), torch.ones(1, dtype=h))


def test_gamma():
    u = unit_roundoff(torch.float32)
    assert u == 2.0**-24
    assert gamma(1, torch.float32) == pytest.approx(u / (1 - u))
    with pytest.raises(ValueError, match="unbounded"):
        gamma(2**11, torch.float16)
