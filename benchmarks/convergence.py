"""Convergence of every precision mode against the spread between seeds: the demo's language model, trained longer.

Every mode of ``fp16kit/demo/modes.py`` trains the byte-level transformer of ``fp16kit/demo/lm.py`` on the Python
standard library's sources (``fp16kit/demo/text.py``) once per seed. A seed fixes the initial weights, the batch
order and the stochastic-rounding stream, so the spread of one mode over the seeds is what luck alone moves; the
difference between a mode and its reference *at the same seed* (same initial weights, same batches) is what the
precision moves. The report puts the two side by side:

* per mode: the final validation loss (mean, min-max over seeds), the paired difference to its reference (mean and
  the largest in magnitude), tokens/s (median over seeds), bytes per parameter (weights + masters + optimizer
  state, measured from the tensors), skipped steps and final loss scales;
* per reference: the range and the standard deviation of its final validation loss over the seeds.

Writes ``<out>.md`` (the table), ``<out>.png`` (validation curves of every mode and seed; bytes per parameter
against the mean final loss with min-max bars) and ``<out>.json`` (every run, for resuming and re-reading).
An interrupted run resumes where it stopped (runs already in the JSON with the same configuration are kept).

Usage::

    nice -n 10 python benchmarks/convergence.py                    # CPU: size 'bench', 250 steps, seeds 0,1,2
    python benchmarks/convergence.py --device cuda --size gpu --steps 2000 --seeds 0,1,2,3,4
    python benchmarks/convergence.py --quick                       # seconds: the pipeline, not the numbers
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from doc_numbers import machine  # noqa: E402

from fp16kit.demo import _device  # noqa: E402
from fp16kit.demo.lm import SIZES  # noqa: E402
from fp16kit.demo.lm_report import plot  # noqa: E402
from fp16kit.demo.lm_train import LMResult, train_mode  # noqa: E402
from fp16kit.demo.modes import MODES, Hyper  # noqa: E402
from fp16kit.demo.text import load_corpus  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "convergence"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", default="bench", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=None, help="default: steps / 20")
    p.add_argument("--val-windows", type=int, default=128)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="path stem of the .md, .png and .json")
    p.add_argument("--quick", action="store_true", help="size 'quick', 6 steps, seeds 0,1, into a temporary stem")
    p.add_argument("--no-progress", action="store_true")
    return p


def _config(args: argparse.Namespace, device: torch.device) -> dict:
    return {"size": args.size, "model": dataclasses.asdict(SIZES[args.size]), "steps": args.steps,
            "val_windows": args.val_windows, "eval_every": args.eval_every, "device": device.type,
            "hyper": dataclasses.asdict(Hyper())}


def _load(path: Path, config: dict) -> list[LMResult]:
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    if saved.get("config") != json.loads(json.dumps(config)):
        return []
    return [LMResult(**r) for r in saved["runs"]]


def summarize(runs: list[LMResult]) -> tuple[str, dict[str, dict]]:
    """The markdown table and, per mode, its statistics (see the module docstring)."""
    by = {}
    for r in runs:
        by.setdefault(r.mode, {})[r.seed] = r
    stats: dict[str, dict] = {}
    for mode, seeds in by.items():
        vals = [r.final_val for r in seeds.values()]
        ref = by.get(MODES[mode].reference, {})
        paired = [seeds[s].final_val - ref[s].final_val for s in seeds if s in ref]
        stats[mode] = {
            "reference": MODES[mode].reference, "seeds": sorted(seeds), "val": vals,
            "val_mean": statistics.fmean(vals), "val_min": min(vals), "val_max": max(vals),
            "val_range": max(vals) - min(vals), "val_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "train_mean": statistics.fmean(r.final_train for r in seeds.values()),
            "paired": paired, "paired_mean": statistics.fmean(paired) if paired else math.nan,
            "paired_max": max(paired, key=abs) if paired else math.nan,
            "tokens_per_s": statistics.median(r.tokens_per_s for r in seeds.values()),
            "bytes_per_param": statistics.fmean(r.bytes_per_param for r in seeds.values()),
            "skipped": [r.skipped for r in seeds.values()], "scales": [r.scale for r in seeds.values()],
            "finite": all(r.finite for r in seeds.values()),
        }
    rows = []
    for mode, s in stats.items():
        ref = stats.get(s["reference"])
        is_ref = s["reference"] == mode
        versus = "reference" if is_ref else (
            f"{s['paired_mean']:+.4f} / {s['paired_max']:+.4f}" if s["paired"] else "-")
        spread = ref["val_range"] if ref else math.nan
        ratio = "-" if is_ref or not s["paired"] or not spread else f"{abs(s['paired_max']) / spread:.2f}"
        scales = "-" if s["scales"][0] is None else ", ".join(f"2^{int(math.log2(x))}" for x in s["scales"])
        rows.append((f"`{mode}`", f"{s['val_mean']:.4f}", f"{s['val_min']:.4f}-{s['val_max']:.4f}", versus, ratio,
                     f"{s['tokens_per_s']:,.0f}", f"{s['bytes_per_param']:.2f}",
                     "/".join(str(k) for k in s["skipped"]), scales))
    header = ("mode", "val loss (mean)", "min-max over seeds", "vs reference, same seed: mean / largest",
              "largest / reference's seed range", "tokens/s", "B/param", "skipped", "final scale")
    table = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                      + ["| " + " | ".join(row) + " |" for row in rows])
    return table, stats


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        import tempfile

        args.size, args.steps, args.seeds, args.val_windows = "quick", 6, "0,1", 4
        if args.out == DEFAULT_OUT:
            args.out = Path(tempfile.mkdtemp()) / "convergence"
    device = _device(args.device)
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = [m for m in args.modes.split(",") if m]
    eval_every = args.eval_every or max(1, args.steps // 20)
    cfg = SIZES[args.size]
    config = _config(args, device)
    json_path = args.out.with_suffix(".json")
    runs = _load(json_path, config)
    corpus = load_corpus()
    load_before = os.getloadavg()[0]
    for seed in seeds:
        for name in names:
            if any(r.mode == name and r.seed == seed for r in runs):
                continue
            runs.append(train_mode(MODES[name], corpus, cfg, Hyper(), steps=args.steps, seed=seed, device=device,
                                   eval_every=eval_every, val_windows=args.val_windows,
                                   progress=not args.no_progress, desc=f"seed {seed} {name}"))
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps({"config": config, "runs": [dataclasses.asdict(r) for r in runs]}))
    runs = [r for r in runs if r.mode in names and r.seed in seeds]
    table, stats = summarize(runs)
    spreads = {m: (s["val_min"], s["val_max"]) for m, s in stats.items()}
    title = (f"convergence: byte LM size '{args.size}' ({runs[0].params:,} params), {args.steps} steps x "
             f"{cfg.batch} x {cfg.seq_len} bytes, seeds {args.seeds}, {device}")
    png = plot(runs, args.out.with_suffix(".png"), title, spread=spreads)
    refs = [m for m in stats if stats[m]["reference"] == m]
    spread_lines = "\n".join(
        f"- `{m}`: final validation loss {', '.join(f'{v:.4f}' for v in stats[m]['val'])} over seeds "
        f"{args.seeds}: range {stats[m]['val_range']:.4f}, standard deviation {stats[m]['val_std']:.4f}"
        for m in refs)
    minutes = sum(r.seconds for r in runs) / 60  # the runs' own wall times: also right for a resumed study
    text = f"""# Convergence of every precision mode (`benchmarks/convergence.py`)

Produced by `python benchmarks/convergence.py {' '.join(argv if argv is not None else sys.argv[1:])}` on {machine()}.
{len(runs)} runs, {minutes:.1f} minutes of training and evaluation in all; load average {load_before:.1f} at the \
start, {os.getloadavg()[0]:.1f} at the end (a shared machine: tokens/s compare within one study only).

Model: byte-level transformer, size `{args.size}` (d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads, \
{runs[0].params:,} parameters); {args.steps} steps of {cfg.batch} x {cfg.seq_len} bytes; {Hyper()}.
Data: {corpus.describe()}; validation: {args.val_windows} fixed windows, every {eval_every} steps, fp32 evaluation \
of each mode's stored weights.

{table}

Seed spread of the references (the spread that luck alone produces at this size and length):

{spread_lines}

"vs reference, same seed": the mode's final validation loss minus its reference's at the same seed (same initial \
weights, same batches), mean over seeds and the one largest in magnitude; "largest / reference's seed range": that \
largest paired difference over the range of the reference's final loss across seeds (below 1: the mode costs less \
than the choice of seed). Skipped steps and final scales are per seed. Picture: `{png.name}`.
"""
    md = args.out.with_suffix(".md")
    md.write_text(text)
    print(text)
    print(f"wrote {md}, {png}, {json_path}")
    bad = [m for m, s in stats.items() if not s["finite"]]
    if bad:
        print(f"non-finite loss in: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
