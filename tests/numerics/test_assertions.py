"""The assertions fail when they should, pass when they should, and say where and by how much."""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.numerics import assert_bitwise_equal, assert_nonfinite_agree, assert_ulp_close


def test_ulp_close_bounds():
    one = torch.tensor([1.0, 2.0], dtype=torch.float16)
    next_up = torch.tensor([1.0 + 2**-10, 2.0], dtype=torch.float16)
    assert_ulp_close(next_up, one.double(), 1)
    with pytest.raises(AssertionError, match=r"1 of 2 element\(s\) exceed 0.5 ulp \(float16\).*element 0 is 1 ulp off"):
        assert_ulp_close(next_up, one.double(), 0.5)


def test_ulp_close_nonfinite_must_agree():
    with pytest.raises(AssertionError, match="disagree on NaN"):
        assert_ulp_close(torch.tensor([math.nan]), torch.tensor([1.0], dtype=torch.float64), 100)
    assert_ulp_close(torch.tensor([math.inf, math.nan]), torch.tensor([math.inf, math.nan], dtype=torch.float64), 0)
    with pytest.raises(AssertionError, match=r"disagree on \+inf"):
        assert_nonfinite_agree(torch.tensor([math.inf]), torch.tensor([65504.0]))


def test_bitwise_equal():
    a = torch.tensor([0.0, math.nan, 1.0])
    assert_bitwise_equal(a, a.clone())
    nan_payload = a.clone()
    nan_payload.view(torch.int32)[1] = 0x7FC00001  # NaN payloads are not compared
    assert_bitwise_equal(a, nan_payload)
    with pytest.raises(AssertionError, match=r"differ bitwise; first at \[\(0,\)\]"):
        assert_bitwise_equal(torch.tensor([-0.0, math.nan, 1.0]), a)
    with pytest.raises(AssertionError, match="dtypes differ"):
        assert_bitwise_equal(a, a.half())
