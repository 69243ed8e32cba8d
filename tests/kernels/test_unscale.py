"""unscale_and_check against its float64 reference, on the Triton kernel (interpreter) and the torch fallback.

Accuracy contract (specs/kernels.md): the written values are bit-exact against the reference for every
scale (the reference emulates the kernel's single fp32 multiply exactly), inf/NaN detection has no false
negatives and no false positives, and the optional squared norm is within the summation bound gamma_n.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels import unscale_and_check
from fp16kit.numerics import assert_bitwise_equal, assert_gamma_close, reference
from fp16kit.numerics import strategies as fst

BACKENDS = [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]
F32_MAX = torch.finfo(torch.float32).max


def run(tensors, inv_scale, out_dtypes, *, with_norm=False, scale_as_tensor=False):
    inputs = [t.clone() for t in tensors]
    outs = None if out_dtypes is None else [torch.empty(t.shape, dtype=d) for t, d in zip(tensors, out_dtypes)]
    found = torch.zeros(1)
    sq = torch.zeros(1) if with_norm else None
    scale = torch.tensor([inv_scale]) if scale_as_tensor else inv_scale
    unscale_and_check(inputs, scale, found, out=outs, sq_norm=sq)
    return (inputs if outs is None else outs), found, sq


def check_sq_norm(sq: torch.Tensor, expected: float, n_elements: int) -> None:
    """fp32 accumulation: squares (1 rounding each) summed in some order (<= n - 1 roundings).

    Error model: |fl(y^2) - y^2| <= u y^2 + eta/2 (eta = fp32's smallest subnormal: a square can
    underflow), and a sum of n non-negative terms adds a relative gamma_(n-1).
    """
    got = float(sq)
    if not math.isfinite(expected) or expected > F32_MAX:
        assert not math.isfinite(got), f"sq_norm should overflow/propagate: got {got}, float64 sum {expected}"
        return
    eta = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps
    assert_gamma_close(sq, torch.tensor([expected], dtype=torch.float64), n_elements + 2, atol=n_elements * eta / 2,
                       what="sq_norm")


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(case=fst.unscale_cases(), scale_as_tensor=st.booleans())
def test_matches_reference_bitwise(backend, case, scale_as_tensor):
    tensors, inv_scale, out_dtypes = case
    written, found, sq = run(tensors, inv_scale, out_dtypes, with_norm=True, scale_as_tensor=scale_as_tensor)
    ref = reference.unscale_and_check(tensors, inv_scale, out_dtypes)
    for i, (w, r) in enumerate(zip(written, ref.outputs)):
        assert_bitwise_equal(w, r, what=f"tensor {i} ({tensors[i].dtype} -> {w.dtype}, inv_scale={inv_scale!r})")
    assert bool(found) == ref.found_inf, f"found_inf {float(found)} but reference says {ref.found_inf}"
    if not ref.found_inf:
        check_sq_norm(sq, ref.sq_norm, sum(t.numel() for t in tensors))


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(case=fst.unscale_cases(powers_of_two_only=True, edge_fraction=0.0))
def test_powers_of_two_are_exact(backend, case):
    """Unscaling by 2^k multiplies exactly: the result times 2^-k gives back the input (no overflow)."""
    tensors, inv_scale, out_dtypes = case
    written, _, _ = run(tensors, inv_scale, out_dtypes)
    for x, w in zip(tensors, written):
        exact = x.to(torch.float64) * inv_scale
        representable = reference.round_to_format(exact, w.dtype) == exact
        assert torch.equal(w.to(torch.float64)[representable], exact[representable])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "value",
    [0.0, -0.0, "min_subnormal", "max", "min_normal", math.inf, -math.inf, math.nan],
)
def test_single_edge_value_detection(backend, dtype, value):
    """Each edge value alone in a large finite tensor: flagged exactly when it is inf/NaN."""
    info = torch.finfo(dtype)
    v = {"min_subnormal": info.smallest_normal * info.eps, "max": info.max, "min_normal": info.smallest_normal}.get(
        value, value
    )
    x = torch.linspace(-1, 1, 5000).to(dtype)
    x[4321] = v
    written, found, _ = run([x], 1.0, None)
    assert bool(found) == (not math.isfinite(v))
    assert_bitwise_equal(written[0][4321:4322], torch.tensor([v], dtype=dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_overflow_only_after_scaling_and_after_cast(backend):
    big = torch.tensor([30000.0], dtype=torch.float16)
    _, found, _ = run([big], 4.0, None)  # 120000 does not fit fp16
    assert bool(found)
    _, found, _ = run([big], 0.5, None)
    assert not bool(found)
    fp32 = torch.tensor([70000.0, 1.0])  # fine in fp32, inf once cast to the fp16 output
    written, found, _ = run([fp32], 1.0, [torch.float16])
    assert bool(found) and math.isinf(float(written[0][0]))
    written, found, _ = run([torch.tensor([65519.0])], 1.0, [torch.float16])  # rounds to 65504, finite
    assert not bool(found) and float(written[0][0]) == 65504.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_is_never_cleared(backend):
    found = torch.ones(1)
    unscale_and_check([torch.ones(10)], 0.5, found)
    assert float(found) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_sizes_in_one_call(backend):
    """A realistic grad list: tiny and multi-chunk tensors, three dtypes, fp16 grads into fp32 masters."""
    torch.manual_seed(0)
    sizes = [1, 7, 4096, 4097, 9000, 3]
    dtypes = [torch.float16, torch.bfloat16, torch.float32] * 2
    tensors = [torch.randn(n).to(d) * 1024 for n, d in zip(sizes, dtypes)]
    written, found, sq = run(tensors, 2.0**-10, [torch.float32] * len(tensors), with_norm=True)
    ref = reference.unscale_and_check(tensors, 2.0**-10, [torch.float32] * len(tensors))
    for w, r in zip(written, ref.outputs):
        assert_bitwise_equal(w, r)
    assert not bool(found)
    check_sq_norm(sq, ref.sq_norm, sum(sizes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_float64_are_handled(backend):
    base = torch.randn(64, 48)
    strided = base.t()  # non-contiguous: goes to the strided path, still exact
    dbl = torch.randn(100, dtype=torch.float64)
    inputs = [base.clone().t(), dbl.clone()]
    assert not inputs[0].is_contiguous()
    found = torch.zeros(1)
    unscale_and_check(inputs, 0.25, found)
    assert torch.equal(inputs[0], strided * 0.25)
    assert torch.equal(inputs[1], dbl * 0.25)
    assert not bool(found)


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
def test_a_float64_tensor_beside_empty_fp16_ones_is_unscaled_in_float64(backend):
    """Empty tensors of another dtype belong to no group of the plan and must not decide the math dtype of the
    tensors that do: the float64 one is multiplied by the float64 scale, not by its fp32 rounding (found by
    Hypothesis in tests/differential/test_kernels_differential.py::test_unscale_and_check)."""
    from fp16kit.kernels import use_backend

    x = torch.tensor([-3.3359724367661406e-48, 1.0 / 3.0], dtype=torch.float64)
    empty = torch.empty(3, 0, dtype=torch.float16)
    y = x.clone()
    with use_backend(backend):
        unscale_and_check([empty, y, empty, empty], 0.1, torch.zeros(1))
    assert torch.equal(y, x * 0.1)
