"""DistributedDataParallel: 2 CPU processes (gloo), O1 and O2, match one process on the same global batch.

One spawn runs both levels (process start-up dominates the cost). ``initialize`` comes first, then the
DDP wrap (apex's rule). Only rank 0 prints the initialize text.

Tolerance: the two runs differ only in how the weight-gradient reduction over the 64 rows is split. O1
computes the linear layers' grads in fp16 (each rank rounds its 32-row sum to fp16, then the fp32
all-reduce averages them); O2 all-reduces the fp16 scaled grads themselves (an fp16 sum, halved). Either
way each step's gradient differs from the single-process one by at most ~2 fp16 ulps of the gradient
(two roundings of the halves, one of their sum), so after the steps the fp32 params differ by at most
``sum_k lr * 2 * ulp_fp16(|g_k|)``; we allow twice that for the second-order effect (later gradients
computed at params that already differ by that much).

The two ranks start through ``tests/distributed/_spawn.py``: a ``file://`` rendezvous (no free-port race: the
SIGABRT of issue 22), gloo on 127.0.0.1 only, and a hard timeout.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from frontend_helpers import batch
from torch import nn
from torch.nn import functional as F

from fp16kit import amp
from fp16kit.kernels import use_backend
from fp16kit.numerics.formats import ulp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import _spawn

STEPS, LR, GLOBAL_BATCH = 3, 0.1, 64


def _run(level: str, rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=1)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    grads, start = [], [p.detach().clone() for p in amp.master_params(opt)]
    share = GLOBAL_BATCH // world
    for step in range(STEPS):
        x, y = batch(step, n=GLOBAL_BATCH)
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        grads.append([p.grad.detach().clone() for p in amp.master_params(opt)])
        opt.step()
    module = model.module if world > 1 else model
    return {"params": [p.detach().clone() for p in module.parameters()],
            "masters": [p.detach().clone() for p in amp.master_params(opt)], "grads": grads, "start": start}


def _worker(rank: int, world: int, out_dir: str) -> None:
    """One rank (``_spawn`` has joined the gloo group); what it prints goes to ``stdout<rank>.txt``."""
    log, sys.stdout = sys.stdout, open(os.path.join(out_dir, f"stdout{rank}.txt"), "w")  # noqa: SIM115
    try:
        with use_backend("torch"):
            results = {level: _run(level, rank, world) for level in ("O1", "O2")}
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "rank0.pt"))
    finally:
        sys.stdout.close()
        sys.stdout = log


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_process_ddp_matches_single_process(tmp_path, capsys):
    _spawn.run(_worker, 2, tmp_path, timeout=240)
    got = torch.load(tmp_path / "rank0.pt")
    rank0 = (tmp_path / "stdout0.txt").read_text()
    rank1 = (tmp_path / "stdout1.txt").read_text()
    assert rank0.count("Selected optimization level") == 2 and rank1 == ""

    for level in ("O1", "O2"):
        ref = _run(level, 0, 1)
        assert capsys.readouterr().out.startswith("Selected optimization level")
        bounds = [sum(LR * 2 * ulp(step[i].abs(), torch.float16) for step in ref["grads"]) * 2
                  for i in range(len(ref["masters"]))]
        for i, (a, b, bound) in enumerate(zip(got[level]["masters"], ref["masters"], bounds)):
            err = (a.double() - b.double()).abs()
            assert (err <= bound).all(), f"{level} master {i}: excess {float((err - bound).max()):.3g}"
        for a, b in zip(got[level]["params"], ref["params"]):
            assert a.dtype == b.dtype == (torch.float16 if level == "O2" else torch.float32)
        # not vacuous: training moved every tensor far beyond the tolerance
        for start, end, bound in zip(ref["start"], ref["masters"], bounds):
            assert float((end.double() - start.double()).abs().max()) > 10 * float(bound.max())
