"""FusedLAMB against the float64 apex-LAMB reference, plus its contracts: skipping, scalers, masters, checkpoints.

Tolerances: the per-element budgets of ``optim_helpers`` (fp32 rounding chains, norm bounds gamma(n)),
checked at every step from the optimizer's actual state.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from apex_optim_helpers import check_grad_scaler, check_state_dict_round_trip
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    assert_same_bits,
    assert_step_skipped,
    bits,
    checked_steps,
    clone_params,
    lamb_step_and_check,
    make_params,
    set_grads,
)

from fp16kit.optim import FusedLAMB

SHAPES = st.lists(
    st.sampled_from([(1,), (7,), (16,), (3, 5), (2, 3, 4), (64,)]),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None)
@given(
    shapes=SHAPES,
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
    lr=st.sampled_from([1e-3, 1e-2, 0.1]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    adam_w_mode=st.booleans(),
    use_nvlamb=st.booleans(),
    grad_averaging=st.booleans(),
    bias_correction=st.booleans(),
    betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.99)]),
    eps=st.sampled_from([1e-6, 1e-8, 1e-30]),
    max_grad_norm=st.sampled_from([0.0, 0.5, 1.0, 1e4]),
    grad_exp=st.integers(-6, 3),
    zero=st.sampled_from(["none", "param", "grad", "both"]),
    steps=st.integers(1, 4),
)
def test_matches_reference(shapes, dtype, seed, grad_exp, zero, steps, **hp):
    make = partial(FusedLAMB, **hp)
    checked_steps(make, lamb_step_and_check, shapes, dtype, seed, steps, grad_exp=grad_exp, zero=zero)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_several_groups_many_steps(seed, dtype):
    """Two groups with their own lr / decay / betas; the global norm and max_grad_norm span both."""
    a = make_params([(8,), (4, 4)], dtype, seed)
    b = make_params([(5,), (3,)], dtype, seed + 1)
    opt = FusedLAMB(
        [{"params": a}, {"params": b, "weight_decay": 0.0, "lr": 0.05, "betas": (0.8, 0.99)}],
        lr=0.01,
        weight_decay=0.1,
        max_grad_norm=1.0,
    )
    for k in range(12):
        lamb_step_and_check(opt)
        set_grads(a + b, seed + 100 + k, scale=0.3 if k % 2 else 3.0)  # the clip triggers on odd steps
    assert [int(g["step"].item()) for g in opt.param_groups] == [12, 12]


def _update(params, **kwargs):
    opt = FusedLAMB(params, **kwargs)
    before = [p.detach().clone() for p in params]
    opt.step()
    return [b - p.detach() for b, p in zip(before, params)]


def test_no_trust_ratio_without_decay_unless_nvlamb():
    """weight_decay=0, use_nvlamb=False: ratio = lr (Adam with global clipping), so scaling a param does not
    change its update; with use_nvlamb the update scales with |p|. The differences before - after are exact
    up to the rounding of p - ratio*u at |p| (<= 2 u |p| with u = 2^-24)."""
    small = make_params([(32,)], torch.float32, 0, scale=1.0)
    big = clone_params(small)
    with torch.no_grad():
        big[0].mul_(64.0)
    atol = 2 * 2.0**-24 * float(big[0].detach().abs().max())
    d_small = _update(small, lr=0.01, weight_decay=0.0)[0]
    d_big = _update(big, lr=0.01, weight_decay=0.0)[0]
    torch.testing.assert_close(d_small, d_big, rtol=0, atol=atol)
    small = make_params([(32,)], torch.float32, 0, scale=1.0)
    big = clone_params(small)
    with torch.no_grad():
        big[0].mul_(64.0)
    n_small = _update(small, lr=0.01, weight_decay=0.0, use_nvlamb=True)[0]
    n_big = _update(big, lr=0.01, weight_decay=0.0, use_nvlamb=True)[0]
    torch.testing.assert_close(n_big, 64.0 * n_small, rtol=0, atol=atol)
    assert not torch.allclose(n_big, n_small, rtol=0.5)


def test_clip_makes_update_invariant_to_grad_scale():
    """When the global norm exceeds max_grad_norm, g / clip has norm max_grad_norm whatever the grads' scale;
    below the threshold (no clipping) the scale matters (through eps)."""
    a = make_params([(16,), (5,)], torch.float32, 3, grad_scale=10.0)
    b = clone_params(a)
    for p in b:
        p.grad.mul_(8.0)
    da, db = _update(a, lr=0.01, eps=1e-3), _update(b, lr=0.01, eps=1e-3)
    for x, y in zip(da, db):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=0)
    a = make_params([(16,), (5,)], torch.float32, 3, grad_scale=1e-3)
    b = clone_params(a)
    for p in b:
        p.grad.mul_(8.0)
    da, db = _update(a, lr=0.01, eps=1e-3, max_grad_norm=1e3), _update(b, lr=0.01, eps=1e-3, max_grad_norm=1e3)
    assert not torch.allclose(da[0], db[0], rtol=1e-2)


def test_grads_untouched_and_state_fp32():
    params = make_params([(10,), (3, 3)], torch.float16, 5)
    grads = [p.grad.clone() for p in params]
    opt = FusedLAMB(params, lr=0.01)
    opt.step()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert opt.state[p]["exp_avg_sq"].dtype == torch.float32


def test_tensor_lr_matches_float_lr():
    a = make_params([(9,), (4,)], torch.float32, 11)
    b = clone_params(a)
    oa = FusedLAMB(a, lr=0.02)
    ob = FusedLAMB(b, lr=torch.tensor([0.02]))
    for k in range(3):
        oa.step()
        ob.step()
        set_grads(a, k)
        set_grads(b, k)
    assert_same_bits([p.detach() for p in a], [p.detach() for p in b])


# ---------------------------------------------------------------------------------------------- skipping


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nonfinite_grad_skips_and_warns(bad, dtype):
    params = make_params([(6,), (3,)], dtype, 1)
    opt = FusedLAMB(params, lr=0.01)
    opt.step()
    params[1].grad[2] = bad
    assert_step_skipped(opt, params, pytest.warns(RuntimeWarning, match="step was skipped"))


def test_nonfinite_policies():
    params = make_params([(6,)], torch.float32, 2)
    opt = FusedLAMB(params, on_nonfinite="raise")
    opt.step()
    params[0].grad[0] = float("nan")
    assert_step_skipped(opt, params, pytest.raises(RuntimeError, match="inf or NaN"))
    opt.on_nonfinite = "skip"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_step_skipped(opt, params)


def test_found_inf_from_caller_skips_everything():
    """A set found_inf (as a loss scaler hands it over) leaves params, state and step counters bit-unchanged."""
    params = make_params([(6,), (2, 2)], torch.float32, 4)
    opt = FusedLAMB([{"params": params[:1]}, {"params": params[1:]}], lr=0.01)
    opt.step()
    before = bits(opt, params)
    opt.found_inf = torch.ones(1)
    opt.grad_scale = torch.full((1,), 1024.0)
    opt.step()
    del opt.found_inf, opt.grad_scale
    assert_same_bits(bits(opt, params), before)
    opt.step()
    assert [int(g["step"].item()) for g in opt.param_groups] == [2, 2]


def test_grad_scale_is_unscaled_inside_step():
    """grad_scale = 2^k with k-scaled grads gives bit-identical results to the unscaled run (exact unscale)."""
    a = make_params([(12,), (5,)], torch.float32, 6)
    b = clone_params(a)
    for p in b:
        p.grad.mul_(2.0**12)
    oa, ob = FusedLAMB(a, lr=0.01), FusedLAMB(b, lr=0.01)
    oa.step()
    ob.grad_scale = torch.full((1,), 2.0**12)
    ob.found_inf = torch.zeros(1)
    ob.step()
    assert float(ob.found_inf) == 0.0
    assert_same_bits([p.detach() for p in a], [p.detach() for p in b])


def test_found_inf_raised_by_norm_pass():
    """fp16kit protocol: a zeroed found_inf is handed over; the step raises it on inf grads and skips."""
    params = make_params([(6,)], torch.float16, 7)
    opt = FusedLAMB(params)
    opt.step()
    params[0].grad[3] = float("inf")
    opt.grad_scale, opt.found_inf = torch.full((1,), 8.0), torch.zeros(1)
    assert_step_skipped(opt, params)
    assert float(opt.found_inf) == 1.0


@pytest.mark.parametrize("scaler_kind", ["torch", "fp16kit"])
def test_with_grad_scaler(scaler_kind):
    """Scaled training through a GradScaler equals unscaled training bit for bit (power-of-two scale), and an
    inf gradient skips the step (step counter included) while the scaler backs off."""
    check_grad_scaler(lambda ps: FusedLAMB(ps, lr=0.01), scaler_kind)


# ---------------------------------------------------------------------------------------- master weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_master_weights_equal_fp32_run(dtype):
    """Master-weights mode: the fp32 masters follow exactly the fp32 run on the same (widened) grads, and the
    model params are their round-to-nearest-even copies."""
    low = make_params([(10,), (4, 3)], dtype, 8)
    high = clone_params(low, torch.float32)
    o_low = FusedLAMB(low, lr=0.01, master_weights=True)
    o_high = FusedLAMB(high, lr=0.01)
    for k in range(4):
        lamb_step_and_check(o_low)
        o_high.step()
        for p, q in zip(low, high):
            assert torch.equal(o_low.state[p]["master"], q.detach())
            assert torch.equal(p.detach(), q.detach().to(dtype))
        set_grads(low, 50 + k)
        for p, q in zip(low, high):
            q.grad = p.grad.float()


def test_master_weights_ignored_for_fp32_params():
    params = make_params([(5,)], torch.float32, 9)
    opt = FusedLAMB(params, master_weights=True)
    opt.step()
    assert "master" not in opt.state[params[0]]


# ------------------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("master", [False, True])
def test_state_dict_round_trip_is_bit_identical(master):
    dtype = torch.float16 if master else torch.float32

    def make(ps):
        return FusedLAMB([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.003}], lr=0.01, master_weights=master)

    opt2, resumed = check_state_dict_round_trip(
        make, dtype, shapes=((7,), (3, 2)), seed=10, steps=3, grad_seeds=(200, 300)
    )
    assert opt2.state[resumed[0]]["exp_avg"].dtype == torch.float32


# ------------------------------------------------------------------------------------------------ bad input


def test_amsgrad_raises():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB(make_params([(3,)], torch.float32, 0), amsgrad=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1e-3}, "learning rate"),
        ({"eps": -1.0}, "eps"),
        ({"betas": (1.0, 0.999)}, "beta1"),
        ({"betas": (0.9, -0.1)}, "beta2"),
        ({"betas": (0.9,)}, "pair"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"on_nonfinite": "ignore"}, "on_nonfinite"),
    ],
)
def test_invalid_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedLAMB(make_params([(3,)], torch.float32, 0), **kwargs)


def test_invalid_group_override():
    a, b = make_params([(3,)], torch.float32, 0), make_params([(3,)], torch.float32, 1)
    with pytest.raises(ValueError, match="beta1"):
        FusedLAMB([{"params": a}, {"params": b, "betas": (1.5, 0.9)}])


def test_sparse_and_complex_params_rejected():
    with pytest.raises(TypeError, match="complex"):
        FusedLAMB([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))])
    with pytest.raises(TypeError, match="dense"):
        FusedLAMB([torch.zeros(3, 3).to_sparse().requires_grad_()])
    p = torch.nn.Parameter(torch.zeros(4, 2))
    p.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedLAMB([p]).step()
