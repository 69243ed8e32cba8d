"""Host cost of an optimizer step on many tiny params: FusedAdam / FusedLAMB against torch's AdamW.

Every param has 4 fp32 elements on the CPU, so the kernels' own work is negligible and a step's time is its
host (Python and dispatch) cost. Two ways of keeping grads between steps:

* ``kept``: ``zero_grad(set_to_none=False)`` (the same grad tensors every step: a cache keyed on addresses hits);
* ``fresh``: ``zero_grad(set_to_none=True)`` and new grad tensors each step (torch's default: a backward pass
  allocates new grads), the re-allocation itself is not timed.

Rounds are interleaved (one timed block of each implementation per round, ``--steps`` steps each) so load from
other processes hits all alike; per implementation the min and the median over rounds of the time per step,
and that divided by the number of params (us per param). Peers: ``torch.optim.AdamW(fused=True)`` and
``foreach=True`` in the same run. ``--profile NAME`` runs cProfile on one implementation instead.

Usage: ``python benchmarks/bench_optim_host.py [--sizes 40,400,4000] [--rounds 15] [--steps 20]
[--modes kept,fresh] [--profile fused_adam:400:fresh]``. The torch backend is forced and 1 thread.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch

from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdam, FusedLAMB

MAKERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "fused_adam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    "fused_lamb": lambda ps: FusedLAMB(ps, lr=1e-3, weight_decay=0.01),
    "torch_adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
    "torch_adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
}


def setup(name: str, n: int) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = [torch.randn(4, requires_grad=True) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(4) * 1e-2
    opt = MAKERS[name](params)
    opt.step()  # state made, caches warm
    opt.step()
    return params, opt


def timed(params: list[torch.Tensor], opt: torch.optim.Optimizer, mode: str, steps: int) -> float:
    """Seconds per step (the grad re-allocation of the ``fresh`` mode is outside the timer)."""
    total = 0.0
    for _ in range(steps):
        if mode == "fresh":
            for p in params:
                p.grad = torch.full((4,), 1e-3)
        t0 = time.perf_counter()
        opt.step()
        total += time.perf_counter() - t0
    return total / steps


def bench(sizes: list[int], modes: list[str], rounds: int, steps: int) -> list[dict]:
    rows = []
    for n in sizes:
        for mode in modes:
            setups = {name: setup(name, n) for name in MAKERS}
            times: dict[str, list[float]] = {name: [] for name in MAKERS}
            for _ in range(rounds):
                for name, (params, opt) in setups.items():
                    times[name].append(timed(params, opt, mode, steps))
            for name, ts in times.items():
                rows.append({"n": n, "mode": mode, "impl": name, "min": min(ts), "med": statistics.median(ts)})
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        "| params | grads | implementation | min ms/step | median ms/step | min us/param | median us/param | "
        "median / torch fused |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    peer = {(r["n"], r["mode"]): r["med"] for r in rows if r["impl"] == "torch_adamw_fused"}
    for r in rows:
        n = r["n"]
        lines.append(
            f"| {n} | {r['mode']} | {r['impl']} | {r['min'] * 1e3:.3f} | {r['med'] * 1e3:.3f} | "
            f"{r['min'] * 1e6 / n:.3f} | {r['med'] * 1e6 / n:.3f} | {r['med'] / peer[(n, r['mode'])]:.2f} |"
        )
    return "\n".join(lines)


def profile(spec: str, steps: int) -> None:
    name, n, mode = spec.split(":")
    params, opt = setup(name, int(n))
    prof = cProfile.Profile()
    prof.enable()
    timed(params, opt, mode, steps)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="40,400,4000")
    ap.add_argument("--modes", default="kept,fresh")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", default=None, help="impl:n:mode, e.g. fused_adam:400:fresh")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with use_backend("torch"):
        if args.profile:
            profile(args.profile, args.steps)
            return
        rows = bench([int(s) for s in args.sizes.split(",")], args.modes.split(","), args.rounds, args.steps)
    print(report(rows))


if __name__ == "__main__":
    main()
