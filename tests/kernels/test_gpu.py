"""The kernels compiled for a CUDA GPU: same properties as on CPU, plus bit-exact bf16 and torch parity.

Run on a GPU machine with ``TRITON_INTERPRET=0 pytest -m gpu`` (interpreter mode cannot run CUDA tensors,
so under the default test setting these tests skip and say why).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from fp16kit.kernels import copy_, l2norm, unscale_and_check
from fp16kit.numerics import assert_bitwise_equal, gamma, reference
from fp16kit.numerics import strategies as fst

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_triton")]


@settings(max_examples=40, deadline=None)
@given(case=fst.unscale_cases(max_numel=5000))
def test_unscale_bitwise_on_gpu(case):
    tensors, inv_scale, out_dtypes = case
    inputs = [t.cuda() for t in tensors]
    outs = None if out_dtypes is None else [torch.empty(t.shape, dtype=d, device="cuda") for t, d in
                                            zip(tensors, out_dtypes)]
    found = torch.zeros(1, device="cuda")
    unscale_and_check(inputs, torch.tensor([inv_scale], device="cuda"), found, out=outs)
    ref = reference.unscale_and_check(tensors, inv_scale, out_dtypes)
    for w, r in zip(inputs if outs is None else outs, ref.outputs):
        assert_bitwise_equal(w.cpu(), r)
    assert bool(found.cpu()) == ref.found_inf


@settings(max_examples=30, deadline=None)
@given(src=fst.tensor_lists(dtypes=(torch.float32,), edges=fst.EDGE_CLASSES, cast_to=torch.bfloat16, max_numel=5000))
def test_copy_bf16_bit_exact_on_gpu(src):
    gsrc = [s.cuda() for s in src]
    dst = [torch.empty(s.shape, dtype=torch.bfloat16, device="cuda") for s in src]
    copy_(dst, gsrc)
    for d, s in zip(dst, src):
        assert_bitwise_equal(d.cpu(), reference.copy([s], [torch.bfloat16])[0])


def test_matches_torch_amp_unscale_on_bert_like_list():
    torch.manual_seed(0)
    shapes = [(1024, 1024), (1024,), (4096, 1024), (4096,), (30522, 64), (3,)] * 10
    grads = [torch.randn(s, device="cuda") * 1000 for s in shapes]
    theirs = [g.clone() for g in grads]
    found_ours, found_theirs = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    inv = torch.full((1,), 2.0**-10, device="cuda")
    unscale_and_check(grads, inv, found_ours)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv)
    for a, b in zip(grads, theirs):
        assert torch.equal(a, b)
    assert float(found_ours) == float(found_theirs) == 0.0
    total = float(l2norm(grads))
    want = float(torch.stack([g.double().norm() for g in grads]).norm())
    assert abs(total - want) <= gamma(2 * 10**6, torch.float32) * want


def test_no_host_sync_in_unscale():
    grads = [torch.randn(1000, device="cuda") for _ in range(10)]
    found = torch.zeros(1, device="cuda")
    inv = torch.full((1,), 0.5, device="cuda")
    unscale_and_check(grads, inv, found)  # warm up: compile and build the table
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        unscale_and_check(grads, inv, found)
    finally:
        torch.cuda.set_sync_debug_mode("default")
