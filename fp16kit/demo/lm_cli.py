"""``python -m fp16kit demo`` (``--task lm``, the default): every precision mode trains the same byte-level
transformer on the Python standard library's sources; one table, one picture.

The modes and their references: ``fp16kit/demo/modes.py``; the model: ``fp16kit/demo/lm.py``; the data and its
split: ``fp16kit/demo/text.py``; what each column measures: ``fp16kit/demo/lm_train.py``. User guide: docs/demo.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from . import _device, extras_missing

__all__ = ["DEFAULT_STEPS", "QUICK_STEPS", "main"]

DEFAULT_STEPS = 100
QUICK_STEPS = 6


def _parser() -> argparse.ArgumentParser:
    from .lm import SIZES
    from .modes import MODES

    sizes = "; ".join(f"{k}: d_model {c.d_model}, {c.layers} layers, {c.heads} heads, {c.batch} x {c.seq_len} bytes "
                      f"per step" for k, c in SIZES.items())
    p = argparse.ArgumentParser(
        prog="python -m fp16kit demo",
        description=(
            "Train a small byte-level transformer language model on the Python standard library's own source "
            "files (split by file into train and validation; nothing is downloaded) once per precision mode, "
            "print a table (final train and validation loss, tokens/s, bytes per parameter of weights + optimizer "
            "state, skipped steps, final loss scale) and write a PNG (validation-loss curves; bytes per parameter "
            "against the final loss). '--task digits' runs the older demo instead: an MLP on scikit-learn's "
            "digits at apex opt levels O0-O3 ('--task digits --help' for its options)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per mode (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test of seconds: size 'quick', {QUICK_STEPS} steps, few validation windows")
    p.add_argument("--size", default=None, choices=sorted(SIZES),
                   help=f"model and batch preset (default 'cpu', or 'gpu' on a CUDA device; 'quick' with --quick): "
                        f"{sizes}")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'")
    p.add_argument("--out", type=Path, default=Path("fp16kit-demo-lm.png"), help="where to write the PNG")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batch order")
    p.add_argument("--eval-every", type=int, default=None,
                   help="validation loss every N steps (default: steps / 10; 2 with --quick)")
    p.add_argument("--val-windows", type=int, default=None,
                   help="validation windows of seq_len bytes (default 64; 4 with --quick)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op CPU threads (1 is fastest for this small model on a busy machine)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the language-model demo; returns the exit code (0 on success, 1 when a mode ended with a non-finite
    loss, 2 on bad arguments or missing extras)."""
    from .modes import MODES

    args = _parser().parse_args(argv)
    if extras_missing("demo", ("matplotlib",)):
        return 2
    names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODES]
    if unknown or not names:
        print(f"python -m fp16kit demo: unknown mode(s) {unknown}; choose from {', '.join(MODES)}.", file=sys.stderr)
        return 2
    steps = args.steps if args.steps is not None else QUICK_STEPS if args.quick else DEFAULT_STEPS
    if steps < 3 or args.threads < 1 or (args.eval_every is not None and args.eval_every < 1) \
            or (args.val_windows is not None and args.val_windows < 1):
        print("python -m fp16kit demo: --steps must be >= 3; --threads, --eval-every and --val-windows >= 1.",
              file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, names, steps)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, names: list[str], steps: int) -> int:
    from .lm import SIZES
    from .lm_report import format_table, plot
    from .lm_train import train_mode
    from .modes import MODES, Hyper
    from .text import load_corpus

    start = time.perf_counter()
    device = _device(args.device)
    size = args.size or ("quick" if args.quick else "gpu" if device.type == "cuda" else "cpu")
    cfg = SIZES[size]
    corpus = load_corpus()
    hyper = Hyper()
    eval_every = args.eval_every or max(2 if args.quick else 1, steps // 10)
    val_windows = args.val_windows or (4 if args.quick else 64)
    threads = f" ({args.threads} thread{'s' if args.threads > 1 else ''})" if device.type == "cpu" else ""
    title = (f"fp16kit demo: byte-level transformer LM (size '{size}': d_model {cfg.d_model}, {cfg.layers} layers, "
             f"{cfg.heads} heads), {steps} steps x {cfg.batch} x {cfg.seq_len} bytes, seed {args.seed}, "
             f"{device}{threads}")
    print(title)
    print(corpus.describe())
    print(f"validation: {val_windows} fixed windows of {cfg.seq_len} bytes, every {eval_every} steps, fp32 "
          f"evaluation of each mode's stored weights")
    results = [train_mode(MODES[name], corpus, cfg, hyper, steps=steps, seed=args.seed, device=device,
                          eval_every=eval_every, val_windows=val_windows, progress=not args.no_progress)
               for name in names]
    print(f"\n{results[0].params:,} parameters; AdamW lr {hyper.lr:g}, LAMB lr {hyper.lamb_lr:g}, betas "
          f"{hyper.betas}, weight decay {hyper.weight_decay:g}, warm-up then cosine decay\n")
    print(format_table(results))
    print("\nval loss: nats per byte on the validation files; val - reference: against the mode's reference (fp32 "
          "AdamW, or fp32 FusedLAMB for the LAMB modes); B/param: bytes of weights + masters + optimizer state "
          "over the parameter count (gradients not counted); skipped: steps skipped for inf/NaN gradients.")
    path = plot(results, args.out, title)
    print(f"\npicture: {path}")
    print(f"total time: {time.perf_counter() - start:.1f} s")
    bad = [r.mode for r in results if not r.finite]
    if bad:
        print(f"non-finite loss in: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0
