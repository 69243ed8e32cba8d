"""The checks FusedSGD, FusedAdagrad and FusedNovoGrad share (``apex_optim_helpers``), each optimizer in its own
configuration: edge values against the float64 reference on both backends, a non-finite gradient skips the step,
loss scalers (torch's and fp16kit's), amp O2, and the state_dict round trip and mismatch. What only one of them
does is tested in its own file (``test_sgd.py``, ``test_adagrad.py``, ``test_novograd.py``).
"""

from __future__ import annotations

import pytest
import torch
from apex_optim_helpers import (
    adagrad_step_and_check,
    check_amp_o2,
    check_edge_values,
    check_grad_scaler,
    check_nonfinite_grad_skips,
    check_state_dict_round_trip,
    novograd_step_and_check,
    sgd_step_and_check,
)

from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdagrad, FusedNovoGrad, FusedSGD


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
