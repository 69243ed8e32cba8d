"""The steady device step (fp16kit/optim/_steady.py): a recorded step replays while what it depends on stands.

Each change a training script makes between steps must make the next step take the full path (and the full path
records again after two equal steps): a grad replaced by a tensor elsewhere, a grad that becomes None, a group
added, a learning-rate schedule, a tensor lr (never recorded: its device check is torch ops), a checkpoint loaded,
a state dict replaced by hand, a grad at the recorded address with other strides. A new grad tensor at the recorded
address with the recorded metadata (``zero_grad(set_to_none=True)`` and an allocator that hands the memory back)
is the same launch: it replays.

The decisions are tested with every Triton launch replaced by a counter (fast: the host logic alone); one sequence
of these changes then runs the real kernels (Triton's interpreter) beside an optimizer that never replays and
compares every param, moment and counter bit for bit after every step. A replayed step reads no tensor on the host
(capture-safe).
"""

from __future__ import annotations

import pytest
import torch
from test_device_replay import _pair, _run
from triton.runtime.interpreter import InterpretedFunction

from fp16kit.kernels.engine import launch as _launch
from fp16kit.kernels.engine import plan as _plan
from fp16kit.optim import FusedAdam, FusedLAMB

pytestmark = pytest.mark.interpreter


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    """Every Triton launch (full path or replay) replaced by a counter: the kernels' names, in order."""
    log: list[str] = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: log.append(self.fn.__name__))
    return log


def _opt(cls=FusedAdam, n: int = 6, **kw):
    g = torch.Generator().manual_seed(3)
    ps = [torch.randn(8 + i, generator=g).requires_grad_() for i in range(n)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    kw = {"lr": 1e-3, "weight_decay": 0.01, "on_nonfinite": "skip", **kw}
    if cls is FusedLAMB:
        kw["max_grad_norm"] = 1.0
    return cls(ps, **kw), ps


def _replays(opt) -> bool:
    """One step: was it the replay?"""
    before = _launch.stats["replayed"]
    opt.step()
    return _launch.stats["replayed"] > before


def _replace_grad(opt, ps):
    ps[1].grad = ps[1].grad.clone()


def _grad_none(opt, ps):
    ps[2].grad = None


def _add_group(opt, ps):
    q = torch.randn(5, requires_grad=True)
    q.grad = torch.randn(5)
    opt.add_param_group({"params": [q]})


def _param_to_another_group(opt, ps):
    # two groups with other hyper-parameters; then the first group's last param moves to the second: the params
    # in order are the same, the groups are not
    opt.param_groups[0]["params"] = ps[:3]
    opt.add_param_group({"params": ps[3:], "lr": 5e-3})
    for _ in range(3):
        opt.step()
    opt.param_groups[0]["params"], opt.param_groups[1]["params"] = ps[:2], ps[2:]


def _schedule(opt, ps):
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # adds "initial_lr" to the group
    opt.step()
    sched.step()


def _load(opt, ps, tmp_path):
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))


def _state_dict_replaced(opt, ps):
    opt.state[ps[0]] = {k: v.clone() for k, v in opt.state[ps[0]].items()}


def _strided_grad_same_address(opt, ps):
    # a grad at the recorded address, read with other strides (the torch fallback's layout: never recorded)
    buf = torch.empty(2 * ps[3].numel())
    buf[: ps[3].numel()] = ps[3].grad
    ps[3].grad = buf[: ps[3].numel()]
    opt.step()  # the new contiguous grad: full path, and the next step records it
    opt.step()
    ps[3].grad = buf[::2]
    assert ps[3].grad.data_ptr() == buf.data_ptr()


CHANGES = {
    "grad-replaced": _replace_grad,
    "grad-none": _grad_none,
    "add-param-group": _add_group,
    "param-to-another-group": _param_to_another_group,
    "lr-scheduler": _schedule,
    "load-state-dict": _load,
    "state-dict-replaced": _state_dict_replaced,
    "strided-grad-same-address": _strided_grad_same_address,
}


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
def test_a_change_takes_the_full_path_then_replays_again(change, cls, launches, tmp_path):
    opt, ps = _opt(cls)
    assert [_replays(opt) for _ in range(5)] == [False, False, False, True, True]
    per_step = len(launches) // 5
    fn = CHANGES[change]
    fn(opt, ps, tmp_path) if change == "load-state-dict" else fn(opt, ps)
    plans = _plan.stats["plans"] + _plan.stats["hits"]
    del launches[:]
    assert not _replays(opt), change
    assert _plan.stats["plans"] + _plan.stats["hits"] > plans  # the full path planned its launches again
    assert len(launches) >= per_step
    if change == "strided-grad-same-address":  # the torch fallback takes that grad: never recorded
        assert not any(_replays(opt) for _ in range(3))
    elif change == "add-param-group":  # the new group's first step makes its state and counter: one step more
        assert [_replays(opt) for _ in range(3)] == [False, False, True]
    else:
        assert [_replays(opt) for _ in range(3)] == [False, True, True], change


def test_a_tensor_lr_is_never_replayed(launches):
    """A tensor lr (a scheduler's, or one edited in place) is checked on the device with torch ops each step: the
    launches alone would not reproduce the step, so it is never recorded."""
    opt, _ps = _opt()
    for _ in range(4):
        opt.step()
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    assert not any(_replays(opt) for _ in range(4))
    opt.param_groups[0]["lr"].fill_(2e-3)
    assert not _replays(opt)
    opt.param_groups[0]["lr"] = 1e-3
    assert [_replays(opt) for _ in range(3)] == [False, False, True]


def test_a_new_grad_at_the_recorded_address_replays(launches):
    """``zero_grad(set_to_none=True)`` then a backward that gets the same memory back: new grad tensors with the
    recorded addresses and metadata are the recorded launch."""
    opt, ps = _opt()
    for _ in range(4):
        opt.step()
    storage = [p.grad for p in ps]
    for p, g in zip(ps, storage, strict=True):
        p.grad = g.view(g.shape)  # a new tensor object on the same memory
    assert _replays(opt)


def test_a_param_moved_or_a_moment_replaced_is_seen(launches):
    opt, ps = _opt()
    for _ in range(4):
        opt.step()
    ps[0].data = ps[0].data.clone()
    assert not _replays(opt)
    for _ in range(2):
        opt.step()
    opt.state[ps[4]]["exp_avg_sq"] = opt.state[ps[4]]["exp_avg_sq"].clone()
    assert not _replays(opt)
    for _ in range(2):
        opt.step()
    del opt.state[ps[5]]["exp_avg"]
    with pytest.raises(ValueError, match="exp_avg"):
        opt.step()  # the full path's check names the missing key


def test_a_replayed_step_reads_nothing_back(launches, monkeypatch):
    """No host read of a tensor in a replayed step (``on_nonfinite="skip"``): nothing that would wait on the device
    or break a CUDA graph capture."""
    opt, _ps = _opt()
    for _ in range(4):
        opt.step()
    reads = []
    for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, _r=real: reads.append(_n) or _r(*a))
    assert _replays(opt)
    assert reads == []


@pytest.mark.slow  # (the default run's tests/optim/test_device_replay.py compares replays bit for bit too)
def test_the_changes_in_sequence_equal_a_never_replaying_optimizer_bit_for_bit(tmp_path):
    """The real kernels (Triton's interpreter): a grad that becomes None and comes back, a group added, a
    learning-rate schedule, a checkpoint loaded through a file, new grad tensors on the same memory; each step
    equals the never-replaying optimizer's, and the steady steps between the changes replay."""
    extra = {}

    def change(i, opt, ps):
        if i == 3:
            ps[1].grad = None
        elif i == 7:
            q = torch.linspace(-1, 1, 6).requires_grad_()
            q.grad = torch.linspace(0.5, -0.5, 6)
            extra[id(opt)] = q
            opt.add_param_group({"params": [q], "lr": 2e-3})
        elif i == 11:
            opt.param_groups[0]["lr"] *= 0.5  # what a scheduler's step does
        elif i == 15:
            _load(opt, ps, tmp_path)
        elif i == 18:
            for p in ps:
                p.grad = p.grad.view(p.grad.shape)

    replayed = _run(_pair("adam"), 20, change)
    F, T = False, True
    assert replayed == [F, F, F, F, F, F, T, F, F, F, T, F, F, T, T, F, F, T, T, T], replayed
    a, b = extra.values()
    assert torch.equal(a, b)


def test_the_replay_is_the_device_step_only_while_it_applies(launches, monkeypatch):
    """A recorded plan does not outlive the device step's own condition (``_on_device``: the backend, a grad scale
    the kernels can read): when it no longer applies, the step takes the host-vector path."""
    opt, _ps = _opt()
    for _ in range(4):
        opt.step()
    monkeypatch.setattr(type(opt), "_on_device", lambda self, device: False)
    assert not _replays(opt)
