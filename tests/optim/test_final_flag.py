"""Final ``found_inf`` hand-overs (fp16kit/kernels/found_inf.py, "Final flags").

amp O2's fused-masters path declares its exit flag final when every grad the step reads is the one its check read,
unmodified: FusedAdam (no norm) then skips its own check pass; FusedLAMB with clipping still runs it. Every
hand-over mode still skips a step whose grads hold inf/NaN.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

import fp16kit.optim._device_step as optim_device_step
import fp16kit.optim._host_step as optim_host_step
import fp16kit.optim.functional as optim_functional
from fp16kit import amp
from fp16kit.amp._frontend import stepping
from fp16kit.amp._frontend.masters import FusedMasterStash
from fp16kit.kernels import flag_is_final, flag_nonfinite, new_found_inf
from fp16kit.optim import FusedAdam, FusedLAMB


@pytest.fixture(autouse=True)
def _drop_pending_overflow_reports():
    yield
    stepping.REPORTS.clear()


@pytest.fixture
def checks(monkeypatch):
    """Count the optimizer's check passes (the norm pass, or the check alone of a step that needs no norm)."""
    calls = []

    def counting(real):
        def wrapper(grads, inv, flag, **kw):
            calls.append(len(grads))
            return real(grads, inv, flag, **kw)

        return wrapper

    monkeypatch.setattr(optim_functional, "check_and_norm", counting(optim_functional.check_and_norm))
    for module in (optim_host_step, optim_device_step):  # the host-vector path and the device step's torch passes
        monkeypatch.setattr(module, "flag_nonfinite", counting(module.flag_nonfinite))
    return calls


def _o2(cls, seed=0, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = cls(model.parameters(), lr=1e-2, **kw)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert isinstance(opt._amp_stash, FusedMasterStash)
    return model, opt


def _backward(model, opt, inf=False, step=0):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    loss = F.cross_entropy(model(x).float(), torch.randint(0, 4, (16,), generator=g))
    if inf:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()] + [
        t.clone() for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_o2_adam_skips_its_check_pass_with_the_same_result(checks, monkeypatch):
    model, opt = _o2(FusedAdam)
    ref_model, ref_opt = _o2(FusedAdam)
    seen = []
    for step in range(3):
        _backward(model, opt, step=step)
        done = len(checks)
        opt.step()
        opt.zero_grad()
        seen.append(len(checks) - done)
        _backward(ref_model, ref_opt, step=step)
        with monkeypatch.context() as m:  # the reference never sees a final flag: it checks every step
            m.setattr(FusedMasterStash, "_flag_covers_step", lambda self: False)
            ref_opt.step()
        ref_opt.zero_grad()
    assert seen == [0, 0, 0]
    assert len(checks) == 3  # the reference's passes
    assert _same(list(model.parameters()), list(ref_model.parameters()))


def test_o2_lamb_with_clipping_still_checks(checks):
    model, opt = _o2(FusedLAMB, max_grad_norm=1.0)
    _backward(model, opt)
    opt.step()
    assert len(checks) == 1


def test_o2_lamb_without_clipping_skips_the_check(checks):
    model, opt = _o2(FusedLAMB, max_grad_norm=0.0)
    _backward(model, opt)
    opt.step()
    assert checks == []


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
def test_o2_overflow_skips_the_step_on_the_final_path(cls, checks):
    model, opt = _o2(cls, max_grad_norm=0.0) if cls is FusedLAMB else _o2(cls)
    _backward(model, opt)
    opt.step()
    opt.zero_grad()
    before = _snapshot(model, opt)
    _backward(model, opt, inf=True, step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert checks == []  # skipped on the exit's flag alone
    assert _same(before, _snapshot(model, opt))


def test_grad_edited_after_the_exit_is_checked_again(checks):
    """An in-place edit after ``scale_loss`` (version counter bumped) voids the exit's verdict: the step checks,
    and an inf written there skips the step (a trusted stale flag would write inf into the weights)."""
    model, opt = _o2(FusedAdam)
    _backward(model, opt)
    before = _snapshot(model, opt)
    next(model.parameters()).grad[0, 0] = float("inf")
    opt.step()
    assert len(checks) == 1
    assert _same(before, _snapshot(model, opt))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_grad_replaced_after_the_exit_is_checked_again(checks):
    model, opt = _o2(FusedAdam)
    _backward(model, opt)
    before = _snapshot(model, opt)
    p = next(model.parameters())
    p.grad = torch.full_like(p.grad, float("nan"))
    opt.step()
    assert len(checks) == 1
    assert _same(before, _snapshot(model, opt))


def _plain(cls):
    torch.manual_seed(0)
    params = [torch.randn(5, requires_grad=True) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(5)
    params[1].grad[2] = float("inf")
    return params, cls(params, lr=1e-2, on_nonfinite="skip")


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
@pytest.mark.parametrize("mode", ["own", "fp16kit_zeroed", "torch_computed", "declared_final"])
def test_every_hand_over_mode_skips_a_nonfinite_step(cls, mode, checks):
    params, opt = _plain(cls)
    before = [p.detach().clone() for p in params]
    if mode == "own":
        pass
    elif mode == "fp16kit_zeroed":  # fp16kit's GradScaler: a zeroed flag, the optimizer checks
        opt.grad_scale, opt.found_inf = torch.ones(()), new_found_inf("cpu")
    elif mode == "torch_computed":  # torch's GradScaler: its computed flag, not declared final
        opt.grad_scale, opt.found_inf = torch.ones(()), torch.ones(())
    else:  # a flag declared final on a step that *needs* the norm (LAMB) is checked anyway; Adam trusts it
        opt.grad_scale, opt.found_inf, opt.found_inf_final = torch.ones(()), torch.ones(1), True
    assert flag_is_final(opt) == (mode == "declared_final")
    opt.step()
    expected = 0 if mode == "declared_final" and cls is FusedAdam else 1
    assert len(checks) == expected
    assert all(torch.equal(a, b) for a, b in zip(before, params))


_EDGES = [0.0, -0.0, 1e-7, -65504.0, 65504.0, 3.0e38, float("inf"), float("-inf"), float("nan")]


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    sizes=st.lists(st.sampled_from([0, 3, 5000, 70000]), min_size=1, max_size=4),
    inv=st.sampled_from([1.0, 2.0**-16, 0.7, 2.0**100, 2.0**127]),
    edge=st.sampled_from(_EDGES),
    where=st.integers(0, 10**6),
)
def test_exit_check_matches_the_float64_reference(dtype, sizes, inv, edge, where):
    """``flag_nonfinite`` (the O2 exit check whose flag may be final): raised exactly when some ``fp32(g) * inv``
    is inf/NaN; large tensors go through ``aminmax``, mid-sized ones through ``_foreach_abs``/``_foreach_max``,
    tiny ones through one concatenation."""
    gen = torch.Generator().manual_seed(where)
    grads = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
    target = grads[where % len(grads)]
    if target.numel():
        target[where % target.numel()] = edge  # the dtype's rounding of the edge value (may overflow to inf)
    inv_t = torch.tensor([inv], dtype=torch.float32)
    flag = new_found_inf("cpu")
    flag_nonfinite(grads, inv_t, flag)
    exact = [g.double() * float(inv_t) for g in grads]  # exact products (<= 48 significant bits)
    expected = any(bool((~torch.isfinite(x.float())).any()) for x in exact)
    assert float(flag) == float(expected)
