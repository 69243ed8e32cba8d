"""Bad input gets a clear error naming the problem and the fix; empty input is a no-op."""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import copy_, l2norm, unscale_and_check

BACKENDS = [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_mixed_devices(backend):
    with pytest.raises(ValueError, match=r"mixed devices.*call once per device"):
        unscale_and_check([torch.ones(2), torch.ones(2, device="meta")], 1.0, torch.zeros(1))
    with pytest.raises(ValueError, match="found_inf is on"):
        unscale_and_check([torch.ones(2)], 1.0, torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="inv_scale is on meta"):
        unscale_and_check([torch.ones(2)], torch.ones(1, device="meta"), torch.zeros(1))


def test_mismatched_lists(backend):
    with pytest.raises(ValueError, match="tensors has 2 tensors but out has 1"):
        unscale_and_check([torch.ones(2), torch.ones(3)], 1.0, torch.zeros(1), out=[torch.ones(2)])
    with pytest.raises(ValueError, match=r"dst\[0\] has shape \(3,\) but src\[0\] has shape \(2,\)"):
        copy_([torch.ones(3)], [torch.ones(2)])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_non_float_tensors(backend, dtype):
    bad = torch.ones(3, dtype=dtype)
    with pytest.raises(TypeError, match="expected a floating dtype"):
        unscale_and_check([torch.ones(3), bad], 1.0, torch.zeros(1))
    with pytest.raises(TypeError, match="expected a floating dtype"):
        l2norm([bad])
    with pytest.raises(TypeError, match="expected a floating dtype"):
        copy_([torch.ones(3)], [bad])


def test_bad_flags_and_scales(backend):
    with pytest.raises(ValueError, match="found_inf must be a one-element float32 tensor"):
        unscale_and_check([torch.ones(2)], 1.0, torch.zeros(1, dtype=torch.float16))
    with pytest.raises(ValueError, match="found_inf must be a one-element float32 tensor"):
        unscale_and_check([torch.ones(2)], 1.0, torch.zeros(2))
    with pytest.raises(TypeError, match="found_inf must be a one-element float32 tensor"):
        unscale_and_check([torch.ones(2)], 1.0, 0.0)
    with pytest.raises(ValueError, match="inv_scale must be a Python float or a one-element floating tensor"):
        unscale_and_check([torch.ones(2)], torch.ones(2), torch.zeros(1))
    with pytest.raises(ValueError, match="sq_norm must be a one-element float32 or float64 tensor"):
        unscale_and_check([torch.ones(2)], 1.0, torch.zeros(1), sq_norm=torch.zeros(3))


def test_single_tensor_instead_of_list(backend):
    with pytest.raises(TypeError, match=r"wrap it as \[tensor\]"):
        unscale_and_check(torch.ones(2), 1.0, torch.zeros(1))


def test_sparse_rejected_with_fix(backend):
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    with pytest.raises(TypeError, match="Coalesce sparse tensors"):
        unscale_and_check([sparse], 1.0, torch.zeros(1))


def test_empty_is_noop(backend):
    found = torch.zeros(1)
    unscale_and_check([], 2.0, found)
    copy_([], [])
    assert float(found) == 0.0
    empty = torch.ones(0)
    unscale_and_check([empty], 2.0, found)
    copy_([torch.ones(0, dtype=torch.float16)], [empty])
    assert float(l2norm([empty])) == 0.0 and float(found) == 0.0
