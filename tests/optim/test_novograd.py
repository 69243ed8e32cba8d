"""FusedNovoGrad (apex's constructor and math): the per-tensor second moment and its first step, params gaining a
gradient later, apex checkpoints, bad input, the kernels' sm_90 code. The float64 reference on both backends (L2
and inf norms, both moment modes, init_zero, grad_averaging, bias_correction), edge values, skipping, scalers and
amp O2: ``test_apex_contracts.py``.

Tolerances: ``apex_optim_helpers.novograd_step_and_check`` budgets (fp32 chains; per-tensor norms to gamma(n)).
"""

from __future__ import annotations

import pytest
import torch
from apex_optim_helpers import (
    APEX_HP_DEVICE,
    APEX_HP_DEVICE_VERIFY,
    APEX_HP_LEGACY,
    compile_for_sm90,
    novograd_step_and_check,
)
from optim_helpers import clone_params, make_params

from fp16kit.optim import FusedNovoGrad


def test_per_layer_second_moment_and_first_step_init():
    """v is one number per tensor: the blended gradient norm. First step: v = |g| (init_zero=False), so the
    first update is lr * g / |g| (+ bias corrections); with init_zero=True v = sqrt(1 - b2) |g|."""
    for norm_type, norm in ((2, lambda g: g.norm()), (0, lambda g: g.abs().max())):
        params = make_params([(10,), (3, 4)], torch.float32, 5)
        g = [p.grad.clone() for p in params]
        opt = FusedNovoGrad(params, norm_type=norm_type, bias_correction=False)
        opt.step()
        for p, gi in zip(params, g):
            v = opt.state[p]["exp_avg_sq"]
            assert v.shape == (1,) and v.dtype == torch.float32
            torch.testing.assert_close(v[0], norm(gi), rtol=4e-7, atol=0)
        z = make_params([(10,)], torch.float32, 5)
        opt = FusedNovoGrad(z, norm_type=norm_type, init_zero=True, betas=(0.9, 0.75), bias_correction=False)
        opt.step()
        want = (0.25**0.5 if norm_type == 2 else 0.25) * norm(z[0].grad)
        torch.testing.assert_close(opt.state[z[0]]["exp_avg_sq"][0], want, rtol=4e-7, atol=0)


def test_param_gaining_a_grad_later_starts_its_own_moment():
    """A param without a grad in step 1 gets its v initialized at its own first step (apex keeps one v tensor
    per group and dtype, and asserts when the number of params with grads changes)."""
    a = make_params([(6,)], torch.float32, 6)
    b = make_params([(4,)], torch.float32, 7)
    grad_b = b[0].grad
    b[0].grad = None
    opt = FusedNovoGrad(a + b, weight_decay=0.01)
    novograd_step_and_check(opt)
    b[0].grad = grad_b
    novograd_step_and_check(opt)
    novograd_step_and_check(opt)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"amsgrad": True}, RuntimeError, "AMSGrad"),
        ({"lr": -1.0}, ValueError, "learning rate"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"betas": (0.9, 1.0)}, ValueError, "beta2"),
        ({"betas": (float("nan"), 0.9)}, ValueError, "beta1"),
        ({"weight_decay": float("inf")}, ValueError, "weight_decay"),
        ({"norm_type": 1}, ValueError, "norm_type"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        FusedNovoGrad(make_params([(3,)], torch.float32, 0), **kwargs)


def test_apex_checkpoint_without_per_param_moment():
    """An apex checkpoint keeps v in the group, not per param: the per-param v starts again from the first
    step's norm (as for a new param); the first moment is kept."""
    params = make_params([(6,), (2, 3)], torch.float32, 9)
    opt = FusedNovoGrad(params, weight_decay=0.01)
    opt.step()
    saved = opt.state_dict()
    for s in saved["state"].values():
        del s["exp_avg_sq"]
    opt2 = FusedNovoGrad(clone_params(params), weight_decay=0.01)
    opt2.load_state_dict(saved)
    novograd_step_and_check(opt2)


def test_kernels_compile_for_sm90_with_vector_memory_ops():
    """No GPU needed: the NovoGrad update and inf-norm kernels compile for sm_90 with 16-byte loads (and stores)."""
    result = compile_for_sm90(
        "novograd",
        {
            "novograd update fp32 -> bf16 model": (
                "_novograd_kernel",
                {
                    "P_DTYPE": "float32",
                    "G_DTYPE": "bfloat16",
                    "MODEL_DTYPE": "bfloat16",
                    "HAS_MODEL": True,
                    "REG_INSIDE": False,
                    "VERIFY": False,
                    "BLOCK": 4096,
                    "ALIGNED": True,
                    **APEX_HP_LEGACY,
                },
            ),
            "novograd on the device: check and verify, fp16 grads": (
                "_novograd_kernel",
                {
                    "P_DTYPE": "float32", "G_DTYPE": "float16", "MODEL_DTYPE": "float16", "HAS_MODEL": True,
                    "REG_INSIDE": True, "VERIFY": True, "BLOCK": 4096, "ALIGNED": True, **APEX_HP_DEVICE_VERIFY,
                },
            ),
            "novograd on the device: the update": (
                "_novograd_kernel",
                {
                    "P_DTYPE": "float32", "G_DTYPE": "float32", "MODEL_DTYPE": "float32", "HAS_MODEL": False,
                    "REG_INSIDE": False, "VERIFY": False, "BLOCK": 4096, "ALIGNED": True, **APEX_HP_DEVICE,
                },
            ),
            "novograd on the device: norms, moments, denominators": (
                "_novograd_prepare_kernel",
                {"LR_TENSOR": False, "BIAS_CORRECTION": True, "INIT_ZERO": False},
                {"partials_ptr": "*fp64"},
            ),
            "novograd absmax fp16": ("_absmax_kernel", {"IN_DTYPE": "float16", "BLOCK": 4096, "ALIGNED": True}),
        },
    )
    assert result["novograd update fp32 -> bf16 model"]["v4_stores"] > 0, result
    assert all(r["v4_loads"] > 0 for name, r in result.items() if "norms, moments" not in name), result
