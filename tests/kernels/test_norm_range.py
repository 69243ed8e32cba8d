"""Norms over the whole floating-point range (issue 9, item 4): no overflow, no underflow, no false found_inf.

Budget (docs/kernels.md, "Norm range"): ``l2norm`` squares and sums in float64, so its fp32 result is within 1 ulp
(fp32) of the float64 reference (``fp16kit.numerics.reference.l2norm``, scaled like BLAS ``nrm2``) for every
finite input: it is inf only when the norm itself is above fp32's maximum, and ``found_inf`` is raised only by
an inf/NaN element. ``unscale_and_check``'s ``sq_norm`` is the float64 sum rounded once into the accumulator's
dtype: float64 accumulators are right for any finite fp32 values; fp32 ones as far as fp32 can hold the square.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels import l2norm, unscale_and_check
from fp16kit.numerics import assert_ulp_close, reference
from fp16kit.numerics import strategies as fst

BACKENDS = [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]
F32 = torch.finfo(torch.float32)


def check_norms(tensors, pre_scale=1.0):
    found = torch.zeros(1)
    total, per = l2norm(tensors, per_tensor=True, pre_scale=pre_scale, found_inf=found)
    ref_total, ref_per, ref_found = reference.l2norm(tensors, pre_scale)
    # the right fp32 answer is the reference rounded to fp32 (inf above fp32's maximum)
    want = reference.round_to_format(torch.tensor([ref_total, *ref_per], dtype=torch.float64), torch.float32)
    assert_ulp_close(torch.cat([total.reshape(1), per]), want, 1, dtype=torch.float32, what="norms vs reference")
    assert bool(found) == ref_found, f"found_inf {float(found)}, reference {ref_found}"
    return total, per, found


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("magnitude", [1e30, 1e-30, 1e-37, 1e-44, 1e36])
def test_large_and_tiny_finite_values(backend, magnitude):
    """Issue 9: norms above ~1.8e19 came out inf *without* found_inf, and values around 1e-37 gave 0 (fp32
    squares overflow / underflow). FusedLAMB then clipped with a wrong norm."""
    x = torch.full((4100,), magnitude) * torch.linspace(0.5, 1.0, 4100)
    total, _, found = check_norms([x, x[:7].clone()])
    assert 0 < float(total) < math.inf and not bool(found)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_magnitudes_in_one_list(backend):
    tensors = [torch.full((5000,), 1e30), torch.full((3,), 1e-30), torch.full((10,), 1e-40).half(),
               torch.full((4097,), 6e4).half(), torch.full((20,), 1e38).bfloat16(), torch.full((9,), 1e-300).double()]
    _, per, _ = check_norms(tensors)
    assert (per > 0).all() or float(per[2]) == 0.0  # 1e-40 is 0 in fp16


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_beyond_fp32_is_inf_but_not_a_found_inf(backend):
    assert float(l2norm([torch.tensor([F32.max])])) == F32.max  # the largest finite norm, exactly
    x = torch.full((4, 4096), F32.max).reshape(-1)
    found = torch.zeros(1)
    total = l2norm([x], found_inf=found)
    assert math.isinf(float(total)) and not bool(found)  # the right rounding of 2.2e40; no element is inf
    x[5] = math.inf
    l2norm([x], found_inf=found)
    assert bool(found)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=20, deadline=None)
@given(
    data=st.data(),
    center=st.integers(-140, 120),
    pre_scale=st.sampled_from([1.0, 2.0**-24, 2.0**20, 0.3]),
)
def test_norm_matches_reference_to_one_ulp_anywhere_in_range(backend, data, center, pre_scale):
    """Hypothesis: magnitudes drawn anywhere from fp32's subnormals to its maximum, edge values included."""
    tensors = data.draw(
        fst.tensor_lists(
            dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float64),
            max_size=4,
            max_numel=40,
            edge_fraction=0.1,
            edges=("zero", "neg_zero", "subnormal", "min_normal", "max_finite"),
            exponent_range=(center - 8, center + 8),
        )
    )
    check_norms(tensors, pre_scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sq_norm_range(backend):
    """sq_norm: float64 accumulation, one rounding into the accumulator; never a found_inf by itself."""
    x = torch.full((4100,), 1e30)
    sq64, found = torch.zeros(1, dtype=torch.float64), torch.zeros(1)
    unscale_and_check([x.clone()], 1.0, found, sq_norm=sq64)
    assert math.isclose(float(sq64), 4100 * float(torch.tensor(1e30)) ** 2, rel_tol=1e-12) and not bool(found)
    sq32 = torch.zeros(1)
    unscale_and_check([x.clone()], 1.0, found, sq_norm=sq32)
    assert math.isinf(float(sq32)) and not bool(found)  # 4.1e63 does not fit fp32: inf, documented
    tiny = torch.full((4100,), 1e-20)  # squares 1e-40: subnormal in fp32, fine in float64
    sq32 = torch.zeros(1)
    unscale_and_check([tiny.clone()], 1.0, found, sq_norm=sq32)
    want = 4100 * float(torch.tensor(1e-20)) ** 2
    assert_ulp_close(sq32, torch.tensor([want], dtype=torch.float64), 1, what="sq_norm of tiny values")
