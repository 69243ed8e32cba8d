"""Finite gradients whose square would overflow the second moment skip the step (issue: trust round 3, item 2).

``v = beta2 * v + (1 - beta2) * g * g`` becomes inf for finite fp32 grads above ~5.8e20 (before this guard:
``exp_avg_sq`` inf, the element frozen for ever). FusedAdam and FusedLAMB without clipping treat ``|g| >= 2**63``
(after unscaling) like inf/NaN: nothing is written, the step counter stays, the skip is reported or handed to the
loss scaler. LAMB with clipping divides the gradients by the clip factor first, so it steps.
"""

from __future__ import annotations

import pytest
import torch

from fp16kit.amp import GradScaler
from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdam, FusedLAMB

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]


def _make(kind: str, ps: list[torch.Tensor], **kw) -> torch.optim.Optimizer:
    if kind == "adam":
        return FusedAdam(ps, lr=1e-3, on_nonfinite="skip", **kw)
    return FusedLAMB(ps, lr=1e-3, max_grad_norm=0.0, on_nonfinite="skip", **kw)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g).requires_grad_() for n in (5, 300)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return ps


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("big", [2.0**63, 1e20, 3e38])
def test_finite_grad_that_would_overflow_v_skips(backend, kind, big):
    ps = _params()
    with use_backend(backend):
        opt = _make(kind, ps)
        opt.step()
        before = [p.detach().clone() for p in ps]
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
        ps[1].grad[7] = big
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    for p, old in zip(ps, state):
        for k, v in old.items():
            assert torch.equal(opt.state[p][k], v), k
    assert opt.param_groups[0]["step"].item() == 1.0
    assert int(opt.nonfinite_skips.item()) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_just_below_the_guard_steps_and_stays_finite(backend, kind):
    ps = _params()
    with use_backend(backend):
        opt = _make(kind, ps)
        ps[1].grad[7] = 2.0**63 * (1 - 2.0**-23)  # the largest fp32 value below 2**63
        for _ in range(3):
            opt.step()
    assert opt.param_groups[0]["step"].item() == 3.0
    for p in ps:
        assert torch.isfinite(p).all()
        assert all(torch.isfinite(v).all() for v in opt.state[p].values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_scaler_backs_off_on_a_huge_finite_grad(backend):
    ps = _params()
    with use_backend(backend):
        opt = FusedAdam(ps, lr=1e-3)
        scaler = GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))
        ps[0].grad[0] = 1e20 * 4.0  # scaled: 1e20 after unscaling
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0
    assert opt.param_groups[0].get("step") is None or opt.param_groups[0]["step"].item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_clipped_lamb_steps_on_a_huge_finite_grad(backend):
    ps = _params()
    with use_backend(backend):
        opt = FusedLAMB(ps, lr=1e-3, max_grad_norm=1.0, on_nonfinite="skip")
        ps[1].grad[7] = 1e20
        opt.step()
    assert opt.param_groups[0]["step"].item() == 1.0
    for p in ps:
        assert all(torch.isfinite(v).all() for v in opt.state[p].values())
