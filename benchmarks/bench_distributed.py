"""Sharded optimizer steps at world size 1, 2 and 4 (gloo, CPU, 127.0.0.1): time and bytes communicated.

Workload: a BERT-shaped parameter list (``bench_optim.bert_shapes``, scaled down; two param groups, weight
decay 0.01 on matrices) distributed FSDP2-style: every tensor a DTensor ``Shard(0)`` over a 1-D mesh, grads
likewise. Per world size, interleaved round-robin on every rank (so load hits all alike): fp16kit FusedLAMB,
fp16kit FusedAdam and torch.optim.AdamW (foreach, on the same DTensors), plus, for scale, one
``reduce_scatter_tensor`` of all gradients as one fp32 buffer (what FSDP2 sends per step for the grads).

Reported per optimizer: median step ms (p20-p80) on rank 0, the optimizer's own all-reduces per step, the
bytes each rank contributes to them, the time spent inside them, and the gradient reduce-scatter for
comparison. World size 1 runs the same DTensor path on a one-rank mesh (the collectives are trivial).

The machine is a shared 2-core box: at world size 4 four processes share two cores, and other jobs run
beside them, so times are noisy and grow with the world size for reasons that have nothing to do with the
algorithm. The byte counts are exact.

Usage: ``python benchmarks/bench_distributed.py [--quick] [--out benchmarks/results/distributed.md]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_optim import bert_shapes, interleaved, pct


def _worker(rank: int, world: int, port: int, out_dir: str, quick: bool) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _measure(rank, world, out_dir, quick)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, out_dir: str, quick: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp16kit.kernels import use_backend
    from fp16kit.optim import FusedAdam, FusedLAMB, _sharding

    shapes = bert_shapes(hidden=128, layers=2, ffn=512, vocab=4096) if quick else bert_shapes(256, 4, 1024, 8192)
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    full = [(torch.randn(s, generator=gen) * 0.02, torch.randn(s, generator=gen) * 1e-3, wd) for s, wd in shapes]
    n_params = sum(p.numel() for p, _, _ in full)

    def groups():
        decay, no_decay = [], []
        for p, g, wd in full:
            q = torch.nn.Parameter(distribute_tensor(p.clone(), mesh, [Shard(0)]))
            q.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            (decay if wd else no_decay).append(q)
        return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]

    # time inside the optimizers' own all-reduces (a wrapper, for this benchmark only)
    comm_time = {"s": 0.0}
    inner = _sharding.ShardPlan._all_reduce

    def timed(self, buf):
        t0 = time.perf_counter()
        inner(self, buf)
        comm_time["s"] += time.perf_counter() - t0

    _sharding.ShardPlan._all_reduce = timed
    opts = {
        "fp16kit FusedLAMB": FusedLAMB(groups(), lr=1e-3),
        "fp16kit FusedAdam": FusedAdam(groups(), lr=1e-3),
        "torch AdamW (foreach)": torch.optim.AdamW(groups(), lr=1e-3, foreach=True),
    }
    padded = -(-n_params // world) * world
    flat, shard = torch.randn(padded), torch.empty(padded // world)
    rounds = 5 if quick else 15
    comm: dict[str, list[float]] = {name: [] for name in opts}

    def stepper(name, opt):
        def run():
            before = comm_time["s"]
            opt.step()
            comm[name].append(comm_time["s"] - before)

        return run

    steps = {name: stepper(name, opt) for name, opt in opts.items()}
    steps["grad reduce-scatter (fp32, FSDP2's per step)"] = lambda: dist.reduce_scatter_tensor(shard, flat)
    with use_backend("torch"):
        times = interleaved(steps, rounds, sync=lambda: None)
    rows = []
    for name, ts in times.items():
        opt = opts.get(name)
        plan = getattr(opt, "_shard_plan", None)
        if plan is not None:
            calls, nbytes, inside = plan.all_reduces, plan.bytes_reduced, statistics.median(comm[name][-rounds:])
        elif opt is None:  # the reduce-scatter: bytes each rank sends in a ring
            calls, nbytes, inside = 1, int(padded * 4 * (world - 1) / world), statistics.median(ts)
        else:
            calls, nbytes, inside = 0, 0, 0.0  # AdamW: no collective of its own (DTensor math stays local)
        rows.append((name, statistics.median(ts), pct(ts, 0.2), pct(ts, 0.8), calls, nbytes, inside))
    if rank == 0:
        torch.save({"world": world, "n_params": n_params, "n_tensors": len(shapes), "rows": rows},
                   os.path.join(out_dir, f"world{world}.pt"))


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer rounds")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "distributed.md"))
    args = ap.parse_args()
    lines = [
        "# Sharded optimizer steps (benchmarks/bench_distributed.py)",
        "",
        f"torch {torch.__version__}, gloo on 127.0.0.1, CPU, torch fallback (no GPU on this machine). "
        "**Shared, noisy 2-core box**: world size 4 runs four processes on two cores beside other jobs; "
        "compare rows within one world size, not times across world sizes. Byte counts are exact.",
        "",
        "| world | optimizer | median ms (p20-p80) | own all-reduces / step | bytes / rank / step | ms in them |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as out_dir:
        for world in (1, 2, 4):
            mp.spawn(_worker, args=(world, _free_port(), out_dir, args.quick), nprocs=world, join=True)
            res = torch.load(os.path.join(out_dir, f"world{world}.pt"))
            for name, med, p20, p80, calls, nbytes, inside in res["rows"]:
                lines.append(f"| {world} | {name} | {med * 1e3:.2f} ({p20 * 1e3:.2f}-{p80 * 1e3:.2f}) | {calls} | "
                             f"{nbytes:,} | {inside * 1e3:.3f} |")
        lines += ["", f"Model: {res['n_params']:,} parameters in {res['n_tensors']} tensors (BERT-shaped)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
