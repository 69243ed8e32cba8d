"""The device-resident step (docs/optim.md, "The step on the device"): launch budget, host-op counts that do not
grow with the number of tensors, the device-derived hyper-parameters equal to the torch formula bit for bit, and
(GPU) CUDA-graph capture and compiled steps equal to eager steps.

Launches are counted at the Triton launchers (every ``@triton.jit`` kernel run under the interpreter); every
other torch op is counted by a ``TorchDispatchMode`` around the step.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator

import pytest
import torch
from optim_helpers import scaled_step
from torch.utils._python_dispatch import TorchDispatchMode

from fp16kit.amp import GradScaler
from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdam, FusedLAMB, FusedSGD

MAKERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda ps, **k: FusedAdam(ps, lr=1e-3, weight_decay=0.01, **k),
    "lamb": lambda ps, **k: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, **k),
}
#: Triton launches per step and (device, dtype) group: the check pass (flag, norm, skip count, finished in the
#: same launch) plus the update (Adam one kernel, LAMB its two stages).
BUDGET = {"adam": 2, "lamb": 3}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> Iterator[tuple[collections.Counter, _Ops]]:
    """Count Triton launches (by kernel name) and the torch ops outside them."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: collections.Counter[str] = collections.Counter()
    original = InterpretedFunction.run
    mode = _Ops()

    def run(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        mode.paused = True  # the interpreter's own tensor handling is not the step's
        try:
            return original(self, *args, **kwargs)
        finally:
            mode.paused = False

    InterpretedFunction.run = run
    try:
        with mode:
            yield launches, mode
    finally:
        InterpretedFunction.run = original


def _params(n: int, numel: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(numel, generator=g).to(dtype).requires_grad_() for _ in range(n)]
    for p in ps:
        p.grad = (torch.randn(numel, generator=g) * 1e-2).to(dtype)
    return ps


def _step_fn(opt: torch.optim.Optimizer, scaler: GradScaler | None) -> Callable[[], None]:
    return functools.partial(scaled_step, opt, scaler)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_launch_budget_and_op_count_do_not_grow_with_tensors(kind, with_scaler):
    counts = {}
    # (past 64 tensors the planner's overlap test of new grads switches from Python to three torch ops on host
    # tensors: both sizes are on the same side of that switch)
    for n in (12, 48):
        opt = MAKERS[kind](_params(n, numel=4))
        one = _step_fn(opt, GradScaler("cpu", init_scale=256.0) if with_scaler else None)
        one()
        one()
        with counting() as (launches, ops):
            one()
        counts[n] = (sum(launches.values()), sum(ops.counts.values()), dict(launches))
    assert counts[12][0] == counts[48][0] == BUDGET[kind], counts
    assert counts[12][1] == counts[48][1], counts
    # what stays is per step, not per tensor: the scaler's own ops and a few views
    assert counts[48][1] <= (18 if with_scaler else 15), counts


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_no_small_ops_around_the_kernels(kind):
    """No hyper-parameter arithmetic, flag fills or counter updates as torch ops: they are in the kernels."""
    opt = MAKERS[kind](_params(16))
    opt.step()
    with counting() as (_, ops):
        opt.step()
    forbidden = {"aten.pow", "aten.cat", "aten.fill_", "aten.full", "aten.reciprocal", "aten.add_", "aten.zero_"}
    seen = {name.rsplit(".", 1)[0] for name in ops.counts}
    assert not (seen & forbidden), ops.counts


def _run(kind: str, backend: str, steps: int, dtype: torch.dtype, *, scaler_scale: float | None,
         lr_tensor: bool = False, inject_inf_at: int | None = None, **kwargs) -> tuple[list, dict]:
    ps = _params(6, 4096 + 37, dtype=dtype, seed=3)
    if kwargs.get("master_weights"):
        pass
    with use_backend(backend):
        opt = MAKERS[kind](ps, **kwargs)
        if lr_tensor:
            for grp in opt.param_groups:
                grp["lr"] = torch.tensor(1e-3)
        sc = GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None
        g = torch.Generator().manual_seed(7)
        for i in range(steps):
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * (scaler_scale or 1.0) * 1e-2).to(dtype)
            if inject_inf_at == i:
                ps[1].grad[5] = float("inf")
            if lr_tensor and i == 2:
                for grp in opt.param_groups:
                    grp["lr"].fill_(3e-3)
            scaled_step(opt, sc)
        state = {k: [opt.state[p][k].clone() for p in ps] for k in ("exp_avg", "exp_avg_sq")}
        state["step"] = [grp["step"].clone() for grp in opt.param_groups]
        if kwargs.get("master_weights"):
            state["master"] = [opt.state[p]["master"].clone() for p in ps]
    return [p.detach().clone() for p in ps], state


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize(
    "case",
    [
        dict(dtype=torch.float32, scaler_scale=None),
        dict(dtype=torch.float32, scaler_scale=1024.0, inject_inf_at=1),
        dict(dtype=torch.float16, scaler_scale=1024.0, master_weights=True),
        dict(dtype=torch.float32, scaler_scale=None, lr_tensor=True),
        dict(dtype=torch.bfloat16, scaler_scale=None, master_weights=True, inject_inf_at=0),
    ],
    ids=["fp32", "fp32-scaler-overflow", "fp16-master", "tensor-lr-changed", "bf16-master-first-step-inf"],
)
def test_device_step_equals_the_host_vector_step_bit_for_bit(kind, case, monkeypatch):
    """The kernels derive bias corrections, ``1/scale``, the clip divisor and the step count on the device; the
    same kernels fed the host-built float32 vector (the path a compiled or sharded step takes) give the same
    params, moments, masters and counters. With fp16/bf16 params and fp32 masters the torch fallback gives the
    same model params too (docs/optim.md, "Backend agreement")."""
    from fp16kit.optim._base import FusedOptimizer

    steps = 4
    device_out = _run(kind, "triton", steps, **case)
    monkeypatch.setattr(FusedOptimizer, "_on_device", lambda self, device: False)
    vector_out = _run(kind, "triton", steps, **case)
    for a, b in zip(device_out[0], vector_out[0]):
        assert torch.equal(a, b)
    for key in device_out[1]:
        for a, b in zip(device_out[1][key], vector_out[1][key]):
            assert torch.equal(a, b), key
    if case.get("master_weights"):  # the model params as the torch fallback computes them
        torch_out = _run(kind, "torch", steps, **case)
        for a, b in zip(device_out[0], torch_out[0]):
            assert torch.equal(a, b)


def test_capturable_is_accepted_by_every_capturable_optimizer():
    """torch's capture recipe passes ``capturable=True``: FusedAdam, FusedLAMB and FusedSGD accept it."""
    ps = _params(2)
    for opt in (FusedAdam(ps, capturable=True), FusedLAMB(ps, capturable=True), FusedSGD(ps, lr=0.1, capturable=True)):
        assert opt.capturable is True


@pytest.mark.interpreter
def test_skipped_step_does_not_advance_and_counts():
    ps = _params(4)
    opt = FusedAdam(ps, lr=1e-3, on_nonfinite="skip")
    opt.step()
    before = [p.detach().clone() for p in ps]
    ps[2].grad[3] = float("nan")
    opt.step()
    assert opt.param_groups[0]["step"].item() == 1.0
    assert opt.nonfinite_skips.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ps))


# --------------------------------------------------------------------------------------------------- GPU


def _cuda_params(n: int, numel: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.randn(numel, device="cuda", generator=g).requires_grad_() for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(numel, device="cuda", generator=g) * 1e-2
    return ps


def _twins(kind: str, **kwargs) -> tuple[list, torch.optim.Optimizer, list, torch.optim.Optimizer, torch.Tensor]:
    ps = _cuda_params(20, 3000, 1)
    ref_ps = [p.detach().clone().requires_grad_() for p in ps]
    for r, p in zip(ref_ps, ps):
        r.grad = p.grad.clone()
    lr = torch.tensor(1e-3, device="cuda")
    make = MAKERS.get(kind) or (lambda params, **k: FusedSGD(params, lr=1e-3, momentum=0.9, weight_decay=0.01, **k))
    opt, ref = make(ps, capturable=True, **kwargs), make(ref_ps, capturable=True, **kwargs)
    for grp in opt.param_groups:
        grp["lr"] = lr
    for grp in ref.param_groups:
        grp["lr"] = lr.clone()
    return ps, opt, ref_ps, ref, lr


def replay_against_eager(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer, lr: torch.Tensor, new_lr: float,
                         replays: int = 4) -> None:
    """torch's capture recipe for ``opt.step()`` (3 warm-up steps on a side stream, then ``torch.cuda.graph``), then
    ``replays`` replays, each beside an eager ``ref.step()``; before the third, ``opt``'s tensor ``lr`` and ``ref``'s
    are set to ``new_lr`` (a learning-rate change between replays). Also used by ``benchmarks/gpu_step.py``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            opt.step()
            ref.step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for k in range(replays):
        if k == 2:
            lr.fill_(new_lr)
            for grp in ref.param_groups:
                grp["lr"].fill_(new_lr)
        graph.replay()
        ref.step()
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adam", "lamb", "sgd"])
def test_cuda_graph_capture_replays_equal_eager(kind):
    """torch's documented capture of ``opt.step()`` (FusedSGD, FusedAdagrad and FusedNovoGrad also in
    test_device_step_apex.py)."""
    ps, opt, ref_ps, ref, lr = _twins(kind)
    replay_against_eager(opt, ref, lr, 4e-3)
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)
    assert torch.equal(opt.param_groups[0]["step"], ref.param_groups[0]["step"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_eager_step_copies_nothing_to_the_device(kind):
    from torch.profiler import ProfilerActivity, profile

    ps = _cuda_params(50, 64, 2)
    opt = MAKERS[kind](ps)
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not [n for n in names if "htod" in n], names
    kernels = [n for n in names if "memcpy" not in n and "memset" not in n]
    assert len(kernels) <= BUDGET[kind], kernels


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_compiled_step_equals_eager_cuda(kind):
    ps, opt, ref_ps, ref, _ = _twins(kind)
    for grp in opt.param_groups + ref.param_groups:
        grp["lr"] = 1e-3
    step = torch.compile(opt.step)
    for _ in range(3):
        step()
        ref.step()
    torch.cuda.synchronize()
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_step_creates_no_host_value_and_reads_nothing_back(kind, with_scaler):
    """The step's torch ops, CPU stand-in for a CUDA trace: the same code runs for CUDA tensors except the
    ``on_nonfinite="warn"`` report (a pinned non-blocking copy there, a host read here), so with
    ``on_nonfinite="skip"`` the step must make no tensor from host values (``lift_fresh``, ``scalar_tensor``,
    ``full``: a host-to-device copy or fill on a GPU), copy nothing (``_to_copy``/``copy_``) and read nothing
    (``_local_scalar_dense``, i.e. ``.item()``). The GPU side is ``test_eager_step_copies_nothing_to_the_device``."""
    opt = MAKERS[kind](_params(40, numel=4), on_nonfinite="skip")
    if with_scaler:  # a scaler's hand-over, as GradScaler.step makes it (its own ops are not the step's)
        opt.grad_scale = torch.full((1,), 256.0)
        opt.found_inf = torch.zeros(1)
    opt.step()
    opt.step()
    with counting() as (_, ops):
        opt.step()
    host = {"aten.lift_fresh", "aten.scalar_tensor", "aten.full", "aten._to_copy", "aten.copy_",
            "aten._local_scalar_dense", "aten.ones", "aten.zeros", "aten.empty"}
    seen = {name.rsplit(".", 1)[0] for name in ops.counts}
    assert not (seen & host), ops.counts


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_a_grad_re_strided_in_place_is_planned_again(kind):
    """The check pass takes the group's verdict for its planner's guard (one group: the same grads list); a grad
    replaced by a strided view starting at the same address (same addresses, other strides: only a metadata guard
    notices) must be planned again, not read as the contiguous grad before it. The memory such a stale read would
    take holds an inf outside the new view: read right, the step is taken and equals a fresh optimizer's."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(8, 12), (5,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    buf = torch.zeros(8, 24)
    with use_backend("auto"):
        opt, ref = MAKERS[kind](params, on_nonfinite="skip"), MAKERS[kind](twin, on_nonfinite="skip")
        assert opt._on_device(torch.device("cpu"))
        params[0].grad = buf.view(-1)[:96].view(8, 12)  # contiguous, at buf's first element
        params[1].grad = torch.randn(5, generator=gen)
        for _ in range(3):
            buf.view(-1)[:96].copy_(torch.randn(96, generator=gen))
            for p, q in zip(params, twin):
                q.grad = p.grad.clone()
            opt.step()
            ref.step()
        buf.copy_(torch.randn(8, 24, generator=gen))
        buf[0, 1] = float("inf")  # inside the old grad's 96 elements, outside the new view
        params[0].grad = buf[:, ::2]
        assert params[0].grad.data_ptr() == buf.data_ptr() and torch.isfinite(params[0].grad).all()
        twin[0].grad = params[0].grad.contiguous()
        twin[1].grad = params[1].grad.clone()
        before = [p.detach().clone() for p in params]
        opt.step()
        ref.step()
    assert not torch.equal(params[0].detach(), before[0]), "the step was skipped: a stale plan read the old span"
    for p, q in zip(params, twin):
        assert torch.equal(p.detach(), q.detach())
