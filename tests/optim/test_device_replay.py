"""A steady device step is replayed from its recording (fp16kit/optim/_steady.py), bit for bit.

The replay issues the launches the full path recorded (``fp16kit/kernels/engine/launch.py``) while its plan holds (rows'
addresses, grads' metadata, state entries, hyper-parameters, settings, counters, the scaler's tensors), so it must
give exactly what the full path gives, step after step, and give way to the full path on any change: each test runs
the same sequence of steps and changes on two optimizers, one replaying (the default) and one never replaying
(``device_replay = False``), and compares every param, moment, master and counter bit for bit after every step.
Launches are counted at the interpreter (the replay issues the same ones), the planner's counters show that a
replayed step plans nothing, and a fake compiled kernel stands in for Triton's ``CompiledKernel`` to test the
bound launch (``FP16KIT_BOUND_LAUNCH=1``: the C launcher called with every parameter in signature order).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from fp16kit.amp import GradScaler
from fp16kit.kernels.engine import launch as _launch
from fp16kit.kernels.engine import plan as _plan
from fp16kit.optim import FusedAdam, FusedLAMB
from fp16kit.optim._base import FusedOptimizer

pytestmark = pytest.mark.interpreter
#: FusedAdam in the default run, FusedLAMB (the same replay, one launch more) in the slow one
KINDS = [pytest.param("adam"), pytest.param("lamb", marks=pytest.mark.slow)]

MAKERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda ps, **k: FusedAdam(ps, lr=1e-3, weight_decay=0.01, **k),
    "lamb": lambda ps, **k: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, **k),
}


def _params(dtype: torch.dtype = torch.float32, big: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    sizes = (37, 8, 4096 + 5 if big else 64)  # big: 8-bit moments from 4096 elements on
    return [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in sizes]


def _grads(ps: list[torch.Tensor], step: int, scale: float = 1.0) -> None:
    """New values in the same grad tensors (kept grads: the replay's steady case); new tensors on the first step."""
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        new = (torch.randn(p.shape, generator=g) * 1e-2 * scale).to(p.dtype)
        if p.grad is None:
            p.grad = new
        else:
            p.grad.copy_(new)


def _snapshot(opt: torch.optim.Optimizer, ps: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in ps]
    for p in ps:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                out.append(v.clone())
    out += [grp["step"].clone() for grp in opt.param_groups]
    if opt.nonfinite_skips is not None:  # (None under a scaler: the scaler counts)
        out.append(opt.nonfinite_skips.clone())
    return out


def _pair(kind: str, dtype: torch.dtype = torch.float32, big: bool = False, **kw):
    a_ps, b_ps = _params(dtype, big), _params(dtype, big)
    a, b = MAKERS[kind](a_ps, **kw), MAKERS[kind](b_ps, **kw)
    b.device_replay = False  # the instance attribute shadows the class default: b always takes the full path
    return (a, a_ps), (b, b_ps)


def _same(a, a_ps, b, b_ps, where: str) -> None:
    for x, y in zip(_snapshot(a, a_ps), _snapshot(b, b_ps), strict=True):
        assert torch.equal(x, y), where


def _run(pairs, steps, change=None, scaler=None):
    (a, a_ps), (b, b_ps) = pairs
    scalers = [GradScaler("cpu", init_scale=scaler), GradScaler("cpu", init_scale=scaler)] if scaler else None
    replayed = []
    for i in range(steps):
        for k, (opt, ps) in enumerate(((a, a_ps), (b, b_ps))):
            _grads(ps, i, scaler or 1.0)
            if change is not None:
                change(i, opt, ps)
            before = _launch.stats["replayed"]
            if scalers is None:
                opt.step()
            else:
                scalers[k].scale(torch.ones(()))
                scalers[k].step(opt)
                scalers[k].update()
            if k == 0:
                replayed.append(_launch.stats["replayed"] > before)
        _same(a, a_ps, b, b_ps, f"step {i}")
    return replayed


@pytest.mark.slow  # (the default run's change test replays steady steps too)
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_steady_steps_replay_bit_for_bit(kind):
    replayed = _run(_pair(kind), 6)
    # the first step makes the state and the step counter: its key differs; the second and third share one, the
    # third is recorded, the fourth on replayed
    assert replayed == [False, False, False, True, True, True]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("mode", ["master-bf16", "split", "state8"])
def test_low_byte_modes_replay_bit_for_bit(kind, mode):
    if mode == "state8":
        pairs = _pair(kind, big=True, state_bits=8)
    elif mode == "split":
        pairs = _pair(kind, torch.bfloat16, master_weights="split")
    else:
        pairs = _pair(kind, torch.bfloat16, master_weights=True)
    assert _run(pairs, 5)[3:] == [True, True]


@pytest.mark.parametrize("kind", KINDS)
def test_every_change_takes_the_full_path_and_is_replayed_again(kind):
    """lr, weight decay, a param moved (``p.data = ...``), a grad replaced by a new tensor, a moment replaced in
    the state, the betas list changed in place: each step after a change equals the never-replaying optimizer's,
    and two steady steps later the replay is back. A non-finite grad changes nothing the key holds: the replayed
    step skips on the device, counts and reports it like the full path."""

    def change(i, opt, ps):
        grp = opt.param_groups[0]
        if i == 3:
            grp["lr"] = 2e-3
        elif i == 6:
            grp["weight_decay"] = 0.0
            grp["betas"] = [0.85, 0.99]
        elif i == 9:
            ps[0].data = ps[0].data.clone()
        elif i == 12:
            ps[1].grad = ps[1].grad.clone()
        elif i == 15:
            st = opt.state[ps[2]]
            st["exp_avg"] = st["exp_avg"].clone()
        elif i in (18, 19):
            ps[0].grad[3] = float("nan")
        elif i == 20:
            grp["betas"][0] = 0.8  # the list changed in place

    with pytest.warns(RuntimeWarning, match="inf or NaN"):
        replayed = _run(_pair(kind), 23, change)
    for i in (3, 6, 9, 12, 15, 20):
        assert not replayed[i] and not replayed[i + 1] and replayed[i + 2], (i, replayed)
    assert replayed[18] and replayed[19], replayed


def test_grad_scaler_steps_equal_the_full_path():
    """Under fp16kit's GradScaler, overflowing steps included: equal bit for bit. The scaler hands the step a new
    flag tensor every step (``optimizer.found_inf``), which the plan holds by identity, so these steps take the full
    path (a scaler that kept one flag per device would let them replay)."""

    def change(i, opt, ps):
        if i == 4:
            ps[2].grad[0] = float("inf")

    assert not any(_run(_pair("adam"), 7, change, scaler=1024.0))


def test_a_replayed_step_plans_nothing_and_launches_the_same():
    (a, ps), _ = _pair("lamb")
    launches: collections.Counter[str] = collections.Counter()
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        return original(self, *args, **kwargs)

    for i in range(2):
        _grads(ps, i)
        a.step()
    try:
        InterpretedFunction.run = run
        _grads(ps, 2)
        a.step()  # recorded
        full = dict(launches)
        launches.clear()
        plans, hits = _plan.stats["plans"], _plan.stats["hits"]
        _grads(ps, 3)
        a.step()  # replayed
    finally:
        InterpretedFunction.run = original
    assert dict(launches) == full and sum(full.values()) == 3
    assert (_plan.stats["plans"], _plan.stats["hits"]) == (plans, hits)


def test_a_step_with_torch_passes_is_not_recorded():
    """A tensor lr (its device check is torch ops) and a non-contiguous grad (the torch fallback) are steps the
    launches alone would not reproduce: never replayed, still equal."""

    def tensor_lr(i, opt, ps):
        if i == 0:
            opt.param_groups[0]["lr"] = torch.tensor(1e-3)

    assert not any(_run(_pair("adam"), 4, tensor_lr))

    def strided(i, opt, ps):
        ps[2].grad = torch.randn(64, 2, generator=torch.Generator().manual_seed(i))[:, 0] * 1e-2

    assert not any(_run(_pair("adam"), 4, strided))


class _FakeCompiled:
    """Stands in for Triton's ``CompiledKernel``: ``run`` is its C launcher's signature; it runs the interpreter with
    the bound parameters passed by name, so a wrong order gives wrong results."""

    function = object()
    packed_metadata = object()

    def __init__(self, kernel, original) -> None:
        self.kernel, self.original, self.calls = kernel, original, 0

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *bound):
        import inspect

        self.calls += 1
        assert function is self.function and packed is self.packed_metadata and stream == 0
        names = list(inspect.signature(self.kernel.fn).parameters)
        assert len(bound) == len(names)
        self.original(self.kernel, grid=(g0, g1, g2), warmup=False, **dict(zip(names, bound, strict=True)))


@pytest.mark.parametrize("kind", KINDS)
def test_bound_launch_calls_the_compiled_launcher_with_every_parameter_in_order(kind, monkeypatch):
    original = InterpretedFunction.run
    fakes: dict[int, _FakeCompiled] = {}

    def run(self, *args, **kwargs):
        original(self, *args, **kwargs)
        return fakes.setdefault(id(self), _FakeCompiled(self, original))

    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setenv("FP16KIT_BOUND_LAUNCH", "1")
    before = _launch.stats["bound"]
    replayed = _run(_pair(kind), 5)
    assert replayed[3:] == [True, True]
    assert _launch.stats["bound"] - before == 2 * (2 if kind == "adam" else 3)
    assert sum(f.calls for f in fakes.values()) == 2 * (2 if kind == "adam" else 3)


def test_class_switch_turns_replay_off():
    assert FusedOptimizer.device_replay is True


def _cuda_pair(kind: str, mode: str):
    """Two CUDA optimizers on the same params (fp32, bf16 split or stochastic, or fp32 with 8-bit moments), one
    replaying (the default) and one never."""
    dtype = torch.bfloat16 if mode in ("split", "stochastic") else torch.float32
    kw = {"master_weights": mode} if dtype == torch.bfloat16 else ({"state_bits": 8} if mode == "state8" else {})
    out = []
    for replay in (True, False):
        ps = [p.detach().cuda().requires_grad_() for p in _params(dtype, big=True)]
        for p in ps:
            p.grad = (torch.randn(p.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
                      * 1e-2).to(dtype)
        opt = MAKERS[kind](ps, **kw)
        opt.device_replay = replay
        out.append((opt, ps))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("mode", ["fp32", "split", "stochastic", "state8"])
def test_cuda_graph_of_a_replayed_step_equals_eager_steps(kind, mode):
    """torch's capture recipe around a replayed step (the warm-up steps record and replay it): graph replays equal
    eager full-path steps bit for bit, in every low-byte mode."""
    (a, a_ps), (b, b_ps) = _cuda_pair(kind, mode)
    side = torch.cuda.Stream()  # torch's recipe: warm-up steps on a side stream (they record, then replay)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for opt in (a, b) * 3:
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    before = _launch.stats["replayed"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a.step()
    assert _launch.stats["replayed"] > before  # the captured step is the replay
    for _ in range(3):
        graph.replay()
        b.step()
    torch.cuda.synchronize()
    _same(a, a_ps, b, b_ps, "after the graph replays")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_cuda_bound_launches_equal_the_full_path(kind, monkeypatch):
    """Triton's C launcher called with the arguments bound once (FP16KIT_BOUND_LAUNCH=1) gives the full path's
    bits, and every replayed launch went through it."""
    monkeypatch.setenv("FP16KIT_BOUND_LAUNCH", "1")
    (a, a_ps), (b, b_ps) = _cuda_pair(kind, "fp32")
    before = dict(_launch.stats)
    for i in range(6):
        for opt, ps in ((a, a_ps), (b, b_ps)):
            for p in ps:
                p.grad.mul_(0.5 + 0.1 * i)
            opt.step()
        torch.cuda.synchronize()
        _same(a, a_ps, b, b_ps, f"step {i}")
    replayed = _launch.stats["replayed"] - before["replayed"]
    assert replayed > 0 and _launch.stats["bound"] - before["bound"] == replayed
