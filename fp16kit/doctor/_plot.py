"""The doctor's picture: where the scaled gradients lie against a format's ranges, and what each layer loses.

Left: the share of nonzero gradient values per binade of ``|g| * S`` (log scale), parameter and activation
gradients as separate series, over the target format's regions shaded (flush, subnormal, normal, overflow;
NVIDIA's Multibox SSD activation-gradient figure, for the user's model), with the other format's normal
range outlined. Right: per watched tensor, the stacked fractions of the four classes in the target format.
matplotlib is imported on use, with the Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ._report import CLASSES, format_limits

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
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})

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
        ax.text((a + b) / 2, 0.985, name, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=9,
                color=_COLORS[name])
    _, o_norm, o_top = format_limits(other)
    visible = [edge for edge in (o_norm, o_top + 1) if lo <= edge <= hi]
    for edge in visible:
        ax.axvline(edge, color="0.3", linestyle="--", linewidth=1)
    where = "" if len(visible) == 2 else " (edges past the axis)" if not visible else " (one edge past the axis)"
    ax.plot([], [], color="0.3", linestyle="--", label=f"{_NAMES[other]} normal range 2^{o_norm}..2^{o_top + 1}{where}")
    width = 0.8 / max(1, len(series))
    peak = 1e-3
    for i, (kind, counts) in enumerate(series):
        total = counts.sum()
        if not total:
            continue
        keep = (x >= lo) & (x <= hi) & (counts > 0)
        share = 100.0 * counts[keep] / total
        peak = max(peak, float(share.max()))
        label = {"param": "parameter gradients", "activation": "activation gradients"}[kind]
        ax.bar(x[keep] + 0.5 + (i - (len(series) - 1) / 2) * width, share, width=width, label=label,
               color=("#1f77b4" if kind == "param" else "#8c564b"), alpha=0.9)
    ax.set_yscale("log")
    bottom = ax.get_ylim()[0]
    ax.set_yticks([10.0**k for k in range(-9, 3) if 10.0**k >= bottom])  # no tick above 100%
    ax.set_ylim(bottom, peak * 300)  # head room for the region names and the legend above the bars
    ax.set_xlim(lo, hi + 1)
    ax.set_xlabel(f"log2(|gradient| x loss scale 2^{s})   (bar k: values in [2^k, 2^(k+1)))")
    ax.set_ylabel("% of nonzero values")
    fr = report.primary.fractions()
    ax.set_title(f"{_NAMES[dtype]} at loss scale 2^{s}: " + ", ".join(f"{c} {100 * fr[c]:.2f}%" for c in CLASSES),
                 fontsize=10)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(0.0, 0.93), fontsize=8)

    names = [e.name if e.kind == "param" else f"{e.name} {e.module} (out grad)" for e in report.entries if e.nonzero]
    rows = [report.primary.fractions(e.name) for e in report.entries if e.nonzero]
    if len(rows) > _MAX_BARS:  # the worst ones: most lost, then most subnormal
        order = sorted(range(len(rows)), key=lambda i: -(rows[i]["flush"] + rows[i]["overflow"] + rows[i]["subnormal"]
                                                         / 2))[:_MAX_BARS]
        names, rows = [names[i] for i in sorted(order)], [rows[i] for i in sorted(order)]
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for c in CLASSES:
        vals = np.array([100 * r[c] for r in rows])
        bars.barh(y, vals, left=left, color=_COLORS[c], label=c, height=0.7)
        left += vals
    bars.set_yticks(y, names, fontsize=7 if len(rows) > 20 else 8)
    bars.invert_yaxis()
    bars.set_xlim(0, 100)
    bars.set_xlabel(f"% of nonzero values, {_NAMES[dtype]} at 2^{s}")
    bars.set_title("per parameter / module", fontsize=10)
    bars.legend(loc="lower right", fontsize=8, framealpha=0.9)
    fig.suptitle(f"fp16kit doctor: {report.samples} sampled step(s), every {report.every} "
                 f"({sum(e.values for e in report.entries):,} values)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
