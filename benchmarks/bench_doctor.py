"""Benchmark: what ``fp16kit.doctor.watch`` costs a training step of the demo model.

One training step of the demo (``fp16kit/demo``: MLP 64-128-128-10 with batchnorm, batch 64, SGD with
momentum, apex-style amp at O2 with its dynamic loss scaler): forward, ``amp.scale_loss`` backward,
``optimizer.step()``. Six copies of the same model train side by side, step by step in turn (so load from
other processes hits all alike; who goes first rotates): not watched (twice, built first and last: the
difference between the two copies is the noise floor; ratios are to the faster one), watched with
``every=100`` (the target: <= 5% per step) and with ``every=1`` (every step sampled, for reference), each with
parameter gradients only and with activations.

Sampling happens on one step in ``every``, so the cost is a mean over many steps: the table gives the mean
step time (ms) over ``--steps`` steps after a warm-up, the median (p20-p80) for the shape of the distribution,
and the ratio of means to the unwatched run. A step's time ends with ``torch.cuda.synchronize`` on a GPU. On
the CPU the clock is the thread's CPU time (``time.thread_time``, one intra-op thread): on a shared machine
wall time mostly measures waiting for a core (we saw p80/p20 of 9x in wall time), CPU time does not.

Run: ``python benchmarks/bench_doctor.py [--steps 2000] [--threads 1] [--device cpu] [--out F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from _report import write_report
from torch.nn import functional as F

from fp16kit import amp, doctor
from fp16kit.demo.data import load_digits_split
from fp16kit.demo.train import make_model
from fp16kit.kernels import select_backend

DEFAULT_OUT = Path(__file__).parent / "results" / "doctor.md"
CASES = (
    ("not watched (copy A)", None, False),
    ("every=100", 100, False),
    ("every=100, activations", 100, True),
    ("every=1", 1, False),
    ("every=1, activations", 1, True),
    ("not watched (copy B)", None, False),
)


class Run:
    def __init__(self, every: int | None, activations: bool, device: torch.device, data) -> None:
        model = make_model(128, 0).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        self.model, self.opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, scale_window=100)
        scaler = self.opt._amp_stash.session.scalers[0]
        self.watch = (doctor.watch(self.model, every=every, activations=activations, scaler=scaler)
                      if every else contextlib.nullcontext())
        self.gen = torch.Generator().manual_seed(0)
        self.data = data
        self.times: list[float] = []

    def step(self, device: torch.device) -> None:
        idx = torch.randint(0, self.data.x_train.shape[0], (64,), generator=self.gen).to(device)
        clock = time.perf_counter if device.type == "cuda" else time.thread_time
        start = clock()
        loss = F.cross_entropy(self.model(self.data.x_train[idx]), self.data.y_train[idx])
        self.opt.zero_grad()
        with amp.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.times.append(clock() - start)


def run(steps: int, warmup: int, device: torch.device) -> list[str]:
    data = load_digits_split(seed=0).to(device)
    runs = {label: Run(every, act, device, data) for label, every, act in CASES}
    with contextlib.ExitStack() as stack:
        for r in runs.values():
            stack.enter_context(r.watch)
        order = list(runs.values())
        for i in range(warmup + steps):
            for j in range(len(order)):  # rotate who goes first: the order of the turn otherwise shows up
                order[(i + j) % len(order)].step(device)
            if i + 1 == warmup:
                for r in runs.values():
                    r.times.clear()
    # conservative: against the faster unwatched copy (the two differ by the noise floor, a few %, apparently
    # from where each model's tensors landed in memory: the first one built is slower in every run we made)
    base = min(statistics.fmean(r.times) for label, r in runs.items() if label.startswith("not watched"))
    rows = []
    for label, r in runs.items():
        ms = [t * 1e3 for t in r.times]
        q = statistics.quantiles(ms, n=10)
        rows.append(f"| {label} | {statistics.fmean(ms):.3f} | {statistics.median(ms):.3f} ({q[1]:.3f}-{q[7]:.3f}) | "
                    f"{statistics.fmean(r.times) / base:.3f} |")
        if isinstance(r.watch, doctor.Watcher):
            assert r.watch.samples == -(-(warmup + steps) // r.watch.every)  # every sampled step was histogrammed
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    dev_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"CPU ({os.cpu_count()} cores, {args.threads} intra-op thread(s))")
    lines = [
        "# fp16kit.doctor overhead: a training step of the demo model, watched and not",
        "",
        f"Device: {dev_name}; torch {torch.__version__}; fp16kit kernel backend: "
        f"{select_backend(device).backend.value}; {platform.python_implementation()} {platform.python_version()}.",
        f"Demo MLP 64-128-128-10 with batchnorm (8 parameter tensors, 26K parameters, 6 leaf modules), batch 64, "
        f"SGD momentum, amp O2. {args.steps} steps per case after {args.warmup} warm-up steps, the cases stepped in "
        f"turn. ms per step ({'wall time' if device.type == 'cuda' else 'CPU time of the training thread'}).",
        "",
        "| watching | mean | median (p20-p80) | mean / faster unwatched copy |",
        "|---|---|---|---|",
        *run(args.steps, args.warmup, device),
        "",
        "Command: `python benchmarks/bench_doctor.py " + " ".join(
            f"--{k} {v}" for k, v in (("steps", args.steps), ("threads", args.threads), ("device", args.device))
        ) + "`.",
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
