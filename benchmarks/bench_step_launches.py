"""Launches and torch ops per optimizer step, counted on the CPU (Triton's interpreter): the device-resident step
against the host-vector step it replaced (the same kernels fed a float32 hyper-parameter vector built by torch ops).

Triton launches are counted at the launchers; every other torch op by a ``TorchDispatchMode`` around one step (grads
kept between steps). On a GPU each torch op here is a kernel launch or a copy. Prints markdown.

Usage: ``TRITON_INTERPRET=1 python benchmarks/bench_step_launches.py [--sizes 12,48]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "optim"))
from test_device_step import _params, _step_fn, counting

from fp16kit.amp import GradScaler
from fp16kit.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from fp16kit.optim._apex_common import ApexStateOptimizer
from fp16kit.optim._base import FusedOptimizer

MAKERS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-3, weight_decay=0.01),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
}
#: the classes whose ``_on_device`` decides the path (apex's optimizers check their rows too)
DECIDERS = (FusedOptimizer, ApexStateOptimizer)


def one_step(name: str, n: int, scaler: bool) -> tuple[int, int]:
    """Triton launches and torch ops of the third step over ``n`` params of 8 elements (grads kept)."""
    opt = MAKERS[name](_params(n, numel=8, seed=n))
    step = _step_fn(opt, GradScaler("cpu", init_scale=256.0) if scaler else None)
    step()
    step()
    with counting() as (launches, ops):
        step()
    return sum(launches.values()), sum(ops.counts.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="12,48")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print("| optimizer | scaler | params | device step: Triton launches | torch ops | host-vector step: Triton "
          "launches | torch ops |")
    print("|---|---|---|---|---|---|---|")
    originals = [cls.__dict__["_on_device"] for cls in DECIDERS]
    for name in MAKERS:
        for scaler in (False, True):
            for n in sizes:
                dl, do = one_step(name, n, scaler)
                for cls in DECIDERS:
                    cls._on_device = lambda self, device: False
                ll, lo = one_step(name, n, scaler)
                for cls, fn in zip(DECIDERS, originals):
                    cls._on_device = fn
                print(f"| {name} | {'GradScaler' if scaler else '-'} | {n} | {dl} | {do} | {ll} | {lo} |")


if __name__ == "__main__":
    main()
