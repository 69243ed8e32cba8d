"""Benchmark: GradScaler step overhead, fp16kit.amp.GradScaler vs torch.amp.GradScaler.

One iteration of the scaler's work on a 20-layer MLP whose gradients already exist (forward and backward
are identical for both scalers and left out)::

    scaler.scale(loss); scaler.unscale_(optimizer); scaler.step(optimizer); scaler.update()

Cases: parameter (= gradient) dtype fp32, bf16 and fp16 (torch refuses fp16 gradients: fp16kit only),
with SGD with momentum (the plain path: one host read to decide the skip) and torch's fused Adam (the
``_step_supports_amp_scaling`` hand-over; no host read). Before every timed iteration the gradients are
restored from a copy (untimed), so every iteration unscales the same values. The two scalers are
timed alternately, iteration by iteration, so that load from other processes hits both alike; the table
gives the median (p20-p80) in ms, the bare ``optimizer.step()`` time for reference, and the ratio.

Two widths: 256 (1.3M parameters: the per-element work dominates) and 32 (21K parameters: per-call Python
and dispatch overhead dominates). CPU runs use one intra-op thread (``--threads``): on a small shared
machine, two-thread ops mostly measure waiting for the other core.

Run: ``python benchmarks/bench_grad_scaler.py [--widths 32,256] [--reps 60] [--threads 1] [--device cpu] [--out F]``.
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

    def __init__(self, make_scaler: Callable[[], object], width: int, depth: int, dtype, opt: str, device) -> None:
        self.model = make_model(width, depth, dtype, device)
        self.params = list(self.model.parameters())
        self.opt = make_optimizer(opt, self.params)
        self.scaler = make_scaler()
        self.device = device
        x = torch.randn(32, width, device=device, dtype=dtype)
        scaled = self.scaler.scale(self.model(x).float().pow(2).mean()) if self.scaler else None
        (scaled if scaled is not None else self.model(x).float().pow(2).mean()).backward()
        self.grads = [p.grad.clone() for p in self.params]
        self.loss = torch.tensor(1.5, device=device)

    def restore(self) -> None:
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


def time_alternating(setups: dict[str, Setup], fn_name: str, reps: int, warmup: int = 5) -> dict[str, list[float]]:
    """Per-setup lists of ms, the setups taking turns each repetition."""
    times: dict[str, list[float]] = {k: [] for k in setups}
    for rep in range(warmup + reps):
        for key, setup in setups.items():
            setup.restore()
            setup.sync()
            t0 = time.perf_counter()
            getattr(setup, fn_name)()
            setup.sync()
            if rep >= warmup:
                times[key].append((time.perf_counter() - t0) * 1e3)
    return times


def summary(ts: list[float]) -> tuple[float, float, float]:
    ts = sorted(ts)
    return statistics.median(ts), ts[int(0.2 * (len(ts) - 1))], ts[int(0.8 * (len(ts) - 1))]


def header(device: torch.device, depth: int, reps: int) -> list[str]:
    if device.type == "cuda":
        dev_name = torch.cuda.get_device_name(device)
    else:
        dev_name = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} intra-op thread(s))"
    return [
        f"Device: {dev_name}; torch {torch.__version__}; fp16kit kernel backend: "
        f"{select_backend(device).backend.value}; {platform.python_implementation()} {platform.python_version()}.",
        f"Model: {depth}-layer MLP ({2 * depth} parameter tensors). Median of {reps} alternating repetitions "
        f"(p20-p80), ms per iteration of scale + unscale_ + step + update.",
        "",
        "| width (params) | params/grads | optimizer | torch.amp.GradScaler | fp16kit GradScaler | fp16kit / torch "
        "| bare optimizer.step() |",
        "|---|---|---|---|---|---|---|",
    ]


def run(width: int, depth: int, reps: int, device: torch.device) -> list[str]:
    lines = []
    size = f"{width} ({depth * (width * width + width) / 1e6:.2f}M)"
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for opt in ("SGD momentum", "Adam fused"):
            if opt == "Adam fused" and dtype != torch.float32 and device.type == "cpu":
                # torch's CPU fused Adam handles low-precision params, but its step then dominates; keep
                # the table to where the scaler's share is visible.
                continue
            setups = {
                "fp16kit": Setup(lambda: GradScaler(device.type), width, depth, dtype, opt, device),
            }
            if dtype != torch.float16:  # torch: "Attempting to unscale FP16 gradients."
                setups["torch"] = Setup(lambda: torch.amp.GradScaler(device.type), width, depth, dtype, opt, device)
            bare = Setup(lambda: None, width, depth, dtype, opt, device)
            times = time_alternating(setups, "iteration", reps)
            bare_t = summary(time_alternating({"bare": bare}, "bare_step", reps)["bare"])
            ours = summary(times["fp16kit"])
            cell = lambda s: f"{s[0]:.3f} ({s[1]:.3f}-{s[2]:.3f})"
            if "torch" in times:
                ref = summary(times["torch"])
                ref_cell, ratio = cell(ref), f"{ours[0] / ref[0]:.2f}x"
            else:
                ref_cell, ratio = "refuses fp16 grads", "n/a"
            name = str(dtype).replace("torch.", "")
            lines.append(f"| {size} | {name} | {opt} | {ref_cell} | {cell(ours)} | {ratio} | {cell(bare_t)} |")
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


def unscale_rows(width: int, depth: int, reps: int, device: torch.device) -> str:
    calls = {impl: UnscaleCall(impl, width, depth, device) for impl in ("fp16kit", "torch")}
    times = {k: summary(v) for k, v in time_alternating(calls, "iteration", reps).items()}  # type: ignore[arg-type]
    ours, ref = times["fp16kit"], times["torch"]
    return (
        f"| {width} | {ref[0]:.3f} ({ref[1]:.3f}-{ref[2]:.3f}) | {ours[0]:.3f} ({ours[1]:.3f}-{ours[2]:.3f}) "
        f"| {ours[0] / ref[0]:.2f}x | {(ours[0] - ref[0]) * 1e3:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="32,256", help="comma-separated MLP widths")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    parser.add_argument("--depth", type=int, default=20)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="fp16kit GradScaler: unscaling float16")  # expected, once per scaler
    lines = ["# GradScaler step overhead: fp16kit vs torch", "", *header(device, args.depth, args.reps)]
    widths = [int(w) for w in args.widths.split(",")]
    for width in widths:
        lines += run(width, args.depth, args.reps, device)
    lines += [
        "",
        "The unscale-and-check call alone, fp32 gradients of the same model: "
        "`fp16kit.kernels.unscale_and_check` vs `torch._amp_foreach_non_finite_check_and_unscale_`, ms:",
        "",
        "| width | torch op | fp16kit.kernels.unscale_and_check | ratio | difference (us) |",
        "|---|---|---|---|---|",
        *(unscale_rows(width, args.depth, args.reps, device) for width in widths),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
