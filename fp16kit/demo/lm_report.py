"""The language-model demo's outputs: one plain-text table and one picture (validation-loss curves of every mode;
bytes per parameter against the final validation loss)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from .lm_train import LMResult
from .report import save_figure

__all__ = ["format_table", "plot", "render"]


def render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A fixed-width text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


def _loss(v: float) -> str:
    return f"{v:.4f}" if math.isfinite(v) else "NaN" if math.isnan(v) else "inf"


def format_table(results: Sequence[LMResult]) -> str:
    """One row per mode: final train and validation loss, the validation loss minus its reference's, tokens/s,
    bytes per parameter (weights + optimizer state), skipped steps and the final loss scale."""
    by_name = {r.mode: r for r in results}
    rows = []
    for r in results:
        ref = by_name.get(r.reference)
        delta = "ref" if r.reference == r.mode else (
            f"{r.final_val - ref.final_val:+.4f} ({r.reference})" if ref is not None else f"({r.reference} not run)")
        rows.append((r.mode, _loss(r.final_train), _loss(r.final_val), delta, f"{r.tokens_per_s:,.0f}",
                     f"{r.bytes_per_param:.2f}", str(r.skipped), "-" if r.scale is None else f"{r.scale:g}"))
    header = ("mode", "train loss", "val loss", "val - reference", "tokens/s", "B/param", "skipped", "scale")
    return render(header, rows)


def plot(results: Sequence[LMResult], path: Path, title: str,
         spread: dict[str, tuple[float, float]] | None = None) -> Path:
    """Two panels: the validation loss of every mode against the step, and bytes per parameter against the final
    validation loss (``spread``: optional ``mode -> (low, high)`` horizontal bars, e.g. over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_curve, ax_mem) = plt.subplots(1, 2, figsize=(14, 5.5))
    cmap = plt.get_cmap("tab10")
    colors: dict[str, object] = {}  # a mode and its 8-bit-moments variant share a color (8-bit: dashed, squares)
    seen: dict[str, object] = {}
    for i, r in enumerate(results):
        color = colors.setdefault(r.mode.removesuffix("-8bit"), cmap(len(colors) % 10))
        seen[r.mode] = color
        dashed = "8bit" in r.mode
        first = r.mode not in [q.mode for q in results[:i]]
        vals = [v if math.isfinite(v) else float("nan") for v in r.val_losses]
        ax_curve.plot(r.eval_steps, vals, color=color, linestyle="--" if dashed else "-", linewidth=1.3,
                      alpha=0.9 if first else 0.45, label=r.mode if first else None)
    ax_curve.set_xlabel("step")
    ax_curve.set_ylabel("validation loss (nats per byte)")
    ax_curve.set_title("validation loss")
    finals = [r.final_val for r in results if math.isfinite(r.final_val)]
    if finals:  # zoom on the end of training, where the modes differ (the first evaluations sit near ln 256)
        lo, hi = min(finals), max(finals)
        mid = [v for r in results for s, v in zip(r.eval_steps, r.val_losses)
               if math.isfinite(v) and s >= r.eval_steps[-1] // 3]
        ax_curve.set_ylim(lo - 0.05 * (hi - lo + 0.1), max(mid or [hi]) + 0.02)
    ax_curve.grid(True, alpha=0.3)
    ax_curve.legend(fontsize=8, ncol=2)

    points: dict[str, list[LMResult]] = {}
    for r in results:
        points.setdefault(r.mode, []).append(r)
    stacked: dict[float, int] = {}  # modes at the same bytes per parameter: their labels one above the other
    for name, rs in points.items():
        vals = [r.final_val for r in rs if math.isfinite(r.final_val)]
        if not vals:
            continue
        x, y = sum(vals) / len(vals), rs[0].bytes_per_param
        ax_mem.scatter([x], [y], color=seen[name], marker="s" if "8bit" in name else "o", zorder=3)
        if spread and name in spread:
            low, high = spread[name]
            ax_mem.plot([low, high], [y, y], color=seen[name], linewidth=2, alpha=0.6)
        row = stacked.get(round(y, 1), 0)
        stacked[round(y, 1)] = row + 1
        ax_mem.annotate(name, (x, y), textcoords="offset points", xytext=(5, 3 + 10 * row), fontsize=8,
                        color=seen[name])
    ax_mem.margins(x=0.2, y=0.12)  # room for the labels
    ax_mem.set_xlabel("final validation loss" + (" (mean; bars: min-max over seeds)" if spread else ""))
    ax_mem.set_ylabel("bytes per parameter (weights + optimizer state)")
    ax_mem.set_title("memory against loss")
    ax_mem.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
