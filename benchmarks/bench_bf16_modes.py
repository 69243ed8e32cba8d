"""Bytes per parameter, step time and tiny-BERT loss of each weight mode of FusedAdam and FusedLAMB (docs/optim.md,
"bf16 weights without fp32 masters"): fp32 masters (``master_weights=True``), plain bf16 (``False``), ``"split"``
and ``"stochastic"``, with fp32 params as the reference row.

Columns: bytes per param held between steps (weights + optimizer state); memory traffic per param per step on the
Triton kernel path (the check pass and the update passes, every tensor read and written once per pass, bf16 grads);
step time, median and p20-p80 (and the minimum) over interleaved rounds (bench_optim.py's method), on the CPU
(torch backend) and, when CUDA is available, on the GPU (Triton kernels; then GB/s = traffic / time); the final
fp32 loss of the tiny BERT of ``tests/optim/test_bf16_bert.py`` (60 steps, fixed batch).

Usage: ``python benchmarks/bench_bf16_modes.py [--quick] [--out benchmarks/results/bf16_modes.md]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "optim"))
from bench_optim import bert_shapes, groups_for, interleaved, make_groups
from test_bf16_bert import train_tiny_bert

from fp16kit.optim import FusedAdam, FusedLAMB

MODES: dict[str, tuple[torch.dtype, bool | str]] = {
    "fp32 params": (torch.float32, False),
    "bf16 + fp32 masters": (torch.bfloat16, True),
    "bf16 plain (nearest)": (torch.bfloat16, False),
    "bf16 split (16+16)": (torch.bfloat16, "split"),
    "bf16 stochastic": (torch.bfloat16, "stochastic"),
}
#: Held between steps per param: weights + masters/low halves + m + v.
STATE_BYTES = {"fp32 params": 4 + 8, "bf16 + fp32 masters": 2 + 4 + 8, "bf16 plain (nearest)": 2 + 8,
               "bf16 split (16+16)": 2 + 2 + 8, "bf16 stochastic": 2 + 8}
#: Traffic per param per step on the kernel path (docs/optim.md derives each).
TRAFFIC = {
    "adam": {"fp32 params": 4 + 16 + 12, "bf16 + fp32 masters": 2 + 14 + 14, "bf16 plain (nearest)": 2 + 12 + 10,
             "bf16 split (16+16)": 2 + 14 + 12, "bf16 stochastic": 2 + 12 + 10},
    "lamb": {"fp32 params": 4 + 24 + 16, "bf16 + fp32 masters": 2 + 22 + 18, "bf16 plain (nearest)": 2 + 20 + 12,
             "bf16 split (16+16)": 2 + 22 + 16, "bf16 stochastic": 2 + 20 + 12},
}
MAKERS = {
    "adam": lambda groups, mode: FusedAdam(groups, lr=1e-3, master_weights=mode),
    "lamb": lambda groups, mode: FusedLAMB(groups, lr=1e-3, master_weights=mode),
}


def step_times(device: str, shapes, rounds: int) -> dict[tuple[str, str], list[float]]:
    steps = {}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for kind, make in MAKERS.items():
        for name, (dtype, mode) in MODES.items():
            decay, no_decay = make_groups(shapes, dtype, device)
            opt = make(groups_for(decay, no_decay), mode)
            steps[(kind, name)] = opt.step
    return interleaved(steps, rounds, sync)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/bf16_modes.md")
    args = ap.parse_args()
    cpu_shapes = bert_shapes(hidden=256, layers=4, ffn=1024, vocab=8192, positions=128)
    n_cpu = sum(torch.Size(s).numel() for s, _ in cpu_shapes)
    lines = [f"# bf16 weight modes (torch {torch.__version__}, {torch.get_num_threads()} CPU threads)", ""]
    cpu = step_times("cpu", cpu_shapes, 8 if args.quick else 20)
    gpu = None
    if torch.cuda.is_available():
        gpu_shapes = bert_shapes(hidden=768, layers=12, ffn=3072, vocab=30522)
        n_gpu = sum(torch.Size(s).numel() for s, _ in gpu_shapes)
        gpu = step_times("cuda", gpu_shapes, 20 if args.quick else 100)
    head = (f"| optimizer | mode | B/param held | traffic B/param/step | CPU ms/step ({n_cpu / 1e6:.1f}M params) "
            f"p50 (p20-p80), min |")
    sep = "|---|---|---:|---:|---:|"
    if gpu is not None:
        head += f" GPU ms/step ({n_gpu / 1e6:.0f}M) | GPU GB/s |"
        sep += "---:|---:|"
    head += " tiny-BERT final loss |"
    sep += "---:|"
    lines += [head, sep]
    for kind in MAKERS:
        for name, (_, mode) in MODES.items():
            ts = sorted(cpu[(kind, name)])
            q = statistics.quantiles(ts, n=5) if len(ts) > 1 else [ts[0]] * 4
            row = (f"| {kind} | {name} | {STATE_BYTES[name]} | {TRAFFIC[kind][name]} | "
                   f"{statistics.median(ts) * 1e3:.1f} ({q[0] * 1e3:.1f}-{q[3] * 1e3:.1f}), {ts[0] * 1e3:.1f} |")
            if gpu is not None:
                g = statistics.median(gpu[(kind, name)])
                row += f" {g * 1e3:.3f} | {TRAFFIC[kind][name] * n_gpu / g / 1e9:.0f} |"
            loss = "—" if name == "fp32 params" else f"{train_tiny_bert(kind, mode)[-1]:.4f}"
            lines.append(row + f" {loss} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
