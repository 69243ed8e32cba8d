"""Step time of apex's other optimizers in fp16kit (FusedSGD, FusedAdagrad, FusedNovoGrad, LARC) against
torch.optim.SGD / Adagrad on the same params and grads, CPU (torch fallback; the Triton kernels need a GPU).

Shapes, timing and bandwidth as ``bench_optim.py`` (imported from it): a BERT-base-*shaped* parameter list
scaled down (hidden 256, 12 layers, FFN 1024, vocab 4096; ~11M params, two groups, weight decay 0.01 on
matrices), fp32 params, steps interleaved round-robin, median and p20/p80 over the rounds. GB/s = minimal
memory traffic (bytes/param below) / time. The headline is the ratio to the torch peer in the same run.

Usage: ``python benchmarks/bench_apex_optim.py [--rounds N] [--out benchmarks/results/apex_optim.md]``.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
from pathlib import Path

import torch
from bench_optim import bert_shapes, copy_bandwidth, groups_for, interleaved, make_groups, pct

from fp16kit.kernels import use_backend
from fp16kit.optim import LARC, FusedAdagrad, FusedNovoGrad, FusedSGD

# Minimal bytes per parameter per step, fp32 (every tensor read once and written once per pass).
BYTES = {
    "sgd": 4 + 12 + 8,  # fp16kit: check pass reads g; one pass reads g, p, m and writes p, m
    "torch_sgd": 12 + 8,  # torch: no check pass
    "adagrad": 4 + 12 + 8,
    "torch_adagrad": 12 + 8,
    "novograd": 4 + 4 + 12 + 8,  # check pass, per-tensor norm pass, update pass (g, p, m -> p, m)
    "larc_sgd": 4 + 4 + 8 + 8 + 12 + 8,  # |p|, |g| passes, g *= a, g += (wd a) p, then FusedSGD
}

# (name, factory(groups) -> optimizer, bytes key, peer name)
CASES = [
    ("fp16kit FusedSGD (momentum 0.9)", lambda g: FusedSGD(g, lr=0.1, momentum=0.9), "sgd", "torch SGD (foreach)"),
    ("torch SGD (foreach)", lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, foreach=True), "torch_sgd", None),
    ("torch SGD (fused)", lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, fused=True), "torch_sgd", None),
    ("fp16kit FusedAdagrad", lambda g: FusedAdagrad(g, lr=0.01), "adagrad", "torch Adagrad (foreach)"),
    ("torch Adagrad (foreach)", lambda g: torch.optim.Adagrad(g, lr=0.01, foreach=True), "torch_adagrad", None),
    ("torch Adagrad (fused)", lambda g: torch.optim.Adagrad(g, lr=0.01, fused=True), "torch_adagrad", None),
    ("fp16kit FusedNovoGrad", lambda g: FusedNovoGrad(g, lr=0.01), "novograd", None),
    ("fp16kit LARC(FusedSGD)", lambda g: LARC(FusedSGD(g, lr=0.1, momentum=0.9)), "larc_sgd", "torch SGD (foreach)"),
]


def run(rounds: int) -> list[str]:
    shapes = bert_shapes(256, 12, 1024, 4096)
    n = sum(torch.Size(s).numel() for s, _ in shapes)
    copy_gbs = copy_bandwidth("cpu")
    steps, keys, keep = {}, {}, []
    for name, factory, key, _ in CASES:
        groups = make_groups(shapes, torch.float32, "cpu")
        try:
            opt = factory(groups_for(*groups))
            opt.step()
        except (RuntimeError, TypeError) as exc:  # e.g. a torch without fused CPU kernels
            print(f"skipped {name}: {exc}")
            continue
        keep.append((groups, opt))
        steps[name], keys[name] = opt.step, key
    with use_backend("torch"):
        times = interleaved(steps, rounds, lambda: None)
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [
        "## CPU, fp32 params (torch fallback)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}. Measured copy bandwidth {copy_gbs:.1f} GB/s (read + write). "
        f"BERT-base-shaped params: {n / 1e6:.1f}M, {len(shapes)} tensors; {rounds} interleaved rounds.",
        "",
        "| optimizer | ms/step (median) | p20–p80 | B/param | GB/s | vs peer |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, _, key, peer in CASES:
        if name not in med:
            continue
        t = med[name]
        rel = f"{t / med[peer]:.2f}x {peer}" if peer in med else "-"
        lines.append(
            f"| {name} | {t * 1e3:.1f} | {pct(times[name], 0.2) * 1e3:.1f}–{pct(times[name], 0.8) * 1e3:.1f} "
            f"| {BYTES[key]} | {BYTES[key] * n / t / 1e9:.1f} | {rel} |"
        )
    del keep
    gc.collect()
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    text = "\n".join(["# apex optimizers: step time", "", *run(args.rounds)])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
