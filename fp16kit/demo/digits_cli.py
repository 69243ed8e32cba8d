"""``python -m fp16kit demo --task digits``: train a small MLP at opt levels O0-O3 and in bf16; print a table, plot.

A 3-layer MLP with batchnorm learns scikit-learn's handwritten digits (shipped in the scikit-learn wheel:
nothing is downloaded) once per run, on the GPU if there is one, else the CPU. Each run is an unmodified
apex.amp training loop with ``from fp16kit import amp``. Needs the ``demo`` extra:
``pip install "fp16kit[demo]"`` (scikit-learn, matplotlib). The demo's default task is the language model of
``fp16kit/demo/lm_cli.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import _device, extras_missing

__all__ = ["main"]

RUNS = ("O0", "O1", "O2", "O3", "O2-bf16")
QUICK_STEPS = 60


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fp16kit demo --task digits",
        description=(
            "Train a small MLP (with batchnorm) on scikit-learn's digits once per amp opt level O0, O1, O2, O3 "
            "and once as O2 in bfloat16, with apex-style amp.initialize / amp.scale_loss. Prints a table "
            "(final loss, test accuracy, skipped steps, final loss scale, time, memory) and writes a PNG of the "
            "loss curves and loss-scale trajectories."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run")
    p.add_argument("--quick", action="store_true",
                   help=f"short mode: {QUICK_STEPS} steps per run and a narrower model (a smoke test, seconds)")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'")
    p.add_argument("--out", type=Path, default=Path("fp16kit-demo.png"), help="where to write the PNG plot")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size")
    p.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP")
    p.add_argument("--optimizer", choices=("sgd", "adam", "lamb"), default="sgd",
                   help="torch SGD (momentum 0.9), torch Adam, or fp16kit.optim.FusedLAMB (device-side skips)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: 0.05 for sgd, 2e-3 for adam, 1e-2 for lamb)")
    p.add_argument("--scale-window", type=int, default=100,
                   help="clean steps before the dynamic loss scale doubles (apex's fixed value is 2000; a short "
                        "window makes growth and back-off visible in a short run)")
    p.add_argument("--seed", type=int, default=0, help="seed for the model and the batch order")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op CPU threads during the runs (1 is fastest for this small model on a busy "
                        "machine, and makes the CPU numbers reproducible: reduction order depends on it)")
    p.add_argument("--doctor-every", type=int, default=20,
                   help="fp16kit.doctor watches the O2 run's gradients every N steps and writes its picture next to "
                        "--out (<out>-doctor-O2.png); 0 turns it off")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the digits demo; returns the process exit code (0 on success, 2 on bad arguments or missing extras)."""
    args = _parser().parse_args(argv)
    if extras_missing("demo", ("matplotlib", "sklearn")):
        return 2
    labels = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in labels if r not in RUNS]
    if unknown or not labels:
        print(f"python -m fp16kit demo --task digits: unknown run(s) {unknown}; choose from {', '.join(RUNS)}.",
              file=sys.stderr)
        return 2
    if min(args.steps, args.batch_size, args.hidden, args.scale_window, args.threads) < 1 or args.doctor_every < 0:
        print("python -m fp16kit demo --task digits: --steps, --batch-size, --hidden, --scale-window and --threads "
              "must be >= 1 (--doctor-every >= 0).", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, labels)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, labels: list[str]) -> int:
    steps, hidden = (QUICK_STEPS, min(args.hidden, 64)) if args.quick else (args.steps, args.hidden)
    lr = args.lr if args.lr is not None else {"sgd": 0.05, "adam": 2e-3, "lamb": 1e-2}[args.optimizer]
    device = _device(args.device)

    from .data import load_digits_split
    from .report import format_table, plot
    from .train import RunConfig, train_one

    configs = {
        "O0": RunConfig("O0", "O0"), "O1": RunConfig("O1", "O1"), "O2": RunConfig("O2", "O2"),
        "O3": RunConfig("O3", "O3"), "O2-bf16": RunConfig("O2-bf16", "O2", torch.bfloat16),
    }
    data = load_digits_split(seed=0).to(device)
    title = (f"fp16kit demo: MLP(64-{hidden}-{hidden}-10, batchnorm) on scikit-learn digits "
             f"({data.x_train.shape[0]} train / {data.x_test.shape[0]} test), {steps} steps x batch "
             f"{args.batch_size}, {args.optimizer} lr {lr:g}, {device}"
             + (f" ({args.threads} thread{'s' if args.threads > 1 else ''})" if device.type == "cpu" else ""))
    print(title)
    common = dict(batch_size=args.batch_size, hidden=hidden, lr=lr, optimizer=args.optimizer, device=device,
                  scale_window=args.scale_window, seed=args.seed)
    for label in labels:  # warm-up, not timed: lazy imports, kernel selection, allocator and CUDA start-up
        train_one(configs[label], data, steps=2, progress=False, **common)
    results = [
        train_one(configs[label], data, steps=steps, progress=not args.no_progress,
                  doctor_every=args.doctor_every if label == "O2" else None, **common)
        for label in labels
    ]
    print()
    print(format_table(results))
    if results[0].memory_kind == "training state":
        print("\nmem (training state): bytes held by params, grads, fp32 masters, buffers and optimizer state "
              "(the CPU has no allocator peak counter; on CUDA the column is torch.cuda.max_memory_allocated).")
    path = plot(results, args.out, title)
    print(f"\nplot: {path}")
    watched = next((r for r in results if r.doctor is not None), None)
    if watched is not None:
        report = watched.doctor
        doctor_path = report.save_png(Path(args.out).with_name(f"{Path(args.out).stem}-doctor-{watched.label}.png"))
        fr = report.primary.fractions()
        print(f"doctor ({watched.label}, {report.samples} sampled steps, fp16 at loss scale 2^{report.scale_exp}): "
              + ", ".join(f"{c} {100 * fr[c]:.2f}%" for c in fr) + f" of nonzero gradients; picture: {doctor_path}")
    return 0
