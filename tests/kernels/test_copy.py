"""copy_ (multi-tensor cast copy): bit-identical to Tensor.copy_ and to the float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels import copy_
from fp16kit.numerics import assert_bitwise_equal, reference
from fp16kit.numerics import strategies as fst

BACKENDS = [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_matches_reference_and_tensor_copy(backend, data):
    dst_dtype = data.draw(st.sampled_from(DTYPES))
    src = data.draw(
        fst.tensor_lists(dtypes=DTYPES, edges=fst.EDGE_CLASSES, cast_to=dst_dtype, max_size=4, exponent_range=(-30, 30),
                         layouts=fst.LAYOUTS)  # sources in every layout; the destinations are contiguous
    )
    dst = [torch.empty(s.shape, dtype=dst_dtype) for s in src]
    copy_(dst, src)
    expected = reference.copy(src, [dst_dtype] * len(src))
    for i, (d, e, s) in enumerate(zip(dst, expected, src)):
        assert_bitwise_equal(d, e, what=f"{s.dtype} -> {dst_dtype} vs reference, tensor {i}")
        assert_bitwise_equal(d, torch.empty_like(d).copy_(s), what=f"{s.dtype} -> {dst_dtype} vs Tensor.copy_")


@pytest.mark.parametrize("backend", BACKENDS)
def test_master_weights_to_bf16_ties_round_to_even(backend):
    # 1 + 2^-8 is exactly halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1.0);
    # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: goes to the even 1 + 2^-6.
    src = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20] * 1500)
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    copy_([dst], [src])
    assert dst[:4].tolist() == [1.0, 1 + 2**-6, -1.0, 1 + 2**-7]
    assert_bitwise_equal(dst, src.bfloat16())


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_pairs_mixed(backend):
    torch.manual_seed(3)
    src = [torch.randn(n) * 100 for n in (1, 4095, 4097, 10)] + [torch.randn(7).half()]
    dst = [torch.empty(s.shape, dtype=d) for s, d in zip(src, [torch.float16, torch.bfloat16, torch.float16,
                                                              torch.float32, torch.float32])]
    copy_(dst, src)
    for d, s in zip(dst, src):
        assert_bitwise_equal(d, s.to(d.dtype))
