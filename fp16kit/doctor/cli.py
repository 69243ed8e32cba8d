"""``python -m fp16kit doctor``: watch the demo model train and write the doctor's table, JSON and picture.

The model and data are the demo's (``fp16kit/demo``: an MLP with batchnorm on scikit-learn's digits), trained
with apex-style amp at one opt level while ``fp16kit.doctor`` watches parameter and activation gradients.
Needs the ``demo`` extra (scikit-learn, matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fp16kit doctor",
        description=(
            "Train the demo MLP on scikit-learn's digits while fp16kit.doctor samples its gradients; write the "
            "report as a table (doctor.txt, also printed), JSON (doctor.json) and a PNG (doctor.png): where the "
            "gradients lie against fp16's and bf16's ranges, the loss scale that fits them, the layers to keep fp32."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", type=Path, default=Path("fp16kit-doctor"),
                   help="directory for doctor.txt, doctor.json, doctor.png (and doctor-scaled.png)")
    p.add_argument("--opt-level", choices=("O0", "O1", "O2", "O3"), default="O0",
                   help="amp opt level of the watched run (O0: fp32 gradients, the ones a cast would change)")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="format the report leads with")
    p.add_argument("--loss-scale", type=float, default=None,
                   help="power of two to judge the gradients at (default: the run's final loss scale)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--every", type=int, default=10, help="sample every N-th step")
    p.add_argument("--no-activations", action="store_true", help="parameter gradients only")
    p.add_argument("--quick", action="store_true", help="60 steps and a narrower model (a smoke test)")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda'")
    p.add_argument("--seed", type=int, default=0, help="seed for the model and the batch order")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run it; returns the exit code (2 on bad arguments or missing extras)."""
    from .. import doctor
    from ..demo import _device, extras_missing

    args = _parser().parse_args(argv)
    if extras_missing("doctor"):
        return 2

    if min(args.steps, args.every) < 1:
        print("python -m fp16kit doctor: --steps and --every must be >= 1.", file=sys.stderr)
        return 2
    try:
        if args.loss_scale is not None:
            doctor.scale_exponent(args.loss_scale)
    except ValueError as exc:
        print(f"python -m fp16kit doctor: {exc}", file=sys.stderr)
        return 2
    from ..demo.data import load_digits_split
    from ..demo.train import RunConfig, train_one

    device = _device(args.device)
    steps, hidden = (60, 64) if args.quick else (args.steps, 128)
    data = load_digits_split(seed=0).to(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo's setting: this small model is fastest on one thread
    try:
        run = train_one(RunConfig(args.opt_level, args.opt_level), data, steps=steps, batch_size=64, hidden=hidden,
                        lr=0.05, optimizer="sgd", device=device, scale_window=100, seed=args.seed, progress=False,
                        doctor_every=args.every, doctor_activations=not args.no_activations)
    finally:
        torch.set_num_threads(threads)
    dtype = torch.float16 if args.dtype == "float16" else torch.bfloat16
    report: doctor.Report = run.doctor
    report = report.rescored(dtype=dtype, loss_scale=args.loss_scale)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = (f"fp16kit doctor on the demo MLP(64-{hidden}-{hidden}-10, batchnorm), amp {args.opt_level}, {steps} steps, "
            f"{device}; test accuracy {100 * run.accuracy:.1f}%\n\n{report}")
    print(text)
    (out / "doctor.txt").write_text(text + "\n")
    (out / "doctor.json").write_text(report.to_json(indent=1) + "\n")
    written = [out / "doctor.txt", out / "doctor.json", report.save_png(out / "doctor.png")]
    best = report.primary.max_scale_exp
    if best is not None and best != report.scale_exp:  # the same gradients at the largest scale without overflow
        scaled = report.rescored(loss_scale=2.0**best)
        scaled_text = f"\nthe same gradients at the largest loss scale without overflow, 2^{best}:\n\n{scaled}"
        print(scaled_text)
        (out / "doctor.txt").write_text(text + "\n" + scaled_text + "\n")
        written.append(scaled.save_png(out / "doctor-scaled.png"))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
