"""The references themselves: exact rounding (checked against numpy and torch) and hand-worked cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.numerics import FP8_DTYPES, reference


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=False, width=64))
def test_round_to_fp16_matches_numpy(x):
    got = float(reference.round_to_format(torch.tensor([x], dtype=torch.float64), torch.float16))
    want = float(np.float64(x).astype(np.float16))  # numpy rounds float64 -> float16 once, correctly
    assert got == want or (math.isinf(got) and math.isinf(want) and got == want)


@settings(max_examples=300, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_round_fp32_to_bf16_matches_torch(x):
    # fp32 -> bf16 is a single rounding in torch; float64 holds every fp32 exactly
    got = reference.round_to_format(torch.tensor([x], dtype=torch.float64), torch.bfloat16).to(torch.bfloat16)
    want = torch.tensor([x], dtype=torch.float32).bfloat16()
    assert got.view(torch.int16).item() == want.view(torch.int16).item() or (got.isinf() & want.isinf()).all()


def test_hand_worked_cases():
    r = reference.round_to_format
    h = torch.float16
    assert float(r(torch.tensor(65519.0, dtype=torch.float64), h)) == 65504.0
    assert math.isinf(float(r(torch.tensor(65520.0, dtype=torch.float64), h)))  # tie at the top goes to inf
    assert float(r(torch.tensor(2.0**-25, dtype=torch.float64), h)) == 0.0  # tie to even zero
    assert float(r(torch.tensor(3 * 2.0**-25, dtype=torch.float64), h)) == 2.0**-23
    assert str(float(r(torch.tensor(-0.0, dtype=torch.float64), h))) == "-0.0"


def test_unscale_reference_double_rounding_is_the_contract():
    # fp32 product first, then fp16: y = fp32(x * s) rounds, then the fp16 cast rounds again.
    x = torch.tensor([1.0 + 2**-11 + 2**-24], dtype=torch.float32)
    res = reference.unscale_and_check([x], 1.0 - 2**-24, [torch.float16])
    assert not res.found_inf and res.outputs[0].dtype == torch.float16
    res = reference.unscale_and_check([torch.tensor([30000.0], dtype=torch.float16)], 4.0)
    assert res.found_inf


def test_l2norm_and_copy_reference():
    total, per, found = reference.l2norm([torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.float16)])
    assert (total, per, found) == (5.0, [3.0, 4.0], False)
    assert reference.copy([torch.tensor([1.0 + 2**-8])], [torch.bfloat16])[0].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_is_idempotent_on_representable_values(dtype):
    x = torch.randn(1000).to(dtype)
    assert torch.equal(reference.round_to_format(x.double(), dtype).to(dtype), x)


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_round_to_fp8_matches_torchs_cast(dtype):
    # torch casts fp32 to fp8 in one rounding (saturating for e4m3fn); float64 holds every fp32 exactly
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.pow(2.0, torch.randint(-24, 20, (20000,), generator=g).float())
    edges = [448.0, 464.0, 465.0, 480.0, 57344.0, 61439.0, 61440.0, 1e9, math.inf, -math.inf, -0.0, 2.0**-10,
             3 * 2.0**-11, 2.0**-17, -(2.0**-16)]
    x = torch.cat([x, torch.tensor(edges)])
    got = reference.round_to_format(x.double(), dtype).to(dtype)
    torchs = x.to(dtype)
    if dtype == torch.float8_e4m3fn:
        # beyond e4m3fn's range (inf included) torch 2.13 saturates to +-448 as the reference does; torch 2.11
        # casts those values to NaN: there the reference's saturated value is checked on its own
        beyond = ~x.isnan() & torchs.float().isnan()
        assert bool((got[beyond].float().abs() == 448).all())
        got, torchs = got[~beyond], torchs[~beyond]
    assert torch.equal(got.view(torch.int8), torchs.view(torch.int8))
