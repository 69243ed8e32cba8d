"""l2norm against its float64 reference (Triton interpreter and torch fallback).

Error budget: each element is scaled (1 fp32 rounding, exact for powers of two) and squared (1 rounding,
plus an underflow term eta/2), the n squares are summed in some order (gamma_(n-1) relative), and the
square root adds half an ulp: |got - ref| <= sqrt-propagated gamma_(n+3) * ref + sqrt(n * eta / 2).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from fp16kit.kernels import l2norm
from fp16kit.numerics import assert_gamma_close, gamma, reference
from fp16kit.numerics import strategies as fst

BACKENDS = [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]
ETA = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps


def norm_bound(expected: float, n: int) -> float:
    # relative error of a sum of squares is gamma_(n+2); a square root halves relative errors.
    return gamma(n + 3, torch.float32) * expected + math.sqrt(n * ETA / 2)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(tensors=fst.tensor_lists(max_size=5, edge_fraction=0.1, layouts=fst.LAYOUTS),
       pre_scale=fst.scales(min_exp=-8, max_exp=8))
def test_matches_reference(backend, tensors, pre_scale):
    # inputs in every layout (strided views with NaN in their gaps, transposed, channels_last): a kernel that
    # read past a view's elements would see NaN
    found = torch.zeros(1)
    total, per = l2norm(tensors, per_tensor=True, pre_scale=pre_scale, found_inf=found)
    ref_total, ref_per, ref_found = reference.l2norm(tensors, pre_scale)
    assert total.dtype == torch.float32 and total.shape == () and per.shape == (len(tensors),)
    assert bool(found) == ref_found
    for i, (got, want, n) in enumerate([(total, ref_total, sum(t.numel() for t in tensors))] + [
        (p, r, t.numel()) for p, r, t in zip(per, ref_per, tensors)
    ]):
        if math.isnan(want):
            assert math.isnan(got)
        elif math.isinf(want) or want > torch.finfo(torch.float32).max / 2 ** 64:
            # squares past fp32's range overflow in fp32 accumulation (the contract), or are inf inputs
            assert not math.isfinite(got) or abs(float(got) - want) <= norm_bound(want, n)
        else:
            # the module docstring's budget: gamma(n + 3) relative, sqrt(n eta / 2) absolute
            assert_gamma_close(got, torch.tensor(want, dtype=torch.float64), n + 3, atol=math.sqrt(n * ETA / 2),
                               what="global norm" if i == 0 else f"norm of tensor {i - 1}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_values_do_not_overflow(backend):
    """60000^2 overflows fp16 but not the fp32 accumulator."""
    x = torch.full((5000,), 60000.0, dtype=torch.float16)
    total = float(l2norm([x]))
    assert abs(total - 60000.0 * math.sqrt(5000)) <= norm_bound(60000.0 * math.sqrt(5000), 5000)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_chunk_tensors_and_per_tensor_order(backend):
    torch.manual_seed(1)
    tensors = [torch.randn(9000), torch.randn(3).half(), torch.randn(4096).bfloat16(), torch.randn(0), torch.randn(5)]
    total, per = l2norm(tensors, per_tensor=True)
    ref_total, ref_per, _ = reference.l2norm(tensors)
    for p, r, t in zip(per.tolist(), ref_per, tensors):
        assert abs(p - r) <= norm_bound(r, max(t.numel(), 1))
    assert abs(float(total) - ref_total) <= norm_bound(ref_total, 17104)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend):
    torch.manual_seed(2)
    tensors = [torch.randn(10000), torch.randn(77)]
    a = l2norm(tensors, per_tensor=True)
    b = l2norm(tensors, per_tensor=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_list():
    assert float(l2norm([])) == 0.0
    _, per = l2norm([], per_tensor=True)
    assert per.numel() == 0
