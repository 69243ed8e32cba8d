"""FusedAdam against torch.optim.Adam/AdamW and the float64 reference; skipping, masters, checkpoints, bad input.

Tolerances: ``optim_helpers.adam_budget`` (K = 8 fp32 roundings at the magnitudes of p and of the update,
moment errors carried through). Against torch both sides are fp32 implementations, each within that budget
of the exact result, so they may differ by twice it.
"""

from __future__ import annotations

import pytest
import torch
from apex_optim_helpers import check_state_dict_round_trip
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import (
    adam_budget,
    adam_step_and_check,
    assert_same_bits,
    assert_step_skipped,
    assert_within,
    clone_params,
    make_params,
    set_grads,
)

from fp16kit.optim import FusedAdam

SHAPES = st.lists(st.sampled_from([(1,), (9,), (4, 4), (2, 3, 5), (64,)]), min_size=1, max_size=3)
HYPER = {
    "lr": st.sampled_from([1e-3, 1e-2, 0.1]),
    "weight_decay": st.sampled_from([0.0, 0.01, 0.1]),
    "betas": st.sampled_from([(0.9, 0.999), (0.8, 0.9), (0.0, 0.99)]),
    "eps": st.sampled_from([1e-8, 1e-6]),
}


@settings(max_examples=30, deadline=None)
@given(shapes=SHAPES, seed=st.integers(0, 2**16), adam_w_mode=st.booleans(), steps=st.integers(1, 4), **HYPER)
def test_matches_torch_optim(shapes, seed, adam_w_mode, steps, lr, weight_decay, betas, eps):
    ours = make_params(shapes, torch.float32, seed)
    theirs = clone_params(ours)
    hp = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
    opt = FusedAdam(ours, adam_w_mode=adam_w_mode, **hp)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = torch_cls(theirs, foreach=False, **hp)
    for k in range(steps):
        if k:  # start torch from our state, so the comparison is one step deep
            for p, q in zip(ours, theirs):
                with torch.no_grad():
                    q.copy_(p)
                ref.state[q]["exp_avg"].copy_(opt.state[p]["exp_avg"])
                ref.state[q]["exp_avg_sq"].copy_(opt.state[p]["exp_avg_sq"])
        p0 = [p.detach().double() for p in ours]
        m0 = [opt.state[p]["exp_avg"].double() if opt.state[p] else torch.zeros_like(q) for p, q in zip(ours, p0)]
        opt.step()
        ref.step()
        step = int(opt.param_groups[0]["step"].item())
        assert step == k + 1
        for i, (p, q) in enumerate(zip(ours, theirs)):
            m, v = opt.state[p]["exp_avg"].double(), opt.state[p]["exp_avg_sq"].double()
            budget = 2 * adam_budget(p0[i], m, v, p.grad.double(), m0[i], {**hp, "step": step})
            assert_within(p, q.detach().double(), budget, f"param {i} at step {step}")
        set_grads(ours, seed + k + 1)
        for p, q in zip(ours, theirs):
            q.grad = p.grad.clone()


@settings(max_examples=25, deadline=None)
@given(
    shapes=SHAPES,
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    adam_w_mode=st.booleans(),
    master=st.booleans(),
    **HYPER,
)
def test_matches_reference(shapes, seed, dtype, adam_w_mode, master, lr, weight_decay, betas, eps):
    params = make_params(shapes, dtype, seed)
    opt = FusedAdam(
        params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, adam_w_mode=adam_w_mode, master_weights=master
    )
    for k in range(3):
        adam_step_and_check(opt, adam_w_mode=adam_w_mode)
        set_grads(params, seed + 10 + k)


def test_nonfinite_grad_skips_everything():
    params = make_params([(5,), (2, 2)], torch.float16, 1)
    opt = FusedAdam(params, master_weights=True)
    opt.step()
    params[0].grad[1] = float("nan")
    assert_step_skipped(opt, params, pytest.warns(RuntimeWarning, match="skipped"))
    opt.found_inf, opt.grad_scale = torch.ones(1), None  # set by a caller (e.g. the apex-style frontend)
    set_grads(params, 3)
    assert_step_skipped(opt, params)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_master_weights_equal_fp32_run(dtype):
    low = make_params([(8,), (3, 3)], dtype, 2)
    high = clone_params(low, torch.float32)
    o_low, o_high = FusedAdam(low, lr=0.01, master_weights=True), FusedAdam(high, lr=0.01)
    for k in range(3):
        o_low.step()
        o_high.step()
        for p, q in zip(low, high):
            assert torch.equal(o_low.state[p]["master"], q.detach())
            assert torch.equal(p.detach(), q.detach().to(dtype))
        set_grads(low, k)
        for p, q in zip(low, high):
            q.grad = p.grad.float()


def test_state_dict_round_trip_is_bit_identical():
    check_state_dict_round_trip(lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.1, master_weights=True))


def test_grad_scaler_hand_over():
    model = torch.nn.Linear(5, 3)
    opt = FusedAdam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ref = torch.nn.Linear(5, 3)
    ref.load_state_dict(model.state_dict())
    o_ref = FusedAdam(ref.parameters(), lr=0.01)
    x = torch.randn(7, 5)
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    ref(x).sum().backward()
    o_ref.step()
    assert_same_bits([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()])


def test_grads_untouched():
    params = make_params([(6,)], torch.float16, 5)
    g = params[0].grad.clone()
    FusedAdam(params).step()
    assert torch.equal(params[0].grad, g)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"amsgrad": True}, RuntimeError, "AMSGrad"),
        ({"lr": -0.1}, ValueError, "learning rate"),
        ({"eps": -1e-8}, ValueError, "eps"),
        ({"betas": (0.9, 1.0)}, ValueError, "beta2"),
        ({"betas": (-0.5, 0.9)}, ValueError, "beta1"),
        ({"weight_decay": float("nan")}, ValueError, "weight_decay"),
        ({"lr": "fast"}, TypeError, "lr"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FusedAdam(make_params([(3,)], torch.float32, 0), **kwargs)


def test_complex_and_sparse_rejected():
    with pytest.raises(TypeError, match="complex"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex128))])
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.zeros(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedAdam([p]).step()
