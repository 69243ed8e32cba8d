"""The fused optimizers vouch for their rows (``fp16kit.kernels.vouched_rows``, fp16kit/kernels/engine/plan.py
``vouched``): the per-group verdict of ``fp16kit/optim/_rows.py`` has just checked the rows' metadata with its own
guard, so the planner skips its metadata guard for exactly those lists when its entry was made or last checked under
the same verdict. These tests pin down that the skip happens on steady-state steps, that a step never uses a plan
made for other metadata (a changed param, moment or grad makes a new verdict, hence a guard check or a new plan), and
that the results are bitwise those of steps that never skip.
"""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels.engine import plan as _plan
from fp16kit.optim import FusedAdam, FusedLAMB


class _Counting:
    """A guard that counts its checks (wraps the planner's own guard; the optimizer's verdict guard is one too)."""

    checks = 0

    def __init__(self, flat):
        self.inner = _plan._PyGuard(flat) if _plan.make_guard is _plan._PyGuard else _plan._torch_guard(flat)

    def check(self, *flat):
        type(self).checks += 1
        return self.inner.check(*flat)


@pytest.fixture(autouse=True)
def _clean():
    _plan.clear()
    yield
    _plan.clear()


def _model(n=5, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4)) for _ in range(n)]


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedLAMB])
def test_steady_steps_skip_the_planner_guard(monkeypatch, opt_cls):
    monkeypatch.setattr(_plan, "make_guard", _Counting)
    params = _model()
    opt = opt_cls(params, lr=1e-2)
    for _ in range(3):
        for p in params:
            p.grad = torch.full((4,), 0.1)
        opt.step()
    _Counting.checks = 0
    plans = _plan.stats["plans"]
    for _ in range(3):
        for p in params:
            p.grad = torch.full((4,), 0.1)  # new grads (loose rows): still a hit
        opt.step()
    assert _plan.stats["plans"] == plans
    assert _Counting.checks == 3  # the verdict's guard (``metadata_guard`` is the planner's), once per step


def _run(opt_cls, vouch: bool, monkeypatch) -> list[torch.Tensor]:
    """Steps with fresh grads, a param moved to new storage (``.data =``), a param group's list edited, and a
    moment replaced by hand: each forces a new verdict. Returns params and moments."""
    _plan.clear()
    if not vouch:
        monkeypatch.setattr(_plan, "_vouch_token", lambda rows: None)
    params = _model(seed=1)
    opt = opt_cls(params, lr=1e-2, weight_decay=0.01)
    for step in range(8):
        for i, p in enumerate(params):
            p.grad = torch.full((4,), 0.05 * (i + 1) * (step + 1))
        if step == 3:
            params[2].data = params[2].detach().clone()  # same metadata, new address
        if step == 5:
            st = opt.state[params[1]]
            st["exp_avg"] = st["exp_avg"].clone()  # replaced moment: a new verdict
        opt.step()
    monkeypatch.undo()
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()]
    return out


@pytest.mark.parametrize("opt_cls", [FusedAdam, FusedLAMB])
def test_vouched_steps_equal_guarded_steps(monkeypatch, opt_cls):
    with_vouch = _run(opt_cls, True, monkeypatch)
    without = _run(opt_cls, False, monkeypatch)
    for a, b in zip(with_vouch, without):
        assert torch.equal(a, b)


def test_a_vouch_covers_only_the_lists_it_names():
    """Other list objects (even with the same tensors) and aux tensors get the guard; outside the block, nothing
    is vouched."""
    rows = ([torch.ones(3)], [torch.ones(3)])
    spec = _plan.Spec("t", ("a", "b"), written=(0,), key_rows=(0, 1))
    token = object()
    with _plan.vouched(token, rows):
        assert _plan._vouch_token(rows) is token
        assert _plan._vouch_token((list(rows[0]), rows[1])) is None
        _plan.plan(spec, rows)
    assert _plan._vouch_token(rows) is None
