"""The doctor's picture: where the scaled gradients lie against a format's ranges, and what each layer loses.

Left: the share of nonzero gradient values per binade of ``|g| * S`` (log scale), parameter and activation
gradients as separate series, over the target format's regions shaded (flush, subnormal, normal, overflow;
NVIDIA's Multibox SSD activation-gradient figure, for the user's model), with the other format's normal
range outlined; the y axis is bounded by 100%, the legend sits below the axes. Right: per watched tensor, the
stacked fractions of the four classes in the target format, for the ``_MAX_BARS`` that lose most (the title
says how many are left out and the most any of them loses); rounding-noise entries are marked ``[noise]``.
matplotlib is imported on use, with the Agg backend (no display needed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ._classes import CLASSES, format_limits

if TYPE_CHECKING:
    from ._report import Report

_COLORS = {"flush": "#d62728", "subnormal": "#ff9f1c", "normal": "#2ca02c", "overflow": "#7b1fa2"}
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MAX_BARS = 40


def save_png(report: Report, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtype, s = report.dtype, report.scale_exp
    other = next(d for d in report.formats if d != dtype)
    n_bars = min(_MAX_BARS, sum(1 for e in report.entries if e.nonzero))
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(15, max(5.5, 1.6 + 0.16 * n_bars)),
                                   gridspec_kw={"width_ratios": [3, 2]})

    x = report.exponents + s
    series = [(k, report.counts(k)) for k in ("param", "activation") if any(e.kind == k for e in report.entries)]
    seen = np.zeros_like(x, dtype=bool)
    for _, counts in series:
        seen |= counts > 0
    lo, hi = (int(x[seen].min()), int(x[seen].max())) if seen.any() else (-30, 20)
    sub, norm, top = format_limits(dtype)
    lo, hi = min(lo, sub) - 3, max(hi, top) + 3
    regions = [("flush", lo, sub), ("subnormal", sub, norm), ("normal", norm, top + 1), ("overflow", top + 1, hi + 1)]
    for name, a, b in regions:
        ax.axvspan(a, b, color=_COLORS[name], alpha=0.12, lw=0)
        ax.text((a + b) / 2, 1.005, name, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=8,
                color=_COLORS[name])
    _, o_norm, o_top = format_limits(other)
    visible = [edge for edge in (o_norm, o_top + 1) if lo <= edge <= hi]
    for edge in visible:
        ax.axvline(edge, color="0.3", linestyle="--", linewidth=1)
    where = "" if len(visible) == 2 else " (edges past the axis)" if not visible else " (one edge past the axis)"
    ax.plot([], [], color="0.3", linestyle="--", label=f"{_NAMES[other]} normal range 2^{o_norm}..2^{o_top + 1}{where}")
    width = 0.8 / max(1, len(series))
    smallest = 100.0
    for i, (kind, counts) in enumerate(series):
        total = counts.sum()
        if not total:
            continue
        keep = (x >= lo) & (x <= hi) & (counts > 0)
        share = 100.0 * counts[keep] / total
        smallest = min(smallest, float(share.min()))
        label = {"param": "parameter gradients", "activation": "activation gradients (module outputs)"}[kind]
        ax.bar(x[keep] + 0.5 + (i - (len(series) - 1) / 2) * width, share, width=width, label=label,
               color=("#1f77b4" if kind == "param" else "#8c564b"), alpha=0.9)
    ax.set_yscale("log")
    bottom = 10.0 ** math.floor(math.log10(max(smallest, 1e-12)) - 0.5)
    ax.set_ylim(bottom, 100.0)  # shares: nothing above 100%
    ax.set_yticks([10.0**k for k in range(-12, 3) if bottom <= 10.0**k <= 100.0])
    ax.set_xlim(lo, hi + 1)
    ax.set_xlabel(f"log2(|gradient| x loss scale 2^{s})   (bar k: values in [2^k, 2^(k+1)))")
    ax.set_ylabel("% of nonzero values (log)")
    fr = report.primary.fractions()
    ax.set_title(f"{_NAMES[dtype]} at loss scale 2^{s} ({report.scale_basis}): "
                 + ", ".join(f"{c} {100 * fr[c]:.2f}%" for c in CLASSES), fontsize=10, pad=16)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=2, frameon=False)

    from ._table import ranked

    order = [i for i in ranked(report) if report.entries[i].nonzero]
    shown = sorted(order[:_MAX_BARS])  # the worst ones, in the model's order
    p = report.primary
    names = []
    for i in shown:
        e = report.entries[i]
        name = e.name if e.kind == "param" else f"{e.name} (out grad)"
        name = name if len(name) <= 48 else "…" + name[-47:]
        names.append(name + (" [noise]" if e.name in report.noise else ""))
    rows = [p.fractions(report.entries[i].name) for i in shown]
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for c in CLASSES:
        vals = np.array([100 * r[c] for r in rows])
        bars.barh(y, vals, left=left, color=_COLORS[c], label=c, height=0.7)
        left += vals
    bars.set_yticks(y, names, fontsize=7 if len(rows) > 20 else 8)
    bars.set_ylim(len(rows) - 0.5, -0.5)
    bars.set_xlim(0, 100)
    bars.set_xlabel(f"% of nonzero values, {_NAMES[dtype]} at 2^{s}")
    left_out = len(order) - len(shown)
    empty = sum(1 for e in report.entries if not e.nonzero)
    title = f"per gradient: all {len(shown)} with nonzero values" if not left_out else (
        f"per gradient: the {len(shown)} of {len(order)} that lose most (flush + overflow, then subnormal)\n"
        f"not shown: {left_out}, each losing at most "
        f"{100 * max(p.lost(report.entries[i].name) for i in order[_MAX_BARS:]):.2g}%")
    if empty:
        title += f"; {empty} saw no nonzero value"
    bars.set_title(title, fontsize=9)
    bars.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=4, frameon=False)
    fig.suptitle(f"fp16kit doctor: {report.samples} sampled step(s), every {report.every} "
                 f"({sum(e.values for e in report.entries):,} values)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
