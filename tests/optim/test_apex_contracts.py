"""The checks FusedSGD, FusedAdagrad and FusedNovoGrad share (``apex_optim_helpers``), each optimizer an entry
crossed by every check: Hypothesis-drawn steps against the float64 reference (default backend and Triton
interpreter), the Triton kernels and the torch fallback against each other, edge values on both backends, a
non-finite gradient skips the step, loss scalers (torch's and fp16kit's), amp O2, and the state_dict round trip
and mismatch. What only one of them does is tested in its own file (``test_sgd.py``, ``test_adagrad.py``,
``test_novograd.py``).
"""

from __future__ import annotations

import pytest
import torch
from apex_optim_helpers import (
    adagrad_step_and_check,
    apex_reference_tests,
    assert_backends_agree,
    check_amp_o2,
    check_edge_values,
    check_grad_scaler,
    check_nonfinite_grad_skips,
    check_state_dict_round_trip,
    novograd_step_and_check,
    sgd_step_and_check,
    step_both_backends,
)
from hypothesis import strategies as st
from optim_helpers import U32, assert_within

from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdagrad, FusedNovoGrad, FusedSGD

# -- FusedSGD ------------------------------------------------------------------------------------------------


def _sgd(params, *, momentum, dampening, nesterov, **kw):
    """FusedSGD with Nesterov only where it is valid (momentum > 0, no dampening)."""
    nesterov = nesterov and momentum > 0 and dampening == 0
    return FusedSGD(params, momentum=momentum, dampening=dampening, nesterov=nesterov, **kw)


SGD_DRAWS = {
    "lr": st.sampled_from([1e-3, 0.1, 1.0]),
    "momentum": st.sampled_from([0.0, 0.5, 0.9]),
    "dampening": st.sampled_from([0.0, 0.1]),
    "nesterov": st.booleans(),
    "weight_decay": st.sampled_from([0.0, 1e-4, 0.1]),
    "wd_after_momentum": st.booleans(),
}


def _sgd_backends_agree(run, dtype, kw):
    """Tensors of 4100 elements span two chunks. The host fallback uses torch's fused ``x + alpha * y`` (one
    rounding or two, as the CPU kernel vectorizes), the kernel a multiply and an add: the results differ by at most
    a rounding of the update and one of p (plus an ulp of a 16-bit store)."""
    wd = kw.get("weight_decay", 0.0)

    def budget(i, q64):
        m = run["fb"].state[run["twin"][i]]["momentum_buffer"].double().abs()
        # magnitudes that enter the last update (its terms may cancel): roundings are relative to them
        mag = run["grads"][i].abs() + wd * q64.abs() + 2 * m
        return 4 * U32 * (q64.abs() + 0.1 * mag)

    assert_backends_agree(run, dtype, budget)


# -- FusedAdagrad --------------------------------------------------------------------------------------------

ADAGRAD_DRAWS = {
    "lr": st.sampled_from([1e-3, 1e-2, 0.5]),
    "eps": st.sampled_from([1e-10, 1e-6, 1.0]),
    "weight_decay": st.sampled_from([0.0, 1e-4, 0.1]),
    "adagrad_w_mode": st.booleans(),
}


def _adagrad_backends_agree(run, dtype, kw):
    """Not bit for bit: torch's CPU sqrt is not correctly rounded (measured: 0.7% of fp32 inputs differ by 1 ulp
    from the rounded float64 sqrt), the kernel's ``sqrt_rn`` is. |u| <= 1 + wd|p| (``h >= g^2``), so one ulp in u
    and one rounding of p give at most ``2 u (|p| + lr (1 + wd |p|))`` (lr = 0.1)."""
    wd = kw.get("weight_decay", 0.0)
    assert_backends_agree(run, dtype, lambda i, q64: 2 * U32 * (q64.abs() + 0.1 * (1 + wd * q64.abs())))


# -- FusedNovoGrad -------------------------------------------------------------------------------------------

NOVOGRAD_DRAWS = {
    "lr": st.sampled_from([1e-3, 1e-2, 0.1]),
    "betas": st.sampled_from([(0.9, 0.999), (0.95, 0.98), (0.0, 0.5)]),
    "eps": st.sampled_from([1e-8, 1e-3]),
    "weight_decay": st.sampled_from([0.0, 1e-3, 0.1]),
    "reg_inside_moment": st.booleans(),
    "grad_averaging": st.booleans(),
    "bias_correction": st.booleans(),
    "norm_type": st.sampled_from([0, 2]),
    "init_zero": st.booleans(),
}


def _novograd_backends_agree(run, dtype, kw):
    """Per-tensor norms across two chunks and two programs, then the update: the norms may differ by a few fp32
    roundings (summation order), which moves each update by a few ulp; the blended norms ``v`` themselves agree
    to 1e-6."""

    def budget(i, q64):
        update = (q64 - run["before"][i]).abs()  # the fallback's last update: norms off by 1e-6 move it by 1e-6 of it
        return 4 * U32 * q64.abs() + 1e-6 * update

    assert_backends_agree(run, dtype, budget)
    for i, (p, q) in enumerate(zip(run["params"], run["twin"])):
        v1, v2 = run["opt"].state[p]["exp_avg_sq"].double(), run["fb"].state[q]["exp_avg_sq"].double()
        assert_within(v1, v2, 1e-6 * v2.abs(), f"exp_avg_sq {i}: kernel vs fallback")


# -- the checks ----------------------------------------------------------------------------------------------

#: each optimizer's two Hypothesis tests against its float64 reference (``apex_reference_tests``)
REFERENCE = {
    "FusedSGD": apex_reference_tests(_sgd, sgd_step_and_check, SGD_DRAWS),
    "FusedAdagrad": apex_reference_tests(FusedAdagrad, adagrad_step_and_check, ADAGRAD_DRAWS),
    "FusedNovoGrad": apex_reference_tests(
        FusedNovoGrad, novograd_step_and_check, NOVOGRAD_DRAWS, examples=50, interpreter_examples=8
    ),
}


@pytest.mark.parametrize("name", list(REFERENCE))
def test_matches_reference_torch_backend(name):
    """1 to 3 steps on the default backend, each within budget of the float64 reference."""
    REFERENCE[name][0]()


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(REFERENCE))
def test_matches_reference_triton_interpreter(name):
    """2 steps on the Triton kernels (interpreter), each within budget of the float64 reference."""
    REFERENCE[name][1]()


#: optimizer -> (its constructor at the backends test's lr, its step check, the params' seed, the comparison)
BACKENDS = {
    "FusedSGD": (lambda ps, kw: FusedSGD(ps, lr=0.1, **kw), sgd_step_and_check, 1, _sgd_backends_agree),
    "FusedAdagrad": (lambda ps, kw: FusedAdagrad(ps, lr=0.1, **kw), adagrad_step_and_check, 2, _adagrad_backends_agree),
    "FusedNovoGrad": (
        lambda ps, kw: FusedNovoGrad(ps, lr=0.01, **kw), novograd_step_and_check, 3, _novograd_backends_agree
    ),
}


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("name", "dtype", "kw"),
    [
        ("FusedSGD", torch.float32, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
        (
            "FusedSGD",
            torch.float16,
            {"momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "wd_after_momentum": True},
        ),
        ("FusedSGD", torch.bfloat16, {"momentum": 0.5, "master_weights": True}),
        ("FusedAdagrad", torch.float32, {"weight_decay": 0.01}),
        ("FusedAdagrad", torch.float16, {"weight_decay": 0.01, "adagrad_w_mode": True}),
        ("FusedAdagrad", torch.bfloat16, {"master_weights": True}),
        ("FusedNovoGrad", torch.float32, {"weight_decay": 0.01, "norm_type": 2}),
        ("FusedNovoGrad", torch.float16, {"weight_decay": 0.01, "norm_type": 0, "reg_inside_moment": True}),
        ("FusedNovoGrad", torch.bfloat16, {"norm_type": 2, "init_zero": True, "master_weights": True}),
    ],
)
def test_backends_agree(name, dtype, kw):
    """Triton kernels (interpreter) and the torch fallback on the same inputs, each checked against the reference,
    then against each other within the optimizer's bound (its ``_*_backends_agree`` says why)."""
    make, step_and_check, seed, agree = BACKENDS[name]
    run = step_both_backends(lambda ps: make(ps, kw), step_and_check, dtype, seed)
    agree(run, dtype, kw)


def _makers(**makers):
    """Parametrize ``make`` (params -> optimizer) by the optimizers' names."""
    return pytest.mark.parametrize("make", list(makers.values()), ids=list(makers))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize(
    ("make", "step_and_check"),
    [
        pytest.param(
            lambda ps: FusedSGD(ps, lr=1e-3, momentum=0.9, weight_decay=1e-4, nesterov=True),
            sgd_step_and_check,
            id="FusedSGD",
        ),
        pytest.param(
            lambda ps: FusedAdagrad(ps, lr=1e-3, weight_decay=1e-4), adagrad_step_and_check, id="FusedAdagrad"
        ),
        *(
            pytest.param(
                lambda ps, n=norm_type: FusedNovoGrad(ps, lr=1e-3, weight_decay=1e-4, norm_type=n),
                novograd_step_and_check,
                id=f"FusedNovoGrad-norm_type{norm_type}",
            )
            for norm_type in (0, 2)
        ),
    ],
)
def test_edge_values(make, step_and_check, backend, dtype):
    """±0, subnormals, tiny and huge values (as params and grads), an all-zero gradient and an all-zero param:
    finite results within budget of the float64 reference, on both backends."""
    with use_backend(backend):
        check_edge_values(make, step_and_check, dtype)


@_makers(
    FusedSGD=lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, master_weights=True),
    FusedAdagrad=lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.01),
    FusedNovoGrad=lambda ps: FusedNovoGrad(ps, lr=0.01, weight_decay=0.01),
)
def test_nonfinite_grad_skips(make):
    check_nonfinite_grad_skips(make)


@pytest.mark.parametrize("scaler_kind", ["torch", "fp16kit"])
@_makers(
    FusedSGD=lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    FusedAdagrad=lambda ps: FusedAdagrad(ps, lr=0.05, weight_decay=0.01, adagrad_w_mode=True),
    FusedNovoGrad=lambda ps: FusedNovoGrad(ps, lr=0.01, weight_decay=0.01, norm_type=0),
)
def test_with_grad_scaler(make, scaler_kind):
    check_grad_scaler(make, scaler_kind)


@_makers(
    FusedSGD=lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
    FusedAdagrad=lambda ps: FusedAdagrad(ps, lr=0.05),
    FusedNovoGrad=lambda ps: FusedNovoGrad(ps, lr=0.01),
)
def test_amp_o2(make):
    check_amp_o2(make)


@_makers(
    FusedSGD=lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    FusedAdagrad=lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.01, master_weights=True),
    FusedNovoGrad=lambda ps: FusedNovoGrad(ps, lr=0.01, weight_decay=0.01, reg_inside_moment=True),
)
def test_state_dict_round_trip_and_mismatch(make):
    check_state_dict_round_trip(make)
