"""Our own Python per device step: FusedAdam / FusedLAMB's device-resident step with the Triton launches stubbed.

On a GPU the device step's host time is our Python plus Triton's launcher per launch (2 launches for FusedAdam, 3
for FusedLAMB) plus the CUDA driver. This measures the first part on the CPU: Triton's interpreter is the backend
(``TRITON_INTERPRET=1``), so the step takes the device path, and every ``@triton.jit`` launch is replaced by a
counter (the interpreter's own cost, and the kernels' work, are not in the figure). Params of 64 fp32 elements,
grads kept between steps (as a captured or steady training loop has them), 1 thread, thread CPU time.

Before and after in one run: rounds interleave the steady-state fast path (``after``: the step replayed from its
recorded plan once ``SteadyPlan.holds`` has checked the rows, state and settings, ``fp16kit/optim/_steady.py``) and
the full path every step took before the replay existed (``before``: the same optimizer code with the replay switched
off: rows collected and checked, hyper-parameters validated, launches planned), each round timing ``--steps`` steps
of each; medians (and p20/p80) over ``--rounds``. Both run through ``FusedOptimizer.step`` as a training loop
without step hooks or a profiler calls it (torch's hook-and-profile wrapper is then skipped,
``fp16kit/optim/_base.py``). "late" repeats the after figure after ``--late`` more steps: the cost per step does not
grow with the number of steps taken. Also printed: launches per step (counted at the stub) and the load average at
the start and the end (the box may be shared: absolute figures move with it).

Usage: ``python benchmarks/bench_device_step_host.py [--params 200,1000] [--rounds 41] [--steps 50]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch
from triton.runtime.interpreter import InterpretedFunction

from fp16kit.optim import FusedAdam, FusedLAMB, _base

MAKERS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0),
}
launches = {"n": 0}


def _stub(self, *args, **kwargs):  # the interpreter's launch, replaced by a counter
    launches["n"] += 1


def _params(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    ps = [torch.randn(64, generator=g).requires_grad_() for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(64, generator=g) * 1e-2
    return ps


def _timed(opt: torch.optim.Optimizer, replay: bool, steps: int) -> float:
    """Thread CPU seconds per step."""
    _base.FusedOptimizer.device_replay = replay
    t0 = time.thread_time()
    for _ in range(steps):
        opt.step()
    return (time.thread_time() - t0) / steps


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="200,1000")
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--late", type=int, default=3000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    original = InterpretedFunction.run
    InterpretedFunction.run = _stub
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        print("| optimizer | params | before: ms/step (p20-p80) | after | after, late | before / after | "
              "launches per step (before, after) |")
        print("|---|---|---|---|---|---|---|")
        for n in (int(x) for x in args.params.split(",")):
            for name, make in MAKERS.items():
                opt = make(_params(n))
                for replay in (False, True, True):
                    _timed(opt, replay, 5)  # state made, plans and replay recorded
                counts = []
                for replay in (False, True):
                    launches["n"] = 0
                    _timed(opt, replay, 10)
                    counts.append(launches["n"] / 10)
                before, after = [], []
                for _ in range(args.rounds):
                    before.append(_timed(opt, False, args.steps))
                    after.append(_timed(opt, True, args.steps))
                _timed(opt, True, args.late)
                late = [_timed(opt, True, args.steps) for _ in range(max(5, args.rounds // 4))]
                b, a, lt = (statistics.median(x) * 1e3 for x in (before, after, late))
                print(f"| {name} | {n} | {b:.3f} ({_pct(before, .2) * 1e3:.3f}-{_pct(before, .8) * 1e3:.3f}) | "
                      f"{a:.3f} ({_pct(after, .2) * 1e3:.3f}-{_pct(after, .8) * 1e3:.3f}) | {lt:.3f} | {b / a:.2f}x | "
                      f"{counts[0]:g}, {counts[1]:g} |")
    finally:
        InterpretedFunction.run = original
        _base.FusedOptimizer.device_replay = True
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
