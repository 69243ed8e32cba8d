"""FusedSGD (apex's constructor and math) against torch.optim.SGD; the buffer's first use, apex's attributes,
checkpoints, bad input, the kernel's sm_90 code. The float64 reference on both backends, edge values, skipping,
scalers and amp O2: ``test_apex_contracts.py``.

Tolerances: ``apex_optim_helpers.sgd_step_and_check`` budgets (K = 8 fp32 roundings at the magnitudes involved).
Against torch both sides are fp32 implementations within that budget of the exact result: twice the budget.
"""

from __future__ import annotations

import pytest
import torch
from apex_optim_helpers import (
    APEX_HP_DEVICE,
    APEX_HP_DEVICE_VERIFY,
    APEX_HP_LEGACY,
    SHAPES,
    compile_for_sm90,
    restart_torch_from,
    sgd_step_and_check,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import U32, K, assert_within, clone_params, make_params

from fp16kit.optim import FusedSGD


@settings(max_examples=25, deadline=None)
@given(
    shapes=SHAPES,
    seed=st.integers(0, 2**16),
    momentum=st.sampled_from([0.0, 0.9]),
    dampening=st.sampled_from([0.0, 0.2]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01]),
    foreach=st.booleans(),
)
def test_matches_torch_optim_sgd(shapes, seed, momentum, dampening, nesterov, weight_decay, foreach):
    """torch.optim.SGD beside ours on the same inputs, 3 steps (torch restarted from our state each step)."""
    nesterov = nesterov and momentum > 0 and dampening == 0
    hp = {"lr": 0.1, "momentum": momentum, "dampening": dampening, "nesterov": nesterov, "weight_decay": weight_decay}
    ours = make_params(shapes, torch.float32, seed)
    theirs = clone_params(ours)
    opt, ref = FusedSGD(ours, **hp), torch.optim.SGD(theirs, foreach=foreach, **hp)
    for k in range(3):
        p0 = [p.detach().double() for p in ours]
        m0 = [opt.state[p]["momentum_buffer"].double() if "momentum_buffer" in opt.state[p] else None for p in ours]
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            a = p.grad.double().abs() + weight_decay * p0[i].abs()
            mag = a if m0[i] is None else momentum * m0[i].abs() + a
            budget = 2 * K * U32 * (p0[i].abs() + 0.1 * (a + 3 * mag))
            assert_within(p, q.detach().double(), budget, f"param {i} at step {k + 1}")
        restart_torch_from(opt, ref, ours, theirs, seed + k + 1, "momentum_buffer")


def test_first_step_buffer_is_the_grad_and_momentum_switched_on_later():
    params = make_params([(5,)], torch.float32, 3)
    opt = FusedSGD(params, lr=0.1, momentum=0.9, dampening=0.5, weight_decay=0.1)
    g, p0 = params[0].grad.clone(), params[0].detach().clone()
    opt.step()
    assert torch.equal(opt.state[params[0]]["momentum_buffer"], g + 0.1 * p0)  # not (1 - dampening) * g
    plain = make_params([(5,)], torch.float32, 4)
    opt = FusedSGD(plain, lr=0.1)
    opt.step()
    assert "momentum_buffer" not in opt.state[plain[0]]  # no buffer without momentum (apex allocates one)
    opt.param_groups[0]["momentum"] = 0.9
    sgd_step_and_check(opt)  # the new buffer starts as the grad
    sgd_step_and_check(opt)


def test_zero_grad_and_apex_attributes():
    params = make_params([(3,)], torch.float32, 0)
    opt = FusedSGD(params, lr=0.1)
    opt.zero_grad()
    assert params[0].grad is not None and not params[0].grad.any()  # apex's default set_grad_none=False
    opt = FusedSGD(params, lr=0.1, set_grad_none=True, materialize_master_grads=False)
    opt.zero_grad()
    assert params[0].grad is None and opt.materialize_master_grads is False
    assert FusedSGD(params, lr=0.1).wd_after_momentum is False


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({}, TypeError, "lr is required"),
        ({"lr": -0.1}, ValueError, "learning rate"),
        ({"lr": float("nan")}, ValueError, "learning rate"),
        ({"lr": 0.1, "momentum": -0.9}, ValueError, "momentum"),
        ({"lr": 0.1, "momentum": float("inf")}, ValueError, "momentum"),
        ({"lr": 0.1, "dampening": float("nan")}, ValueError, "dampening"),
        ({"lr": 0.1, "weight_decay": float("nan")}, ValueError, "weight_decay"),
        ({"lr": 0.1, "nesterov": True}, ValueError, "Nesterov"),
        ({"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "nesterov": True}, ValueError, "Nesterov"),
        ({"lr": 0.1, "on_nonfinite": "ignore"}, ValueError, "on_nonfinite"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FusedSGD(make_params([(3,)], torch.float32, 0), **kwargs)


def test_bad_group_override_and_sparse_grad():
    opt = FusedSGD(make_params([(3,)], torch.float32, 0), lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group({"params": make_params([(2,)], torch.float32, 1), "momentum": float("nan")})
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.zeros(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FusedSGD([p], lr=0.1).step()


def test_checkpoint_without_buffer_starts_one():
    """A checkpoint whose momentum buffer is None (torch.optim.SGD saves that for a param stepped without
    momentum): resuming with momentum creates the buffer (buffer = grad on its first use)."""
    params = make_params([(4,), (2, 2)], torch.float32, 2)
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["momentum_buffer"] = None
    opt2 = FusedSGD(clone_params(params), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved)
    sgd_step_and_check(opt2)
    sgd_step_and_check(opt2)


def test_apex_checkpoint_with_fp16_state_loads():
    """apex keeps FusedSGD's buffers in the param dtype: an fp16 buffer is widened to fp32 on load (exactly),
    instead of being refused as not belonging to the params."""
    params = make_params([(5,)], torch.float16, 3)
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    opt.step()
    saved = opt.state_dict()
    buf = saved["state"][0]["momentum_buffer"].half()
    saved["state"][0]["momentum_buffer"] = buf
    opt2 = FusedSGD(clone_params(params), lr=0.1, momentum=0.9)
    opt2.load_state_dict(saved)
    state = next(iter(opt2.state.values()))
    assert state["momentum_buffer"].dtype == torch.float32 and torch.equal(state["momentum_buffer"], buf.float())
    sgd_step_and_check(opt2)


def test_kernel_compiles_for_sm90_with_vector_memory_ops():
    """No GPU needed: the SGD kernel compiles for sm_90, and full chunks use 16-byte loads and stores."""
    result = compile_for_sm90(
        "sgd",
        {
            "sgd fp32 master -> fp16 model, nesterov, first run": (
                "_sgd_kernel",
                {
                    "P_DTYPE": "float32",
                    "G_DTYPE": "float16",
                    "MODEL_DTYPE": "float16",
                    "HAS_MODEL": True,
                    "WD": True,
                    "WD_AFTER": False,
                    "MOMENTUM": True,
                    "NESTEROV": True,
                    "FIRST_RUN": True,
                    "VERIFY": False,
                    "BLOCK": 4096,
                    "ALIGNED": True,
                    **APEX_HP_LEGACY,
                },
            ),
            "sgd bf16, momentum": (
                "_sgd_kernel",
                {
                    "P_DTYPE": "bfloat16",
                    "G_DTYPE": "bfloat16",
                    "MODEL_DTYPE": "bfloat16",
                    "HAS_MODEL": False,
                    "WD": True,
                    "WD_AFTER": True,
                    "MOMENTUM": True,
                    "NESTEROV": False,
                    "FIRST_RUN": False,
                    "VERIFY": False,
                    "BLOCK": 4096,
                    "ALIGNED": True,
                    **APEX_HP_LEGACY,
                },
            ),
            "sgd on the device: check and verify, fp16 grads, tensor lr": (
                "_sgd_kernel",
                {
                    "P_DTYPE": "float32", "G_DTYPE": "float16", "MODEL_DTYPE": "float16", "HAS_MODEL": True,
                    "WD": True, "WD_AFTER": False, "MOMENTUM": True, "NESTEROV": False, "FIRST_RUN": False,
                    "VERIFY": True, "BLOCK": 4096, "ALIGNED": True, **APEX_HP_DEVICE_VERIFY,
                },
            ),
            "sgd on the device: the update": (
                "_sgd_kernel",
                {
                    "P_DTYPE": "float32", "G_DTYPE": "float32", "MODEL_DTYPE": "float32", "HAS_MODEL": False,
                    "WD": True, "WD_AFTER": True, "MOMENTUM": True, "NESTEROV": True, "FIRST_RUN": False,
                    "VERIFY": False, "BLOCK": 4096, "ALIGNED": True, **APEX_HP_DEVICE,
                },
            ),
        },
    )
    # (the check-and-verify launch stores nothing but its flags)
    assert all(r["v4_loads"] > 0 and (r["v4_stores"] > 0 or "verify" in name) for name, r in result.items()), result


def test_lr_may_come_from_every_param_group_alone():
    """apex's FusedSGD (and its amp tests) leave ``lr`` out when each group sets one."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = FusedSGD([{"params": [a], "lr": 0.25}, {"params": [b], "lr": 0.5}], momentum=0.125)
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    assert torch.equal(a.detach(), torch.full((3,), 0.75)) and torch.equal(b.detach(), torch.full((2,), 0.5))
    with pytest.raises(TypeError, match="lr is required"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
