"""The assertions fail when they must (every mismatch kind, every budget kind), pass when they should, and
say where and by how much."""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.numerics import (
    assert_bitwise_equal,
    assert_close_within,
    assert_gamma_close,
    assert_nonfinite_agree,
    assert_rel_close,
    assert_ulp_close,
    gamma,
)

H = torch.float16
EPS16 = 2.0**-10  # ulp(1.0) in fp16

ALL = [
    pytest.param(lambda a, e, **kw: assert_ulp_close(a, e, 1, **kw), id="ulp"),
    pytest.param(lambda a, e, **kw: assert_rel_close(a, e, 1e-3, **kw), id="rel"),
    pytest.param(lambda a, e, **kw: assert_gamma_close(a, e, 8, **kw), id="gamma"),
    pytest.param(lambda a, e, **kw: assert_close_within(a, e, ulp=1, **kw), id="within"),
    pytest.param(lambda a, e, **kw: assert_nonfinite_agree(a, e, **kw), id="nonfinite"),
]


# --- the mismatches every assertion refuses ---------------------------------------------------------------

@pytest.mark.parametrize("check", ALL)
def test_shape_mismatch_fails_both_ways(check):
    wide, narrow = torch.zeros(4, 16, dtype=H), torch.zeros(4, 1, dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"shapes differ: actual \(4, 16\), expected \(4, 1\).*broadcast=True"):
        check(wide, narrow)
    with pytest.raises(AssertionError, match=r"shapes differ: actual \(4, 1\), expected \(4, 16\)"):
        check(narrow.half(), wide.double())
    with pytest.raises(AssertionError, match=r"shapes differ: actual \(1,\), expected \(\)"):
        check(torch.zeros(1, dtype=H), torch.tensor(0.0, dtype=torch.float64))


def test_bitwise_shape_mismatch_fails():
    with pytest.raises(AssertionError, match=r"shapes differ: actual \(4, 16\), expected \(4, 1\)"):
        assert_bitwise_equal(torch.zeros(4, 16), torch.zeros(4, 1))


@pytest.mark.parametrize("check", ALL)
def test_broadcast_is_explicit(check):
    actual = torch.ones(4, 16, dtype=H)
    check(actual, torch.ones(4, 1, dtype=torch.float64), broadcast=True)
    with pytest.raises(AssertionError, match=r"shapes \(4, 16\) and \(3, 1\) do not broadcast"):
        check(actual, torch.ones(3, 1, dtype=torch.float64), broadcast=True)
    assert_bitwise_equal(actual, torch.ones(16, dtype=H), broadcast=True)


@pytest.mark.parametrize("check", ALL)
def test_dtype_mismatch_fails(check):
    pattern = (
        r"dtypes differ: actual torch.float16, expected torch.float32.*float64 reference"
    )
    with pytest.raises(AssertionError, match=pattern):
        check(torch.ones(3, dtype=H), torch.ones(3))
    check(torch.ones(3, dtype=H), torch.ones(3), check_dtype=False)
    check(torch.ones(3, dtype=H), torch.ones(3, dtype=H))  # same dtype is fine
    with pytest.raises(TypeError, match="compare floating tensors"):
        check(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.float64))


def test_bitwise_dtype_mismatch_fails():
    with pytest.raises(AssertionError, match=r"dtypes differ: actual torch.float32, expected torch.float16"):
        assert_bitwise_equal(torch.ones(3), torch.ones(3, dtype=H))
    with pytest.raises(AssertionError, match="dtypes differ"):  # no float64 exception for bits
        assert_bitwise_equal(torch.ones(3), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize(
    "check", [*ALL, pytest.param(lambda a, e, **kw: assert_bitwise_equal(a, e, **kw), id="bitwise")]
)
def test_device_mismatch_fails(check):
    # The meta device stands in for an accelerator: no data, but a different device.
    actual = torch.ones(3, dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"devices differ: actual on cpu, expected on meta"):
        check(actual, torch.ones(3, dtype=torch.float64, device="meta"))


@pytest.mark.parametrize("check", ALL)
def test_nan_position_fails_with_nd_index(check):
    actual = torch.ones(2, 3, dtype=H)
    actual[1, 2] = math.nan
    pattern = (
        r"x: 1 of 6 element\(s\) disagree on NaN; first at \[\(1, 2\)\]:\n  \(1, 2\): actual "
        r"nan, expected 1.0"
    )
    with pytest.raises(AssertionError, match=pattern):
        check(actual, torch.ones(2, 3, dtype=torch.float64), what="x")
    # NaN in both: agreement, whatever the budget
    check(actual, actual.double())


@pytest.mark.parametrize("check", ALL)
def test_inf_sign_fails(check):
    actual = torch.tensor([[1.0, math.inf]], dtype=H)
    pattern = (
        r"disagree on the sign of inf; first at \[\(0, 1\)\]:\n  \(0, 1\): actual inf, expected "
        r"-inf"
    )
    with pytest.raises(AssertionError, match=pattern):
        check(actual, torch.tensor([[1.0, -math.inf]], dtype=torch.float64))
    with pytest.raises(AssertionError, match=r"(?s)disagree on \+inf.*actual inf, expected 65504.0"):
        check(actual, torch.tensor([[1.0, 65504.0]], dtype=torch.float64))


def test_bitwise_nan_and_inf_fail():
    with pytest.raises(AssertionError, match=r"disagree on NaN; first at \[\(1,\)\]"):
        assert_bitwise_equal(torch.tensor([0.0, math.nan]), torch.tensor([0.0, 1.0]))
    with pytest.raises(AssertionError, match=r"disagree on the sign of inf"):
        assert_bitwise_equal(torch.tensor([-math.inf]), torch.tensor([math.inf]))
    with pytest.raises(AssertionError, match=r"disagree on -inf"):
        assert_bitwise_equal(torch.tensor([-math.inf]), torch.tensor([-3.0e38]))


# --- budgets: each kind passes at its bound and fails past it -------------------------------------------

def test_ulp_budget():
    one = torch.tensor([[1.0, 2.0]], dtype=H)
    next_up = torch.tensor([[1.0 + EPS16, 2.0]], dtype=H)
    assert_ulp_close(next_up, one.double(), 1)
    with pytest.raises(AssertionError) as info:
        assert_ulp_close(next_up, one.double(), 0.5, what="y")
    msg = str(info.value)
    assert msg.startswith("y: 1 of 2 element(s) exceed the budget of 0.5 ulp (float16)\n")
    assert "worst at (0, 0): actual 1.0009765625, expected 1.0, abs err 0.000977, 1 ulp, rel err 0.000977, " \
           "2x the budget" in msg
    assert "first offenders:\n  (0, 0): actual 1.0009765625" in msg
    # the ulp of another format, via dtype=: 1 fp16 ulp is 2^13 fp32 ulps
    assert_ulp_close(next_up.float(), one.double(), 2.0**13, dtype=torch.float32)
    with pytest.raises(AssertionError, match=r"(?s)exceed the budget of 4096 ulp \(float32\).*8\.19e\+03 ulp"):
        assert_ulp_close(next_up.float(), one.double(), 2.0**12, dtype=torch.float32)


def test_exact_equality_when_the_budget_is_zero():
    a = torch.tensor([1.0, 2.0])
    assert_ulp_close(a, a.double(), 0)
    pattern = (
        r"exceed the budget of 0 \(exact equality\)\nworst at \(1,\): actual 2.000000238418579, "
        r"expected 2.0, abs err 2.38e-07, 1 ulp, rel err 1.19e-07\n"
    )
    with pytest.raises(AssertionError, match=pattern):
        assert_ulp_close(a + torch.tensor([0.0, 2.0**-22]), a.double(), 0)


def test_rel_budget():
    e = torch.tensor([100.0, -1.0], dtype=torch.float64)
    a = torch.tensor([100.0 * (1 + 1e-3), -1.0])
    assert_rel_close(a, e, 1.001e-3)
    pattern = (
        r"1 of 2 element\(s\) exceed the budget of 0\.0005 \* \|expected\|\nworst at \(0,\).*rel "
        r"err 0\.001"
    )
    with pytest.raises(AssertionError, match=pattern):
        assert_rel_close(a, e, 5e-4)
    # relative budgets are blind at zero: the absolute floor covers it
    with pytest.raises(AssertionError, match=r"rel err inf"):
        assert_rel_close(torch.tensor([1e-9]), torch.tensor([0.0], dtype=torch.float64), 1e-3)
    assert_rel_close(torch.tensor([1e-9]), torch.tensor([0.0], dtype=torch.float64), 1e-3, atol=1e-8)
    with pytest.raises(AssertionError, match=r"0\.001 \* \|expected\| \+ 1e-10 absolute"):
        assert_rel_close(torch.tensor([1e-9]), torch.tensor([0.0], dtype=torch.float64), 1e-3, atol=1e-10)


def test_gamma_budget_holds_for_an_fp32_sum_and_catches_an_fp16_one():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 512, generator=g)  # non-negative terms: magnitude = |sum|
    exact = x.double().sum(dim=1)
    assert_gamma_close(x.sum(dim=1), exact, 511)  # any summation order is within gamma(n-1)
    # accumulated in fp16 the error is ~2^10 times larger: gamma(511, float32) cannot cover it
    with pytest.raises(AssertionError, match=r"exceed the budget of gamma\(511, float32\) = 3\.05e-05 \* \|expected\|"):
        assert_gamma_close(x.half().sum(dim=1, dtype=torch.float16).float(), exact, 511)
    # ... but gamma(511, float16) does, plus the final rounding to fp16
    assert_gamma_close(x.half().sum(dim=1, dtype=torch.float16), x.half().double().sum(dim=1), 511,
                       accum_dtype=H, ulp=0.5)


def test_gamma_budget_with_mixed_signs_needs_the_magnitude():
    x = torch.tensor([[1.0, -1.0 + 2.0**-23, 2.0**-24]])  # cancellation: |sum| << sum |x|
    exact = x.double().sum(dim=1)
    got = x.sum(dim=1)
    with pytest.raises(AssertionError, match=r"\* \|expected\|"):
        assert_gamma_close(got + 2.0**-30, exact, 2)  # relative to the tiny |sum|, the rounding is huge
    assert_gamma_close(got + 2.0**-30, exact, 2, magnitude=x.double().abs().sum(dim=1))
    with pytest.raises(AssertionError, match=r"gamma\(2, float32\) = 1\.19e-07 \* magnitude"):
        assert_gamma_close(got + 2.0**-20, exact, 2, magnitude=x.double().abs().sum(dim=1))
    assert gamma(2, torch.float32) == pytest.approx(2 * 2.0**-24 / (1 - 2 * 2.0**-24))


def test_budget_terms_add_up():
    e = torch.tensor([1.0], dtype=torch.float64)
    a = torch.tensor([1.0 + 3 * EPS16], dtype=H)  # 3 ulp = 1 ulp + 2 ulp worth of rel
    assert_close_within(a, e, ulp=1, rel=2 * EPS16)
    with pytest.raises(AssertionError, match=r"1 ulp \(float16\) \+ 0\.00186 \* \|expected\|"):
        assert_close_within(a, e, ulp=1, rel=1.9 * EPS16)


def test_bad_budgets_are_refused():
    a = torch.ones(1)
    with pytest.raises(ValueError, match="ulp must be a finite number >= 0"):
        assert_ulp_close(a, a.double(), -1)
    with pytest.raises(ValueError, match="rel must be"):
        assert_rel_close(a, a.double(), math.nan)
    with pytest.raises(ValueError, match="gamma_n must be the number of terms"):
        assert_gamma_close(a, a.double(), -3)


# --- reports --------------------------------------------------------------------------------------------

def test_report_names_the_worst_by_nd_index_and_lists_offenders_in_order():
    e = torch.ones(3, 4, 5, dtype=torch.float64)
    a = e.clone()
    a[0, 1, 2] += 4 * EPS16
    a[2, 3, 4] += 9 * EPS16  # the worst
    a[1, 0, 0] += 2 * EPS16
    with pytest.raises(AssertionError) as info:
        assert_ulp_close(a.half(), e, 1)
    msg = str(info.value)
    assert "3 of 60 element(s)" in msg
    assert "worst at (2, 3, 4): actual 1.0087890625, expected 1.0, abs err 0.00879, 9 ulp" in msg
    lines = msg.splitlines()
    first = lines.index("first offenders:")
    assert [ln.split(":")[0].strip() for ln in lines[first + 1:]] == ["(0, 1, 2)", "(1, 0, 0)", "(2, 3, 4)"]


def test_report_lists_at_most_five():
    a = torch.ones(100, dtype=H) * 2
    with pytest.raises(AssertionError) as info:
        assert_ulp_close(a, torch.ones(100, dtype=torch.float64), 1)
    assert "100 of 100 element(s)" in str(info.value)
    assert str(info.value).count("\n  (") == 5


def test_zero_dim_and_empty():
    assert_ulp_close(torch.tensor(1.0, dtype=H), 1.0, 0)  # a Python number is a float64 reference
    with pytest.raises(AssertionError, match=r"worst at \(\): actual 2.0, expected 1.0"):
        assert_ulp_close(torch.tensor(2.0, dtype=H), 1.0, 1)
    assert_ulp_close(torch.zeros(0, 3, dtype=H), torch.zeros(0, 3, dtype=torch.float64), 0)
    with pytest.raises(AssertionError, match=r"shapes differ: actual \(0, 3\), expected \(3,\)"):
        assert_ulp_close(torch.zeros(0, 3, dtype=H), torch.zeros(3, dtype=torch.float64), 0)


def test_bitwise_report():
    a = torch.tensor([0.0, math.nan, 1.0])
    assert_bitwise_equal(a, a.clone())
    nan_payload = a.clone()
    nan_payload.view(torch.int32)[1] = 0x7FC00001  # NaN payloads are not compared
    assert_bitwise_equal(a, nan_payload)
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(torch.tensor([-0.0, math.nan, 1.0]), a, what="w")
    assert str(info.value) == (
        "w: 1 of 3 element(s) differ bitwise (torch.float32); first at [(0,)]:\n"
        "  (0,): actual -0.0 (0x80000000), expected 0.0 (0x00000000)"
    )


def test_fp8_tensors_compare():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no fp8 dtypes")
    a = torch.tensor([1.0, 448.0]).to(torch.float8_e4m3fn)
    assert_bitwise_equal(a, a.clone())
    assert_ulp_close(a, torch.tensor([1.125, 448.0], dtype=torch.float64), 1)  # 1 ulp of e4m3fn at 1 is 1/8
    pattern = (
        r"(?s)exceed the budget of 1 ulp \(float8_e4m3fn\).*actual 1.0, expected 1.25, abs "
        r"err 0.25, 2 ulp"
    )
    with pytest.raises(AssertionError, match=pattern):
        assert_ulp_close(a, torch.tensor([1.25, 448.0], dtype=torch.float64), 1)


def test_pytest_hides_the_assertions_frames():
    with pytest.raises(AssertionError) as info:
        assert_ulp_close(torch.ones(2, dtype=H), torch.zeros(2, dtype=torch.float64), 1)
    shown = info.traceback.filter(info)  # what pytest prints: frames with __tracebackhide__ removed
    assert [entry.name for entry in shown] == ["test_pytest_hides_the_assertions_frames"]
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(torch.ones(2), torch.zeros(3))
    assert [entry.name for entry in info.traceback.filter(info)] == ["test_pytest_hides_the_assertions_frames"]


def test_broadcast_reports_indices_in_the_broadcast_shape():
    actual = torch.ones(2, 3, dtype=H)
    actual[1, 2] = 1.5
    with pytest.raises(AssertionError, match=r"worst at \(1, 2\): actual 1.5, expected 1.0"):
        assert_ulp_close(actual, torch.ones(3, dtype=torch.float64), 1, broadcast=True)
