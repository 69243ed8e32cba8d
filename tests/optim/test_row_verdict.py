"""The remembered row check of FusedAdam/FusedLAMB (``FusedOptimizer._collect``, docs/optim.md "Host cost").

A repeated step skips the per-param ``check_row`` when every row tensor still has the metadata it was checked
with (kept grads and re-allocated grads alike); any change that the check could reject runs it again, with the
same error message as without the cache.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fp16kit.optim._rows as rows_module
from fp16kit.optim import FusedAdam, FusedLAMB


def _setup(cls, n=5, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    params = [torch.randn(3, 2, dtype=dtype, requires_grad=True) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(3, 2, dtype=dtype)
    return params, cls(params, lr=1e-2, **kw)


@pytest.fixture
def row_checks(monkeypatch):
    calls = []
    real = rows_module.check_row

    def counting(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(rows_module, "check_row", counting)
    return calls


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
@pytest.mark.parametrize("fresh", [False, True])
def test_repeated_step_skips_the_per_param_check(cls, fresh, row_checks):
    params, opt = _setup(cls)
    opt.step()
    assert len(row_checks) == len(params)
    for _ in range(3):
        if fresh:  # torch's default: zero_grad(set_to_none=True), then backward makes new grads
            for p in params:
                p.grad = torch.randn(3, 2)
        opt.step()
    assert len(row_checks) == len(params)  # no per-param check after the first step


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
def test_cached_steps_equal_unchecked_cache_free_steps(cls):
    params, opt = _setup(cls)
    ref_params, ref = _setup(cls)
    for i in range(4):
        grads = [torch.randn(3, 2) for _ in params]
        for p, q, g in zip(params, ref_params, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if i == 2:  # a param loses its grad, then gets it back
            params[1].grad = ref_params[1].grad = None
        opt.step()
        ref.__dict__["_verdicts"] = {}  # forget the verdict: every step of `ref` runs the full check
        ref.step()
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)
    for p, q in zip(params, ref_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], ref.state[q][key])


def test_bad_grad_after_cached_steps_raises_the_same_error():
    params, opt = _setup(FusedAdam)
    opt.step()
    opt.step()
    params[3].grad.data = torch.randn(7)  # torch refuses `p.grad = ` of another shape, not `.data =`
    with pytest.raises(ValueError, match=r"gradient of param_groups\[0\]\['params'\]\[3\] has shape \(7,\)"):
        opt.step()
    params[3].grad.data = torch.randn(3, 2).to(torch.int32)
    with pytest.raises(ValueError, match=r"params'\]\[3\] has dtype torch.int32"):
        opt.step()


def test_param_data_swapped_after_cached_steps_is_checked():
    params, opt = _setup(FusedAdam)
    opt.step()
    opt.step()
    params[0].data = torch.randn(5)  # same tensor object, other shape: its grad no longer fits
    with pytest.raises(ValueError, match=r"params'\]\[0\] has shape \(3, 2\) but the param has shape \(5,\)"):
        opt.step()


@pytest.mark.parametrize("bad", ["dtype", "shape", "not_tensor", "missing"])
def test_state_edited_after_cached_steps_is_checked(bad):
    params, opt = _setup(FusedLAMB)
    opt.step()
    opt.step()
    state = opt.state[params[2]]
    if bad == "dtype":
        state["exp_avg"] = torch.zeros(3, 2, dtype=torch.float64)
        match = r"state\['exp_avg'\] of param_groups\[0\]\['params'\]\[2\] has dtype torch.float64"
    elif bad == "shape":
        state["exp_avg_sq"] = torch.zeros(4)
        match = r"state\['exp_avg_sq'\] of param_groups\[0\]\['params'\]\[2\] has shape \(4,\)"
    elif bad == "not_tensor":
        state["exp_avg"] = 3.0
        match = r"state\['exp_avg'\] of param_groups\[0\]\['params'\]\[2\] is a float"
    else:
        del state["exp_avg_sq"]
        match = r"state\['exp_avg_sq'\] of param_groups\[0\]\['params'\]\[2\] is a NoneType"
    with pytest.raises(ValueError, match=match):
        opt.step()


def test_deleted_state_starts_afresh_after_cached_steps():
    params, opt = _setup(FusedAdam)
    opt.step()
    opt.step()
    del opt.state[params[1]]  # what the row check's message recommends
    opt.step()
    assert float(opt.state[params[1]]["exp_avg"].abs().max()) == pytest.approx(
        0.1 * float(params[1].grad.abs().max()), rel=1e-6
    )


def test_new_group_and_master_weights_and_copies():
    params, opt = _setup(FusedLAMB, dtype=torch.float16, master_weights=True)
    opt.step()
    opt.step()
    extra = torch.randn(4, requires_grad=True)
    extra.grad = torch.randn(4)
    opt.add_param_group({"params": [extra]})
    opt.step()
    assert "exp_avg" in opt.state[extra]
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert clone._verdicts == {}
    masters = [opt.state[p]["master"] for p in params]
    opt.state[params[0]]["master"] = torch.zeros(3, 2, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"state\['master'\] of param_groups\[0\]\['params'\]\[0\] has dtype"):
        opt.step()
    opt.state[params[0]]["master"] = masters[0]
    opt.step()
