"""FusedMixedPrecisionLamb: apex's signature on FusedLAMB's master-weights mode. Checked against the float64
LAMB reference (``optim_helpers.lamb_step_and_check``: FusedLAMB's budgets) on both backends, bit for bit
against FusedLAMB(master_weights=True), and for its own contracts: device lr/step per group, masters only for
``reduced_precision_dtype``, skipping, scalers, amp O2, checkpoints, bad input."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from apex_optim_helpers import check_amp_o2, check_grad_scaler, check_nonfinite_grad_skips, check_state_dict_round_trip
from hypothesis import strategies as st
from optim_helpers import (
    assert_same_bits,
    bits,
    checked_steps,
    clone_params,
    lamb_step_and_check,
    make_params,
    reference_tests,
    set_grads,
)

from fp16kit.optim import FusedLAMB, FusedMixedPrecisionLamb

SHAPES = st.lists(st.sampled_from([(1,), (7,), (3, 5), (64,)]), min_size=1, max_size=3)
CONFIG = {
    "dtype": st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    "reduced": st.sampled_from([None, torch.float16, torch.bfloat16]),
    "seed": st.integers(0, 2**16),
    "lr": st.sampled_from([1e-3, 1e-2]),
    "weight_decay": st.sampled_from([0.0, 0.01]),
    "max_grad_norm": st.sampled_from([0.0, 1.0]),
    "start": st.sampled_from([0, 7]),
    "grad_exp": st.integers(-8, 3),
}


def _run(shapes, dtype, reduced, seed, lr, weight_decay, max_grad_norm, start, grad_exp, steps):
    make = partial(
        FusedMixedPrecisionLamb,
        lr=lr,
        step=start,
        weight_decay=weight_decay,
        max_grad_norm=max_grad_norm,
        reduced_precision_dtype=reduced,
    )
    opt, params = checked_steps(make, lamb_step_and_check, shapes, dtype, seed, steps, grad_exp=grad_exp)
    assert int(opt.param_groups[0]["step"].item()) == start + steps
    for p in params:
        assert ("master" in opt.state[p]) == (p.dtype == reduced)


test_matches_reference_torch_backend, test_matches_reference_triton_interpreter = reference_tests(
    _run, SHAPES, CONFIG, examples=20, interpreter_examples=4
)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_same_bits_as_fused_lamb_master_weights(dtype):
    """apex's positional order (lr, step, bias_correction, betas, eps, weight_decay, ...) maps onto FusedLAMB."""
    a = make_params([(9,), (4, 4)], dtype, 1)
    b = clone_params(a)
    mixed = FusedMixedPrecisionLamb(a, 2e-3, 0, True, (0.8, 0.99), 1e-5, 0.05, False, True, True, 0.5, True, dtype)
    plain = FusedLAMB(
        b,
        lr=2e-3,
        betas=(0.8, 0.99),
        eps=1e-5,
        weight_decay=0.05,
        max_grad_norm=0.5,
        use_nvlamb=True,
        master_weights=True,
    )
    for k in range(3):
        mixed.step()
        plain.step()
        set_grads(a, k)
        set_grads(b, k)
    assert_same_bits(bits(mixed, a)[:-1], bits(plain, b)[:-1])  # all but the step counters (same values)


def test_device_lr_and_step_per_group():
    a, b = make_params([(5,)], torch.float16, 2), make_params([(3,)], torch.float16, 3)
    opt = FusedMixedPrecisionLamb(
        [{"params": a}, {"params": b}], lr=0.01, step=4, reduced_precision_dtype=torch.float16
    )
    g0, g1 = opt.param_groups
    assert isinstance(g0["lr"], torch.Tensor) and g0["lr"].dtype == torch.float32
    assert g0["lr"] is not g1["lr"]  # each group its own tensor (apex clones tensor defaults)
    g1["lr"].fill_(0.5)  # an in-place schedule update: no recompile, no sync
    assert float(g0["lr"]) == pytest.approx(0.01)
    lamb_step_and_check(opt)
    assert [int(g["step"].item()) for g in opt.param_groups] == [5, 5]


def test_nonfinite_grad_skips():
    check_nonfinite_grad_skips(lambda ps: FusedMixedPrecisionLamb(ps, reduced_precision_dtype=torch.float16))


@pytest.mark.parametrize("scaler_kind", ["torch", "fp16kit"])
def test_with_grad_scaler(scaler_kind):
    check_grad_scaler(lambda ps: FusedMixedPrecisionLamb(ps, lr=0.01), scaler_kind)


def test_amp_o2():
    check_amp_o2(lambda ps: FusedMixedPrecisionLamb(ps, lr=0.01))


def test_state_dict_round_trip_and_mismatch():
    check_state_dict_round_trip(lambda ps: FusedMixedPrecisionLamb(ps, lr=0.01, reduced_precision_dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"amsgrad": True}, RuntimeError, "AMSGrad"),
        ({"lr": float("nan")}, ValueError, "learning rate"),
        ({"step": -1}, ValueError, "step"),
        ({"reduced_precision_dtype": torch.int8}, ValueError, "reduced_precision_dtype"),
        ({"betas": (0.9, 1.5)}, ValueError, "beta2"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FusedMixedPrecisionLamb(make_params([(3,)], torch.float16, 0), **kwargs)
