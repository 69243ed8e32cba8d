"""FusedAdagrad (apex's constructor and math) against torch.optim.Adagrad; entries that never had a gradient,
checkpoints, bad input, the kernel's sm_90 code. The float64 reference on both backends, edge values, skipping,
scalers and amp O2: ``test_apex_contracts.py``.

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
    compile_for_sm90,
    restart_torch_from,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import U32, K, assert_within, clone_params, make_params

from fp16kit.optim import FusedAdagrad


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
        restart_torch_from(opt, ref, ours, theirs, seed + k + 1, "sum")


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
