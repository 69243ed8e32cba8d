"""The float64 op references: within their stated bounds of mpmath at 40 digits (exact rationals for the
matmul), the same definitions as torch.nn.functional, and usable as a budget for real kernels."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.numerics import assert_gamma_close, assert_rel_close, gamma, reference
from fp16kit.numerics import strategies as fst

mpmath = pytest.importorskip("mpmath")
mp = mpmath.mp
U = 2.0**-53
FAST = settings(max_examples=15, deadline=None)
ROWS = fst.shapes(24, 2, min_dims=2, min_side=1, max_side=8)  # a few rows of up to 8
FINITE = ("nan", "inf", "overflow_after_scale", "overflow_after_cast")


def rows(dtype=torch.float32, exponent_range=(-8, 6)):
    return fst.float_tensors(fst.dtypes() if dtype is None else dtype, shape=ROWS, exclude=FINITE,
                             edges=("zeros", "subnormals", "min_normal"), exponent_range=exponent_range)


def mpf_rows(x: torch.Tensor) -> list[list]:
    return [[mp.mpf(float(v)) for v in r] for r in x.double().reshape(x.shape[0], -1).tolist()]


def check_bound(ref: torch.Tensor, exact: list[list], bound, what: str) -> None:
    """|ref - exact| <= bound(i, j, exact) for every element, the bound in absolute terms."""
    for i, row in enumerate(exact):
        for j, e in enumerate(row):
            err = abs(mp.mpf(float(ref[i, j])) - e)
            b = bound(i, j, e)
            assert err <= b, f"{what}[{i}, {j}]: error {mpmath.nstr(err, 5)} > bound {mpmath.nstr(b, 5)}"


@pytest.fixture(autouse=True)
def _digits():
    with mp.workdps(40):
        yield


@FAST
@given(x=rows(None))
def test_softmax_and_log_softmax_within_their_bounds(x):
    n = x.shape[-1]
    xs = mpf_rows(x)
    m = [max(r) for r in xs]
    sums = [mpmath.fsum(mpmath.exp(v - mi) for v in r) for r, mi in zip(xs, m)]
    exact = [[mpmath.exp(v - mi) / s for v in r] for r, mi, s in zip(xs, m, sums)]
    exact_log = [[v - mi - mpmath.log(s) for v in r] for r, mi, s in zip(xs, m, sums)]

    def gap(i, j):
        return float(abs(xs[i][j] - m[i]))

    check_bound(reference.softmax(x), exact, lambda i, j, e: (n + gap(i, j) + 760) * U * abs(e), "softmax")
    check_bound(reference.log_softmax(x), exact_log, lambda i, j, e: (gap(i, j) + n + 770) * U, "log_softmax")
    # the definitions are torch's
    assert_rel_close(F.softmax(x.double(), -1), reference.softmax(x), 1e-12, atol=1e-300)
    assert_rel_close(F.log_softmax(x.double(), -1), reference.log_softmax(x), 1e-12, atol=1e-12)


@FAST
@given(x=rows(None, exponent_range=(-20, 20)), data=st.data())
def test_rms_norm_within_its_bound(x, data):
    n = x.shape[-1]
    w = data.draw(fst.float_tensors(torch.float32, shape=(n,), exclude=FINITE))
    eps = 1e-6
    xs = mpf_rows(x)
    ws = [mp.mpf(float(v)) for v in w.double().tolist()]
    exact = []
    for r in xs:
        scale = 1 / mpmath.sqrt(mpmath.fsum(v * v for v in r) / n + mp.mpf(eps))
        exact.append([v * scale * wj for v, wj in zip(r, ws)])
    check_bound(reference.rms_norm(x, n, w, eps), exact, lambda i, j, e: (n + 6) * U * abs(e), "rms_norm")
    assert_rel_close(F.rms_norm(x.double(), (n,), w.double(), eps), reference.rms_norm(x, n, w, eps), 1e-13,
                     atol=1e-300)


@FAST
@given(x=rows(torch.float32, exponent_range=(-6, 12)), data=st.data())
def test_layer_norm_within_its_bound(x, data):
    n = x.shape[-1]
    # rows with a large mean and a small spread are where a one-pass mean loses digits
    x = x + data.draw(st.sampled_from([0.0, 1e4, -3e6]))
    w = data.draw(fst.float_tensors(torch.float32, shape=(n,), exclude=FINITE))
    b = data.draw(fst.float_tensors(torch.float32, shape=(n,), exclude=FINITE))
    eps = 1e-5
    xs = mpf_rows(x)
    ws = [mp.mpf(float(v)) for v in w.double().tolist()]
    bs = [mp.mpf(float(v)) for v in b.double().tolist()]
    exact, stats = [], []
    for r in xs:
        mean = mpmath.fsum(r) / n
        var = mpmath.fsum((v - mean) ** 2 for v in r) / n
        s = mpmath.sqrt(var + mp.mpf(eps))
        stats.append((mean, s))
        exact.append([(v - mean) / s * wj + bj for v, wj, bj in zip(r, ws, bs)])

    def bound(i, j, e):
        mean, s = stats[i]
        return (4 * n + 20) * U * (abs(ws[j]) * (abs(xs[i][j] - mean) + abs(mean) + s) / s + abs(bs[j]))

    ref = reference.layer_norm(x, n, w, b, eps)
    check_bound(ref, exact, bound, "layer_norm")
    torch_ln = F.layer_norm(x.double(), (n,), w.double(), b.double(), eps)
    assert_rel_close(torch_ln, ref, 1e-9, atol=1e-9)  # torch's one-pass float64 mean is the less accurate one


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_within_its_bound_including_the_negative_tail(approximate):
    x = torch.cat([torch.linspace(-40, 12, 401), torch.tensor([-1e-30, 0.0, 1e-30, 3.0e3, -3.0e3])]).double()
    got = reference.gelu(x, approximate)
    c = mp.sqrt(2 / mp.pi)
    for v, g in zip(x.tolist(), got.tolist()):
        xv = mp.mpf(v)
        if approximate == "none":
            exact = xv / 2 * mpmath.erfc(-xv / mp.sqrt(2))  # = x/2 (1 + erf(x / sqrt 2)), no cancellation
            bound = (2 * v * v + 16) * U * abs(exact)
        else:
            z = c * (xv + mp.mpf(0.044715) * xv**3)
            exact = xv / (1 + mpmath.exp(-2 * z))  # = x/2 (1 + tanh z), no cancellation
            bound = (8 * abs(z) + 16) * U * abs(exact)
        err = abs(mp.mpf(g) - exact)
        assert err <= bound + (abs(v) + 8) * 2.0**-1074, (v, g, exact)  # (+ subnormal steps where it underflows)
    # the same definition as torch, whose float64 1 + erf (or 1 + tanh) cancels for negative x: ~1e-10 at -5
    assert_rel_close(F.gelu(x, approximate=approximate)[x > -5], got[x > -5], 1e-9, atol=1e-300)


@FAST
@given(x=rows(None, exponent_range=(-4, 6)), data=st.data(), reduction=st.sampled_from(["none", "sum", "mean"]))
def test_cross_entropy_within_its_bound(x, data, reduction):
    n, c = x.shape
    target = torch.tensor(data.draw(st.lists(st.sampled_from([*range(c), -100]), min_size=n, max_size=n)))
    xs = mpf_rows(x)
    losses = []
    for r, t in zip(xs, target.tolist()):
        m = max(r)
        lse = m + mpmath.log(mpmath.fsum(mpmath.exp(v - m) for v in r))
        losses.append((lse - r[t], float(abs(r[t] - m))) if t != -100 else (mp.mpf(0), 0.0))
    got = reference.cross_entropy(x, target, reduction=reduction)
    per_row = [(gap + c + 770) * U for _, gap in losses]
    if reduction == "none":
        check_bound(got.unsqueeze(1), [[v] for v, _ in losses], lambda i, j, e: per_row[i], "cross_entropy")
    else:
        kept = int((target != -100).sum())
        total = mpmath.fsum(v for v, _ in losses)
        exact = total if reduction == "sum" else (total / kept if kept else mp.nan)
        if kept == 0 and reduction == "mean":
            assert math.isnan(float(got))
        else:
            bound = (sum(per_row) + (n + 2) * U * total) / (1 if reduction == "sum" else kept)
            assert abs(mp.mpf(float(got)) - exact) <= bound
    want = F.cross_entropy(x.double(), target, reduction=reduction)
    assert torch.allclose(want, got, rtol=1e-12, atol=1e-12, equal_nan=True)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_matmul_reference_is_within_gamma_of_exact_rationals(data):
    m, k, n = (data.draw(st.integers(1, 6)) for _ in range(3))
    a = data.draw(fst.float_tensors(torch.float32, shape=(m, k), exclude=FINITE, exponent_range=(-30, 30)))
    b = data.draw(fst.float_tensors(torch.float32, shape=(k, n), exclude=FINITE, exponent_range=(-30, 30)))
    ref = reference.matmul(a, b)
    assert ref.k == k
    for i in range(m):
        for j in range(n):
            exact = sum(Fraction(float(a[i, p])) * Fraction(float(b[p, j])) for p in range(k))
            err = abs(Fraction(float(ref.value[i, j])) - exact)
            bound = Fraction(gamma(k, torch.float64)) * Fraction(float(ref.magnitude[i, j]))
            assert err <= bound * (1 + Fraction(1, 2**40))  # (the magnitude itself is rounded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_matmul_meets_the_fp32_accumulation_budget(dtype):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(16, 256, generator=g) * 4).to(dtype)
    b = torch.randn(256, 8, generator=g).to(dtype)
    ref = reference.matmul(a, b)
    out = (a.float() @ b.float()).to(dtype)  # fp32 products, fp32 sums, one rounding to dtype
    assert_gamma_close(out, ref.value, ref.k, magnitude=ref.magnitude, ulp=0.0 if dtype == torch.float32 else 0.5)
    # an accumulation in the narrow format itself breaks the fp32 budget
    if dtype != torch.float32:
        narrow = torch.zeros(16, 8, dtype=dtype)
        for p in range(256):
            narrow = narrow + a[:, p : p + 1] * b[p : p + 1, :]
        with pytest.raises(AssertionError, match=r"exceed the budget of 0\.5 ulp"):
            assert_gamma_close(narrow, ref.value, ref.k, magnitude=ref.magnitude, ulp=0.5)
