"""fp16kit's GradScaler with the device-resident step (docs/optim.md, "The step on the device"): ``scaler.step(opt)``
plus ``scaler.update()`` read nothing back and launch only the step's kernels (CPU, under the interpreter), and (GPU)
a whole training iteration ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` captured into one
CUDA graph replays equal to the same iteration run eagerly, an overflow (skip and backoff) included.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from fp16kit.amp import GradScaler
from fp16kit.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedSGD

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "amp"))
from _host_reads import count_host_reads
from test_device_step import _params, counting

MAKERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": lambda ps, **k: FusedAdam(ps, lr=1e-3, weight_decay=0.01, **k),
    "lamb": lambda ps, **k: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, **k),
    "sgd": lambda ps, **k: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, **k),
    "adagrad": lambda ps, **k: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01, **k),
}
#: the step's launches (test_device_step.py, test_device_step_apex.py): the scaler adds none
BUDGET = {"adam": 2, "lamb": 3, "sgd": 2, "adagrad": 2}


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_scaler_step_and_update_read_nothing_back(kind, monkeypatch):
    """Under ``tests/amp/_host_reads.py``'s refusal of every read back, an overflow step included: the scaler hands
    its scale and a zeroed flag over, the optimizer's device step raises and uses it, ``update`` backs off on the
    device. The step is the device step (``_step_on_device``) and launches only its own kernels."""
    ps = _params(8, numel=64)
    opt = MAKERS[kind](ps, on_nonfinite="skip")  # "warn" reads a CPU flag here (a pinned copy on CUDA)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=1000, warn_after_skips=None)
    device_steps = []
    original = type(opt)._step_on_device
    monkeypatch.setattr(type(opt), "_step_on_device",
                        lambda self, rows, device: device_steps.append(1) or original(self, rows, device))
    for i in range(4):
        scaler.scale(torch.ones(()))
        for p in ps:
            p.grad.normal_().mul_(1e-2 * 2.0**10)
        if i == 3:
            ps[1].grad[0] = float("inf")
        with count_host_reads(forbid=True), counting() as (launches, _):
            scaler.step(opt)
            scaler.update()
        assert sum(launches.values()) == BUDGET[kind], launches
    assert len(device_steps) == 4
    assert scaler.get_scale() == 2.0**9  # the overflow backed off
    assert opt.param_groups[0]["step"].item() == 3.0  # and did not advance the step


# --------------------------------------------------------------------------------------------------- GPU


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).cuda()


def _iteration(model: nn.Module, opt: torch.optim.Optimizer, scaler: GradScaler, x: torch.Tensor,
               factor: torch.Tensor) -> None:
    """One autocast-free training iteration; ``factor`` (a device scalar) set to inf makes it overflow."""
    opt.zero_grad(set_to_none=False)  # grads stay where the step's address tables point
    loss = model(x).square().mean() * factor
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_captured_training_iteration_with_grad_scaler_replays_equal_eager(kind):
    """torch's whole-iteration capture recipe (warm-up on a side stream, then ``torch.cuda.graph``): forward,
    ``scaler.scale(loss).backward()``, ``scaler.step(opt)``, ``scaler.update()`` in one graph. Each replay beside
    an eager twin; the third overflows (the step is skipped, the scale backs off), the others grow the scale
    (``growth_interval=2``). Params, scale and step counters equal the eager twin's bit for bit."""
    model, ref = _model(0), _model(0)
    x = torch.randn(32, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    factor, ref_factor = torch.ones((), device="cuda"), torch.ones((), device="cuda")
    opt = MAKERS[kind](list(model.parameters()), capturable=True, on_nonfinite="skip")
    ref_opt = MAKERS[kind](list(ref.parameters()), capturable=True, on_nonfinite="skip")
    options = {"init_scale": 2.0**10, "growth_interval": 2, "warn_after_skips": None}
    scaler, ref_scaler = GradScaler("cuda", **options), GradScaler("cuda", **options)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _iteration(model, opt, scaler, x, factor)
            _iteration(ref, ref_opt, ref_scaler, x, ref_factor)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _iteration(model, opt, scaler, x, factor)
    for k in range(6):
        value = float("inf") if k == 2 else 1.0
        factor.fill_(value)
        ref_factor.fill_(value)
        graph.replay()
        _iteration(ref, ref_opt, ref_scaler, x, ref_factor)
    torch.cuda.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert torch.equal(opt.param_groups[0]["step"], ref_opt.param_groups[0]["step"])
    assert opt.param_groups[0]["step"].item() == 3 + 5  # warm-up, capture (not run), 5 replays taken, 1 skipped
