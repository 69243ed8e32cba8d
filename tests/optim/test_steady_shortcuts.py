"""The steady step's shortcuts miss nothing the full comparison saw (fp16kit/optim/_steady.py, fp16kit/optim/_base.py).

The replay's check (``SteadyPlan.holds``) reads every row address in one pass and takes the state's and the settings'
dicts as unchanged while their version tags are (CPython's per-dict tag, changed by every entry added, removed or
rebound); ``FusedOptimizer.step`` calls torch's hook-and-profile wrapper only while something watches the step.
Each case here is a change a shortcut could hide and the check must still see: a grad, param or moment whose
storage is swapped in place (``.data =``, ``set_``, ``torch.utils.swap_tensors`` on a moment, a storage resized), a
grad re-strided in place, a state entry or dict replaced, a list hyper-parameter changed in place, a group key added,
an own setting rebound, a scaler tensor handed over, a skip counter replaced; each with the version tags in use and
without them (the fallback where the tag cannot be trusted). Then: step hooks (the optimizer's and torch's global
ones) run once per step, a subclass's own ``step`` does not run them twice, the profiler still sees
``Optimizer.step#<class>.step``, and a replayed step under ``on_nonfinite="warn"`` still warns.

Launches are replaced by a counter (the decisions alone) except in the warning test (Triton's interpreter).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from test_steady_step import _opt, _replays
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from triton.runtime.interpreter import InterpretedFunction

from fp16kit.optim import FusedAdam, FusedLAMB, _base, _steady

pytestmark = pytest.mark.interpreter


@pytest.fixture
def stubbed(monkeypatch) -> None:
    """Every Triton launch replaced by a no-op (the host logic alone)."""
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)


@pytest.fixture(params=["tags", "no-tags"])
def tags(request, monkeypatch) -> str:
    """With CPython's dict version tags, and without them (every fact compared)."""
    if request.param == "no-tags":
        monkeypatch.setattr(_steady, "_dict_version", None)
    return request.param


def _steady_state(opt) -> None:
    assert [_replays(opt) for _ in range(4)] == [False, False, False, True]


def _strided_in_place(opt, ps):
    n = ps[3].numel()
    buf = torch.zeros(2 * n)
    buf[:n] = ps[3].grad
    ps[3].grad = buf[:n]
    opt.step()  # the new grad: the full path, and the next step records it
    opt.step()
    assert _replays(opt)
    ps[3].grad.as_strided_((n,), (2,))  # the same object at the same address, read with other strides


def _moment(opt, ps, key="exp_avg_sq"):
    return opt.state[ps[4]][key]


CHANGES = {
    "grad-data-swapped": lambda opt, ps: setattr(ps[1].grad, "data", ps[1].grad.clone()),
    "grad-set_": lambda opt, ps: ps[1].grad.set_(ps[1].grad.clone()),
    "grad-re-strided-in-place": _strided_in_place,
    "param-data-swapped": lambda opt, ps: setattr(ps[0], "data", ps[0].data.clone()),
    "param-set_": lambda opt, ps: ps[0].set_(ps[0].detach().clone()),
    "moment-data-swapped": lambda opt, ps: setattr(_moment(opt, ps), "data", _moment(opt, ps).clone()),
    "moment-set_": lambda opt, ps: _moment(opt, ps, "exp_avg").set_(_moment(opt, ps, "exp_avg").clone()),
    "moment-swap_tensors": lambda opt, ps: torch.utils.swap_tensors(_moment(opt, ps), _moment(opt, ps).clone()),
    "moment-storage-resized": lambda opt, ps: _moment(opt, ps).untyped_storage().resize_(4096),
    "state-entry-replaced": lambda opt, ps: opt.state[ps[2]].__setitem__("exp_avg", opt.state[ps[2]]["exp_avg"] * 1),
    "state-dict-replaced-same-tensors": lambda opt, ps: opt.state.__setitem__(ps[2], dict(opt.state[ps[2]])),
    "state-entry-added": lambda opt, ps: opt.state.__setitem__(torch.zeros(1), {}),
    "list-hyper-parameter-in-place": lambda opt, ps: opt.param_groups[0]["betas"].__setitem__(1, 0.99),
    "group-key-added": lambda opt, ps: opt.param_groups[0].__setitem__("note", 1),
    "lr-rebound": lambda opt, ps: opt.param_groups[0].__setitem__("lr", 2e-3),
    "own-setting-rebound": lambda opt, ps: setattr(opt, "set_grad_none", not opt.set_grad_none),
    "grad-scale-handed-over": lambda opt, ps: setattr(opt, "grad_scale", torch.ones(())),
    "skip-counter-replaced": lambda opt, ps: opt._skip_counts.__setitem__(
        "nonfinite_skips", torch.zeros(1, dtype=torch.int64)
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
def test_a_change_behind_a_shortcut_takes_the_full_path(change, cls, tags, stubbed):
    opt, ps = _opt(cls, betas=[0.9, 0.999])  # a list: changed in place by one case
    _steady_state(opt)
    with torch.no_grad():
        CHANGES[change](opt, ps)
    try:
        replayed = _replays(opt)
    except ValueError:  # the full path's row check refused the change (a re-strided or moved row): not replayed
        replayed = False
    assert not replayed, change


def test_equal_facts_behind_moved_tags_still_replay(tags, stubbed):
    """A tag that moved with the facts unchanged (a value rebound to an equal one, a state dict set to itself)
    falls back to comparing the facts, and they hold: the step replays."""
    opt, ps = _opt()
    _steady_state(opt)
    opt.param_groups[0]["lr"] = float("1e-3")  # another float object, the same value
    opt.state[ps[0]] = opt.state[ps[0]]
    opt.set_grad_none = bool(opt.set_grad_none)
    assert _replays(opt)


def test_the_dict_version_probe_trusts_this_python():
    """CPython 3.10-3.13 keep the per-dict version tag the shortcut reads; the probe says so (elsewhere it returns
    None and every fact is compared, the no-tags cases above)."""
    version = _steady._probe_dict_version()
    assert version is not None
    d = {"a": 1}
    before = version(d)
    d["a"] = 2
    assert version(d) != before


def test_the_plan_does_not_hold_the_optimizers_own_dict(stubbed):
    """The own attributes' dict is compared by id and tag, not held: holding it would tie the optimizer's dict and
    its recorded plan in a reference cycle (its tensors freed only by the cyclic collector)."""
    opt, _ps = _opt()
    _steady_state(opt)
    plan = opt._step_cache["steady"]
    assert not any(r is opt.__dict__ for r in gc.get_referents(plan))


# -- torch's step hooks and the profiler ----------------------------------------------------------------------------


def test_step_hooks_run_once_per_step_and_the_steps_still_replay(stubbed):
    opt, _ps = _opt()
    calls = []
    handles = [
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre")),
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post")),
        register_optimizer_step_pre_hook(lambda o, args, kwargs: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda o, args, kwargs: calls.append("global post")),
    ]
    try:
        replayed = [_replays(opt) for _ in range(5)]
    finally:
        for h in handles:
            h.remove()
    assert replayed == [False, False, False, True, True]
    assert calls == ["global pre", "pre", "post", "global post"] * 5
    calls.clear()
    assert _replays(opt)
    assert calls == []  # removed: the step runs without torch's wrapper again


def test_a_pre_hook_that_returns_new_arguments_is_honoured(stubbed):
    """torch's contract: a pre hook may return ``(args, kwargs)`` for the step (here: a closure)."""
    opt, _ps = _opt()
    seen = []
    closure = lambda: seen.append("closure")
    handle = opt.register_step_pre_hook(lambda o, args, kwargs: ((o,), {"closure": closure}))
    try:
        opt.step()
    finally:
        handle.remove()
    assert seen == ["closure"]


def test_a_subclass_step_runs_the_hooks_once(stubbed):
    class Mine(FusedAdam):
        def step(self, closure=None):
            return super().step(closure)

    opt = Mine([torch.randn(8, requires_grad=True)], lr=1e-3)
    opt.param_groups[0]["params"][0].grad = torch.randn(8)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    for _ in range(3):
        opt.step()
    assert calls == ["pre"] * 3


def test_torch_wrapper_runs_only_while_something_watches(stubbed, monkeypatch):
    opt, _ps = _opt()
    wrapped = []
    real = _base._HOOKED_STEP
    monkeypatch.setattr(_base, "_HOOKED_STEP", lambda *a, **k: wrapped.append(1) or real(*a, **k))
    for _ in range(3):
        opt.step()
    assert wrapped == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    assert wrapped == [1]
    assert "Optimizer.step#FusedAdam.step" in {e.name for e in prof.events()}


def test_the_unwatched_step_runs_without_grad_and_restores_the_mode(stubbed, monkeypatch):
    """The unwatched step sets grad mode by hand: off inside the step, on again inside a closure, and restored
    after the step, also when the step raises."""
    opt, _ps = _opt()
    modes = []
    real = opt._settle_eager_steps
    monkeypatch.setattr(opt, "_settle_eager_steps", lambda: modes.append(torch.is_grad_enabled()) or real())
    opt.step(lambda: modes.append(torch.is_grad_enabled()))
    assert modes == [True, False]
    assert torch.is_grad_enabled()
    opt.param_groups[0]["lr"] = -1.0  # refused by the full path's check
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert torch.is_grad_enabled()
    opt.param_groups[0]["lr"] = 1e-3
    with torch.no_grad():
        opt.step()
        assert not torch.is_grad_enabled()


# -- the report on a replayed step --------------------------------------------------------------------------------


def test_a_replayed_step_with_an_inf_grad_still_warns():
    """Triton's interpreter: a steady step replayed with an inf written into a kept grad (same address) skips and,
    under ``on_nonfinite="warn"`` on the CPU, warns at once with the optimizer's message."""
    ps = [torch.linspace(-1, 1, n).requires_grad_() for n in (5, 7)]
    for p in ps:
        p.grad = torch.full(p.shape, 1e-2)
    opt = FusedAdam(ps, lr=1e-3, on_nonfinite="warn")
    for _ in range(3):
        opt.step()
    before = [p.detach().clone() for p in ps]
    ps[1].grad[2] = float("inf")
    with pytest.warns(RuntimeWarning, match="FusedAdam: a gradient holds inf or NaN"):
        assert _replays(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, ps, strict=True))
    ps[1].grad[2] = 1e-2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _replays(opt)
