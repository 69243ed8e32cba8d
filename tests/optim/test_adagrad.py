"""FusedAdagrad (apex's constructor and math) against the float64 reference and torch.optim.Adagrad, on both
backends; checkpoints, bad input (edge values, skipping, scalers, amp O2: ``test_apex_contracts.py``).

Tolerances: ``apex_optim_helpers.adagrad_step_and_check`` budgets; against torch (both fp32) twice the budget.
"""

from __future__ import annotations

import pytest
import torch
from apex_optim_helpers import (
    APEX_HP_DEVICE,
    APEX_HP_DEVICE_VERIFY,
    APEX_HP_LEGACY,
    SHAPES,
    adagrad_step_and_check,
    apex_reference_tests,
    assert_backends_agree,
    compile_for_sm90,
    step_both_backends,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import U32, K, assert_within, clone_params, make_params, set_grads

from fp16kit.optim import FusedAdagrad

test_matches_reference_torch_backend, test_matches_reference_triton_interpreter = apex_reference_tests(
    FusedAdagrad,
    adagrad_step_and_check,
    {
        "lr": st.sampled_from([1e-3, 1e-2, 0.5]),
        "eps": st.sampled_from([1e-10, 1e-6, 1.0]),
        "weight_decay": st.sampled_from([0.0, 1e-4, 0.1]),
        "adagrad_w_mode": st.booleans(),
    },
    examples=40,
    interpreter_examples=6,
)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("dtype", "kw"),
    [
        (torch.float32, {"weight_decay": 0.01}),
        (torch.float16, {"weight_decay": 0.01, "adagrad_w_mode": True}),
        (torch.bfloat16, {"master_weights": True}),
    ],
)
def test_backends_agree(dtype, kw):
    """Triton kernel (interpreter) and torch fallback on the same inputs, each against the reference, then
    against each other. Not bit for bit: torch's CPU sqrt is not correctly rounded (measured: 0.7% of fp32
    inputs differ by 1 ulp from the rounded float64 sqrt), the kernel's ``sqrt_rn`` is. |u| <= 1 + wd|p|
    (``h >= g^2``), so one ulp in u and one rounding of p give at most ``2 u (|p| + lr (1 + wd |p|))``."""
    run = step_both_backends(lambda ps: FusedAdagrad(ps, lr=0.1, **kw), adagrad_step_and_check, dtype, 2)
    wd = kw.get("weight_decay", 0.0)
    assert_backends_agree(run, dtype, lambda i, q64: 2 * U32 * (q64.abs() + 0.1 * (1 + wd * q64.abs())))


@settings(max_examples=25, deadline=None)
@given(
    shapes=SHAPES,
    seed=st.integers(0, 2**16),
    weight_decay=st.sampled_from([0.0, 0.01]),
    eps=st.sampled_from([1e-10, 1e-3]),
    foreach=st.booleans(),
)
def test_matches_torch_optim_adagrad(shapes, seed, weight_decay, eps, foreach):
    """torch.optim.Adagrad (lr_decay=0, initial_accumulator_value=0) beside ours: the same math when
    adagrad_w_mode=False. 3 steps, torch restarted from our state each step."""
    ours = make_params(shapes, torch.float32, seed)
    theirs = clone_params(ours)
    opt = FusedAdagrad(ours, lr=0.05, eps=eps, weight_decay=weight_decay)
    ref = torch.optim.Adagrad(theirs, lr=0.05, eps=eps, weight_decay=weight_decay, foreach=foreach)
    for k in range(3):
        p0 = [p.detach().double() for p in ours]
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(ours, theirs)):
            h = opt.state[p]["sum"].double()
            a = p.grad.double().abs() + weight_decay * p0[i].abs()
            budget = 2 * K * U32 * (p0[i].abs() + 2 * 0.05 * a / (h.sqrt() + eps))
            assert_within(p, q.detach().double(), budget, f"param {i} at step {k + 1}")
        set_grads(ours, seed + k + 1)
        for p, q in zip(ours, theirs):
            q.grad = p.grad.clone()
            with torch.no_grad():
                q.copy_(p)
            ref.state[q]["sum"].copy_(opt.state[p]["sum"])


def test_never_updated_entries_stay_finite():
    """An entry whose gradient has always been 0 has sum 0: the update is 0 / (0 + eps) = 0, never NaN."""
    params = make_params([(4,)], torch.float16, 0, zero_grads=(0,))
    p0 = params[0].detach().clone()
    FusedAdagrad(params, eps=1e-10).step()
    assert torch.equal(params[0].detach(), p0)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"lr": -0.1}, ValueError, "learning rate"),
        ({"lr": float("inf")}, ValueError, "learning rate"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"eps": float("nan")}, ValueError, "eps"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay"),
        ({"lr": "big"}, TypeError, "lr"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FusedAdagrad(make_params([(3,)], torch.float32, 0), **kwargs)
    opt = FusedAdagrad(make_params([(3,)], torch.float32, 0))
    with pytest.raises(exc, match=match):
        opt.add_param_group({"params": make_params([(2,)], torch.float32, 1), **kwargs})


def test_kernel_compiles_for_sm90_with_vector_memory_ops():
    """No GPU needed: the Adagrad kernel compiles for sm_90, and full chunks use 16-byte loads and stores."""
    result = compile_for_sm90(
        "adagrad",
        {
            "adagrad fp16, L2": (
                "_adagrad_kernel",
                {
                    "P_DTYPE": "float16",
                    "G_DTYPE": "float16",
                    "MODEL_DTYPE": "float16",
                    "HAS_MODEL": False,
                    "L2_MODE": True,
                    "DECOUPLED": False,
                    "VERIFY": False,
                    "BLOCK": 4096,
                    "ALIGNED": True,
                    **APEX_HP_LEGACY,
                },
            ),
            "adagrad on the device: check and verify, bf16": (
                "_adagrad_kernel",
                {
                    "P_DTYPE": "bfloat16", "G_DTYPE": "bfloat16", "MODEL_DTYPE": "bfloat16", "HAS_MODEL": False,
                    "L2_MODE": True, "DECOUPLED": False, "VERIFY": True, "BLOCK": 4096, "ALIGNED": True,
                    **APEX_HP_DEVICE_VERIFY,
                },
            ),
            "adagrad on the device: the update, fp32 masters -> fp16 model": (
                "_adagrad_kernel",
                {
                    "P_DTYPE": "float32", "G_DTYPE": "float16", "MODEL_DTYPE": "float16", "HAS_MODEL": True,
                    "L2_MODE": False, "DECOUPLED": True, "VERIFY": False, "BLOCK": 4096, "ALIGNED": True,
                    **APEX_HP_DEVICE,
                },
            ),
        },
    )
    # (the check-and-verify launch stores nothing but its flags)
    assert all(r["v4_loads"] > 0 and (r["v4_stores"] > 0 or "verify" in name) for name, r in result.items()), result
