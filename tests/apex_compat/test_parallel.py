"""fp16kit.parallel: SyncBatchNorm (CPU, gloo) against BatchNorm over the whole batch, DDP against torch DDP.

The two-process checks share one spawn (process start-up dominates the cost): gloo on 127.0.0.1, a timeout.

Budgets (SyncBatchNorm, fp32 math, u = 2^-24): local means and M2 are fp32 sums of n terms (relative error
gamma(n) of the sum of absolute values), combined in float64, so mean and variance carry a relative error
about gamma(n); the output ``(x - mean) * invstd * w + b`` adds 4 roundings; the input gradient is a
difference of three terms, each within the same relative error of its own magnitude. We allow
``(2 gamma(n) + 8 u)`` times the sum of the absolute values of the terms, against a float64 BatchNorm.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fp16kit.numerics import gamma
from fp16kit.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
from fp16kit.parallel import distributed as apex_ddp

F64 = torch.float64
U32 = 2.0**-24
WORLD = 2


def _batch(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64) * 3 + 1.5


def _bn_reference(x64: torch.Tensor, w: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, momentum: float):
    """float64 BatchNorm over the whole batch: output, input grad, weight/bias grads, running stats."""
    bn = nn.BatchNorm2d(x64.shape[1], momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(w)
        bn.bias.copy_(b)
    x = x64.clone().requires_grad_()
    y = bn(x)
    y.backward(dy)
    return y.detach(), x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var


def _budget(x64: torch.Tensor, w: torch.Tensor, b: torch.Tensor, n: int):
    c = x64.shape[1]
    shape = (1, c, 1, 1)
    mean = x64.mean((0, 2, 3)).view(shape)
    std = x64.std((0, 2, 3), unbiased=False).view(shape)
    rel = 2 * gamma(n, torch.float32) + 8 * U32
    out = rel * (((x64 - mean).abs() + mean.abs()) / std * w.view(shape).abs() + b.view(shape).abs())
    return out


def _syncbn_check(rank: int) -> None:
    n_per, c = 3, 4
    full = _batch((WORLD * n_per, c, 5, 5))
    w = torch.linspace(0.5, 2.0, c, dtype=F64)
    b = torch.linspace(-1.0, 1.0, c, dtype=F64)
    dy = _batch(full.shape, seed=1)
    y_ref, dx_ref, dw_ref, db_ref, rm_ref, rv_ref = _bn_reference(full, w, b, dy, 0.1)
    mine = slice(rank * n_per, (rank + 1) * n_per)
    for dtype in (torch.float32, F64):
        bn = SyncBatchNorm(c).to(dtype)
        with torch.no_grad():
            bn.weight.copy_(w)
            bn.bias.copy_(b)
        x = full[mine].to(dtype).requires_grad_()
        y = bn(x)
        y.backward(dy[mine].to(dtype))
        n = full.numel() // c
        budget = _budget(full, w, b, n)[mine]
        if dtype == F64:
            budget = budget * 0 + 1e-12 * (1 + y_ref[mine].abs())
        err = (y.detach().to(F64) - y_ref[mine]).abs()
        assert bool((err <= budget).all()), f"rank {rank} {dtype}: output off by {float((err - budget).max()):.3g}"
        # input gradient: three terms of size |w| invstd (|dy| + mean|dy| + |xhat| mean|dy xhat|)
        gscale = (dy.abs() + dy.abs().mean((0, 2, 3), keepdim=True) * (1 + (y_ref - b.view(1, c, 1, 1)).abs()))
        gscale = gscale * (w / full.std((0, 2, 3), unbiased=False)).view(1, c, 1, 1)
        rel = 2 * gamma(n, torch.float32) + 8 * U32 if dtype == torch.float32 else 1e-12
        gerr = (x.grad.to(F64) - dx_ref[mine]).abs()
        assert bool((gerr <= rel * gscale[mine]).all()), f"rank {rank} {dtype}: input grad off"
        # weight/bias grads are local sums: their all-reduce is the full-batch gradient (DDP does this)
        dwb = torch.stack([bn.weight.grad, bn.bias.grad]).to(F64)
        dist.all_reduce(dwb)
        torch.testing.assert_close(dwb, torch.stack([dw_ref, db_ref]), rtol=1e-4 if dtype != F64 else 1e-10, atol=1e-6)
        torch.testing.assert_close(bn.running_mean.to(F64), rm_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var.to(F64), rv_ref, rtol=1e-5, atol=1e-6)
    # fp16 input: normalized in fp32, rounded once
    bn = SyncBatchNorm(c, channel_last=True)
    x16 = full[mine].movedim(1, -1).half()
    y16 = bn(x16)
    assert y16.dtype == torch.float16
    want = ((full.half().double() - full.half().double().mean((0, 2, 3), keepdim=True))
            / full.half().double().std((0, 2, 3), unbiased=False, keepdim=True).add(0).pow(2).add(1e-5).sqrt())
    torch.testing.assert_close(y16.double(), want[mine].movedim(1, -1), rtol=2**-10, atol=2**-10)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x = _batch((WORLD * 4, 6), seed=10 + step).float()[rank * 4:(rank + 1) * 4]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_check(rank: int) -> None:
    ref = _train(nn.parallel.DistributedDataParallel(_model()), rank)
    for kwargs in ({}, {"delay_allreduce": True, "message_size": 10}, {"allreduce_always_fp32": True},
                   {"gradient_predivide_factor": 2.0}):
        got = _train(DistributedDataParallel(_model(), **kwargs), rank)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), f"rank {rank}: DistributedDataParallel({kwargs}) differs from torch DDP"
    # gradient_average=False: the sum over ranks, i.e. WORLD x torch's average (exact for a power of two)
    m, t = DistributedDataParallel(_model(), gradient_average=False), nn.parallel.DistributedDataParallel(_model())
    x = _batch((4, 6), seed=rank).float()
    for mod in (m, t):
        mod(x).sum().backward()
    for a, b in zip(m.parameters(), t.parameters()):
        assert torch.equal(a.grad, b.grad * WORLD)
    # fp16 params with allreduce_always_fp32: reduced in fp32, the average rounded once to fp16
    h = DistributedDataParallel(_model().half(), allreduce_always_fp32=True)
    xs = [_batch((4, 6), seed=50 + r).half() for r in range(WORLD)]
    h(xs[rank]).float().sum().backward()
    solo = _model().half()
    local = []
    for r in range(WORLD):
        solo.zero_grad()
        solo(xs[r]).float().sum().backward()
        local.append([p.grad.float() for p in solo.parameters()])
    for p, *gs in zip(h.parameters(), *local):
        assert torch.equal(p.grad, (sum(gs) / WORLD).half())


def _worker(rank: int, store: str, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["GLOO_SOCKET_IFNAME"] = "127.0.0.1", "lo"
    torch.set_num_threads(1)
    # a file:// rendezvous: no free port to pick, so none another process can take first (issue 22)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, init_method=f"file://{store}",
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        _syncbn_check(rank)
        _ddp_check(rank)
        open(os.path.join(out_dir, f"ok{rank}"), "w").close()
        # both ranks done with their collectives before either tears gloo down: a rank destroying its group while
        # the other still talks to it can abort the other (SIGABRT seen on a loaded machine)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_processes_syncbn_matches_full_batch_and_ddp_matches_torch(tmp_path) -> None:
    store = tmp_path.parent / f"{tmp_path.name}-rendezvous"
    ctx = mp.start_processes(_worker, args=(str(store), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo processes did not finish within 180 s")
    assert sorted(os.listdir(tmp_path)) == ["ok0", "ok1"]


# ------------------------------------------------------------------------------------------ one process


def test_syncbn_without_a_group_is_batchnorm_and_eval_uses_running_stats() -> None:
    x = _batch((6, 3, 4), seed=3).float()
    sync, plain = SyncBatchNorm(3, momentum=None), nn.BatchNorm1d(3, momentum=None)
    for _ in range(2):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = sync(xa), plain(xb)
        ya.sum().backward()
        yb.sum().backward()
        torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sync.running_var, plain.running_var)
    assert int(sync.num_batches_tracked) == 2
    sync.eval()
    plain.eval()
    torch.testing.assert_close(sync(x), plain(x), rtol=1e-6, atol=1e-6)  # running stats agree to rounding
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SyncBatchNorm(3)(torch.ones(1, 3))
    with pytest.raises(ValueError, match="expected 3 channels"):
        SyncBatchNorm(3)(torch.ones(2, 4))


def test_convert_syncbn_model_carries_everything_over() -> None:
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, eps=1e-3, momentum=0.3),
                          nn.Sequential(nn.Flatten(), nn.BatchNorm1d(12, affine=False)),
                          nn.BatchNorm3d(2, track_running_stats=False), nn.InstanceNorm1d(3))
    model[1].weight.requires_grad_(False)
    model.train()
    model[1](torch.randn(4, 3, 2, 2))
    model[2](torch.randn(4, 3, 2, 2))
    with torch.no_grad():
        model[1].bias.uniform_()
    model[2].eval()
    old = model[1]
    conv = convert_syncbn_model(model, channel_last=False)  # containers are converted in place, as in apex
    assert conv is model
    for i in (1, 3):
        assert isinstance(conv[i], SyncBatchNorm)
    new = conv[1]
    assert (new.eps, new.momentum, new.affine, new.track_running_stats) == (1e-3, 0.3, True, True)
    assert torch.equal(new.weight, old.weight) and not new.weight.requires_grad and new.bias.requires_grad
    assert new.weight is not old.weight
    assert new.running_mean is old.running_mean and new.num_batches_tracked is old.num_batches_tracked
    assert int(new.num_batches_tracked) == 1
    inner = conv[2][1]
    assert isinstance(inner, SyncBatchNorm) and not inner.affine and not inner.training
    assert conv[3].running_mean is None and not conv[3].track_running_stats
    assert isinstance(conv[4], nn.InstanceNorm1d)
    assert isinstance(convert_syncbn_model(nn.BatchNorm1d(2)), SyncBatchNorm)  # a bare BatchNorm is replaced


def test_ddp_options_without_torch_equivalent_warn_once(monkeypatch) -> None:
    monkeypatch.setattr(apex_ddp, "_warned", set())
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.warns(UserWarning) as caught:
            DistributedDataParallel(_model(), num_allreduce_streams=2, prof=True)
        assert sorted(str(w.message).split("'")[1] for w in caught) == ["num_allreduce_streams", "prof"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            DistributedDataParallel(_model(), num_allreduce_streams=2)  # second time: silent
        with pytest.raises(ValueError, match="shared_param is no longer supported"):
            DistributedDataParallel(_model(), shared_param=True)
        m = DistributedDataParallel(_model(), message_size=2**20)
        assert m.bucket_bytes_cap == 4 * 2**20 and m.delay_allreduce is False
    finally:
        dist.destroy_process_group()
