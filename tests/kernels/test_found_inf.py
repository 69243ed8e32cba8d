"""The one owner of the overflow flag (``fp16kit.kernels.found_inf``): creation, the two forms, merging, hand-over."""

from __future__ import annotations

import pytest
import torch

import fp16kit.kernels as fi  # the public face: every name below is exported there
from fp16kit.kernels import unscale_and_check
from fp16kit.optim import FusedAdam, FusedLAMB

CPU = torch.device("cpu")


def test_new_flag_is_fp32_one_element_whatever_the_default_dtype():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        flag = fi.new_found_inf(CPU)
    finally:
        torch.set_default_dtype(old)
    assert flag.dtype == torch.float32 and flag.shape == (1,) and flag.item() == 0.0
    fi.check_found_inf("t", flag, CPU)


def test_the_two_forms_are_views_of_one_flag():
    flag = fi.new_found_inf(CPU)
    t = fi.as_torch_flag(flag)
    assert t.shape == () and t.data_ptr() == flag.data_ptr()
    t.fill_(1.0)  # raising torch's form raises fp16kit's
    assert flag.tolist() == [1.0]
    back = fi.as_fp16kit_flag(t)
    assert back.shape == (1,) and back.data_ptr() == flag.data_ptr()
    # a kernel raising the [1] view of a 0-dim flag raises the 0-dim flag
    zero_dim = torch.zeros((), dtype=torch.float32)
    unscale_and_check([torch.tensor([float("inf")])], 1.0, fi.as_fp16kit_flag(zero_dim))
    assert zero_dim.item() == 1.0


def test_check_names_the_problem():
    with pytest.raises(ValueError, match="one-element float32"):
        fi.check_found_inf("fn", torch.zeros(1, dtype=torch.float16), CPU)
    with pytest.raises(ValueError, match="one-element float32"):
        fi.check_found_inf("fn", torch.zeros(2), CPU)
    with pytest.raises(TypeError, match=r"torch\.zeros"):
        fi.check_found_inf("fn", 0.0, CPU)
    fi.check_found_inf("fn", torch.zeros(()), CPU)  # torch's form is a valid flag too


def test_merge_is_max_not_sum_and_keeps_nan_an_overflow():
    # torch's CPU fused Adam skips only when found_inf == 1.0: two raised flags must combine to 1, not 2
    assert fi.merge_found_inf([torch.ones(1), torch.zeros(1), torch.ones(1)], CPU).tolist() == [1.0]
    assert fi.merge_found_inf([], CPU).tolist() == [0.0]
    merged = fi.merge_found_inf([torch.zeros(()), torch.tensor([float("nan")])], CPU)
    assert merged.shape == (1,) and merged.isnan().all()  # non-zero: LossScaler.update counts NaN as overflow


def test_merge_of_one_flag_is_that_flag():
    flag = fi.new_found_inf(CPU)
    merged = fi.merge_found_inf([flag], CPU)
    assert merged.data_ptr() == flag.data_ptr()  # no op, and raising the result raises the original
    merged2 = fi.merge_found_inf([fi.as_torch_flag(flag)], CPU)
    assert merged2.shape == (1,) and merged2.data_ptr() == flag.data_ptr()


def test_merge_into_raises_in_place():
    dst = fi.new_found_inf(CPU)
    fi.merge_found_inf_into(dst, torch.zeros(()))
    assert dst.tolist() == [0.0]
    fi.merge_found_inf_into(dst, torch.ones(1))
    fi.merge_found_inf_into(dst, torch.zeros(1))
    assert dst.tolist() == [1.0]


class _Declares(torch.optim.SGD):
    _fp16kit_checks_inf = True


class _Foreign(torch.optim.SGD):  # a non-torch module that follows torch's fused contract
    _step_supports_amp_scaling = True


def test_hand_over_form_is_declared_not_guessed():
    p = [torch.nn.Parameter(torch.zeros(2))]
    flag = fi.new_found_inf(CPU)
    for opt in (FusedAdam(p), FusedLAMB(p), _Declares(p, lr=0.1)):
        assert fi.checks_inf_itself(opt)
        assert fi.flag_for(opt, flag).shape == (1,)
    for opt in (torch.optim.Adam(p, fused=True), _Foreign(p, lr=0.1), torch.optim.SGD(p, lr=0.1)):
        assert not fi.checks_inf_itself(opt)
        handed = fi.flag_for(opt, flag)
        assert handed.shape == () and handed.data_ptr() == flag.data_ptr()
    opt = torch.optim.SGD(p, lr=0.1)
    opt._fp16kit_checks_inf = True  # an instance attribute is not the class's declaration
    assert not fi.checks_inf_itself(opt)
