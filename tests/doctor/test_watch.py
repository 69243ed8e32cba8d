"""doctor.watch in a real training loop: no host sync until report(), both kernel backends agree, hooks go away."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fp16kit import amp, doctor

sys.path.insert(0, str(Path(__file__).parents[1] / "amp"))
from _host_reads import count_host_reads


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def train(model, opt, scaler, steps):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        (loss * scaler.scale).backward()
        found = scaler.new_found_inf()
        from fp16kit.kernels import unscale_and_check

        unscale_and_check([p.grad for p in model.parameters()], scaler.inv_scale(), found)
        opt.step()
        scaler.update(found)


def test_no_host_sync_until_report():
    """Sampled every step, with activations and a device-side scale: not one value read back while training."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = amp.LossScaler(init_scale=2.0**12, device="cpu", warn_after_skips=None)
    with doctor.watch(model, every=1, activations=True, scaler=scaler) as w:
        with count_host_reads(forbid=True):
            train(model, opt, scaler, 3)
        assert w.samples == 3
        with count_host_reads(forbid=False) as reads:
            w.report()
        assert reads  # report() is where the counts (and the scale) come back


@pytest.mark.interpreter
def test_triton_interpreter_and_torch_backends_give_the_same_histograms():
    from fp16kit.kernels import use_backend

    results = []
    for backend in ("auto", "torch"):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = amp.LossScaler(init_scale=2.0**10, device="cpu", warn_after_skips=None)
        with use_backend(backend), doctor.watch(model, every=2, activations=True, scaler=scaler) as w:
            train(model, opt, scaler, 3)
        results.append(w.histograms().clone())
    assert results[0].sum() > 0 and torch.equal(results[0], results[1])


def test_hooks_are_removed_on_exit_and_the_loop_is_unchanged():
    torch.manual_seed(0)
    ref_model, model = mlp(), mlp()
    for m in (ref_model, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        scaler = amp.LossScaler(init_scale=2.0**10, device="cpu", warn_after_skips=None)
        if m is model:
            with doctor.watch(m, every=1, activations=True, scaler=scaler) as w:
                train(m, opt, scaler, 2)
        else:
            train(m, opt, scaler, 2)
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)  # watching does not change a single bit of training
    assert not model._forward_pre_hooks and all(not m._forward_hooks for m in model.modules())
    before = w.histograms().clone()
    model(torch.randn(8, 16)).sum().backward()
    assert torch.equal(before, w.histograms()) and w.steps == 2


def test_apex_style_o2_run_is_watched_with_the_amp_scaler():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = opt._amp_stash.session.scalers[0]
    gen = torch.Generator().manual_seed(1)
    with doctor.watch(model, every=2, scaler=scaler) as w:
        for _ in range(4):
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
    report = w.report()
    assert w.samples == 2 and report.loss_scale == scaler.get_scale()
    assert sum(e.values for e in report.entries) == 2 * sum(p.numel() for p in model.parameters())


@pytest.mark.gpu
def test_no_cuda_sync_while_watching_on_a_gpu():
    """torch's sync debug mode raises on any host sync: watching every step (compiled Triton kernel, tables
    uploaded from pinned memory) must not trigger one, cache misses of fresh gradient buffers included."""
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=True)
    scale = torch.full((1,), 2.0**10, device="cuda")
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    with doctor.watch(model, every=1, activations=True, scaler=scale) as w:
        for step in range(5):
            if step >= 2:  # steps 0 and 1 warm up the kernels (compilation) and the allocator
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.zero_grad(set_to_none=True)
                (F.cross_entropy(model(x), y) * scale).backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    report = w.report()
    assert w.samples == 5 and report.loss_scale == 2.0**10
    param_values = sum(p.numel() for p in model.parameters())
    assert sum(e.values for e in report.entries if e.kind == "param") == 5 * param_values
