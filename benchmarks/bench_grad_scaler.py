"""Benchmark: GradScaler step overhead, fp16kit.amp.GradScaler vs torch.amp.GradScaler.

One iteration of the scaler's work on a 20-layer MLP whose gradients already exist (forward and backward
are identical for both scalers and left out)::

    scaler.scale(loss); scaler.unscale_(optimizer); scaler.step(optimizer); scaler.update()

Cases: parameter (= gradient) dtype fp32, bf16 and fp16 (torch refuses fp16 gradients: fp16kit only),
with SGD with momentum (the plain path: one host read to decide the skip) and torch's fused Adam (the
``_step_supports_amp_scaling`` hand-over; no host read). Before every timed iteration the gradients are
restored (untimed), so every iteration unscales the same values: copied into the same gradient tensors
("kept" gradients, as with ``zero_grad(set_to_none=False)``), or, for the fp32 SGD rows also marked "fresh", new
gradient tensors each iteration (as after ``zero_grad()`` and ``backward()``: fp16kit's fast path then re-checks
them every call). The scalers are timed in interleaved rounds (A B B A ...; one round = ``--iters`` iterations),
so that load from other processes hits both alike; the table gives the minimum and the median over rounds of the
per-iteration time in ms, their ratios, and the bare ``optimizer.step()`` time for reference.

Two widths: 256 (1.3M parameters: the per-element work dominates) and 32 (21K parameters: per-call Python
and dispatch overhead dominates). CPU runs use one intra-op thread (``--threads``): on a small shared
machine, two-thread ops mostly measure waiting for the other core.

Run: ``python benchmarks/bench_grad_scaler.py [--widths 32,256] [--rounds 15] [--iters 20] [--threads 1] [--out F]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from _report import write_report
from torch import nn

from fp16kit.amp import GradScaler
from fp16kit.kernels import select_backend, unscale_and_check

DEFAULT_OUT = Path(__file__).parent / "results" / "grad_scaler.md"


def make_model(width: int, depth: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "SGD momentum":
        return torch.optim.SGD(params, lr=1e-6, momentum=0.9)
    if name == "Adam fused":
        return torch.optim.Adam(params, lr=1e-6, fused=True)
    raise ValueError(name)


class Setup:
    """A model with gradients, an optimizer and a scaler; ``iteration()`` is the timed scaler work."""

    def __init__(
        self, make_scaler: Callable[[], object], width: int, depth: int, dtype, opt: str, device, fresh: bool = False
    ) -> None:
        self.model = make_model(width, depth, dtype, device)
        self.params = list(self.model.parameters())
        self.opt = make_optimizer(opt, self.params)
        self.scaler = make_scaler()
        self.device, self.fresh = device, fresh
        x = torch.randn(32, width, device=device, dtype=dtype)
        scaled = self.scaler.scale(self.model(x).float().pow(2).mean()) if self.scaler else None
        (scaled if scaled is not None else self.model(x).float().pow(2).mean()).backward()
        self.grads = [p.grad.clone() for p in self.params]
        self.loss = torch.tensor(1.5, device=device)

    def restore(self) -> None:
        if self.fresh:  # new tensors, as backward() makes after zero_grad()
            for p, g in zip(self.params, self.grads):
                p.grad = g.clone()
        else:
            torch._foreach_copy_([p.grad for p in self.params], self.grads)

    def iteration(self) -> None:
        s = self.scaler
        s.scale(self.loss)
        s.unscale_(self.opt)
        s.step(self.opt)
        s.update()

    def bare_step(self) -> None:
        self.opt.step()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def time_rounds(setups: dict[str, Setup], fn_name: str, rounds: int, iters: int) -> dict[str, list[float]]:
    """Per setup, the ms per call of each round (``iters`` calls, each after an untimed ``restore``); the setups
    take turns round by round, in alternating order (A B B A ...). On the CPU the clock is this thread's CPU time
    (all work runs on it with one intra-op thread; time the scheduler gives to other processes is not counted:
    wall-clock medians swung by 2x on the shared box); on a GPU, wall-clock time with a sync."""
    clock = time.perf_counter_ns if any(s.device.type == "cuda" for s in setups.values()) else time.thread_time_ns
    times: dict[str, list[float]] = {k: [] for k in setups}
    names = list(setups)
    for r in range(rounds + 1):  # round 0 warms up
        for key in names if r % 2 == 0 else reversed(names):
            setup, fn, total = setups[key], getattr(setups[key], fn_name), 0
            for _ in range(iters):
                setup.restore()
                setup.sync()
                t0 = clock()
                fn()
                setup.sync()
                total += clock() - t0
            if r:
                times[key].append(total / iters / 1e6)
    return times


def summary(ts: list[float]) -> tuple[float, float]:
    return min(ts), statistics.median(ts)


def header(device: torch.device, depth: int, rounds: int, iters: int) -> list[str]:
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} intra-op thread(s))"
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return [
        f"Device: {dev_name}; torch {torch.__version__}; fp16kit kernel backend: "
        f"{select_backend(device).backend.value}; {platform.python_implementation()} {platform.python_version()}; "
        f"load average at the start (1, 5, 15 min): {load}.",
        f"Model: {depth}-layer MLP ({2 * depth} parameter tensors). {rounds} interleaved rounds of {iters} iterations "
        "of scale + unscale_ + step + update; ms per iteration (thread CPU time on the CPU), minimum / median over "
        "the rounds.",
        "",
        "| width (params) | params/grads | optimizer | grads | torch.amp.GradScaler | fp16kit GradScaler "
        "| fp16kit / torch (min) | (median) | bare optimizer.step() |",
        "|---|---|---|---|---|---|---|---|---|",
    ]


def run(width: int, depth: int, rounds: int, iters: int, device: torch.device) -> list[str]:
    lines = []
    size = f"{width} ({depth * (width * width + width) / 1e6:.2f}M)"
    cell = lambda s: f"{s[0]:.3f} / {s[1]:.3f}"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for opt in ("SGD momentum", "Adam fused"):
            if opt == "Adam fused" and dtype != torch.float32 and device.type == "cpu":
                # torch's CPU fused Adam handles low-precision params, but its step then dominates; keep
                # the table to where the scaler's share is visible.
                continue
            for fresh in (False, True) if dtype == torch.float32 and opt == "SGD momentum" else (False,):
                setups = {
                    "fp16kit": Setup(lambda: GradScaler(device.type), width, depth, dtype, opt, device, fresh),
                }
                if dtype != torch.float16:  # torch: "Attempting to unscale FP16 gradients."
                    setups["torch"] = Setup(
                        lambda: torch.amp.GradScaler(device.type), width, depth, dtype, opt, device, fresh
                    )
                bare = Setup(lambda: None, width, depth, dtype, opt, device)
                times = time_rounds(setups, "iteration", rounds, iters)
                bare_t = summary(time_rounds({"bare": bare}, "bare_step", rounds, iters)["bare"])
                ours = summary(times["fp16kit"])
                if "torch" in times:
                    ref = summary(times["torch"])
                    ref_cell, ratios = cell(ref), f"{ours[0] / ref[0]:.3f}x | {ours[1] / ref[1]:.3f}x"
                else:
                    ref_cell, ratios = "refuses fp16 grads", "n/a | n/a"
                name = str(dtype).replace("torch.", "")
                row = (
                    f"| {size} | {name} | {opt} | {'fresh' if fresh else 'kept'} | {ref_cell} | {cell(ours)} "
                    f"| {ratios} | {cell(bare_t)} |"
                )
                print(row, flush=True)
                lines.append(row)
    return lines


class UnscaleCall:
    """The unscale-and-check call alone on the fp32 gradients of the same model (where the time goes)."""

    def __init__(self, impl: str, width: int, depth: int, device: torch.device) -> None:
        model = make_model(width, depth, torch.float32, device)
        self.grads = [torch.randn_like(p) for p in model.parameters()]
        self.saved = [g.clone() for g in self.grads]
        self.inv = torch.full((1,), 2.0**-16, device=device)
        self.flag = torch.zeros(1, device=device)
        self.impl, self.device = impl, device

    def restore(self) -> None:
        torch._foreach_copy_(self.grads, self.saved)

    def iteration(self) -> None:
        if self.impl == "fp16kit":
            unscale_and_check(self.grads, self.inv, self.flag)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(self.grads, self.flag, self.inv)

    sync = Setup.sync


def unscale_rows(width: int, depth: int, rounds: int, iters: int, device: torch.device) -> str:
    calls = {impl: UnscaleCall(impl, width, depth, device) for impl in ("fp16kit", "torch")}
    times = {k: summary(v) for k, v in time_rounds(calls, "iteration", rounds, iters).items()}  # type: ignore[arg-type]
    ours, ref = times["fp16kit"], times["torch"]
    return (
        f"| {width} | {ref[0]:.3f} / {ref[1]:.3f} | {ours[0]:.3f} / {ours[1]:.3f} "
        f"| {ours[0] / ref[0]:.2f}x | {(ours[0] - ref[0]) * 1e3:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="32,256", help="comma-separated MLP widths")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=21, help="interleaved rounds")
    parser.add_argument("--iters", type=int, default=20, help="iterations per round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="fp16kit GradScaler: unscaling float16")  # expected, once per scaler
    lines = ["# GradScaler step overhead: fp16kit vs torch", "", *header(device, args.depth, args.rounds, args.iters)]
    widths = [int(w) for w in args.widths.split(",")]
    for width in widths:
        lines += run(width, args.depth, args.rounds, args.iters, device)
    lines += [
        "",
        "The unscale-and-check call alone, fp32 gradients of the same model: "
        "`fp16kit.kernels.unscale_and_check` vs `torch._amp_foreach_non_finite_check_and_unscale_`, ms (min / median; "
        "the GradScaler's CPU fast path calls the torch op itself):",
        "",
        "| width | torch op | fp16kit.kernels.unscale_and_check | ratio | difference (us) |",
        "|---|---|---|---|---|",
        *(unscale_rows(width, args.depth, args.rounds, args.iters, device) for width in widths),
    ]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
