"""The demo's outputs: a plain-text table and a PNG of loss curves and loss-scale trajectories."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .train import RunResult

__all__ = ["format_table", "plot", "save_figure"]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def format_table(results: list[RunResult]) -> str:
    """One row per run: final loss, test accuracy, skipped steps, final loss scale, time, memory."""
    kind = results[0].memory_kind if results else ""
    header = ("run", "final loss", "test acc", "skipped", "final scale", "time (s)", f"mem ({kind})")
    rows = [
        (r.label, f"{r.final_loss:.4f}", f"{100 * r.accuracy:.1f}%", str(r.skipped), f"{r.final_scale:g}",
         f"{r.seconds:.2f}", _size(r.memory_bytes))
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(row) for row in rows]
    return "\n".join(lines)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


_STYLES = {
    "O0": {"linestyle": "-", "linewidth": 1.2},
    "O1": {"linestyle": (0, (5, 3)), "linewidth": 2.2},
    "O2": {"linestyle": "-", "linewidth": 1.0},
    "O3": {"linestyle": (0, (1, 1.5)), "linewidth": 2.0},
    "O2-bf16": {"linestyle": (0, (6, 2, 1, 2)), "linewidth": 1.4},
}


def plot(results: list[RunResult], path: Path, title: str) -> Path:
    """Two panels: smoothed training loss (log scale) and the loss scale (log2) per step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(12, 4.5))
    window = max(1, len(results[0].losses) // 50) if results else 1
    for r in results:
        # distinct dashes: runs that compute the same numbers (O1 and O2 often do) stay visible on top of each other
        style = _STYLES.get(r.label, {})
        finite = [v if math.isfinite(v) else float("nan") for v in r.losses]
        label = f"{r.label} (acc {100 * r.accuracy:.1f}%)"
        bad = next((i for i, v in enumerate(r.losses) if not math.isfinite(v)), None)
        if bad is not None:  # a diverged run has no curve to see: mark where it went non-finite
            label += f", loss inf/NaN from step {bad}"
        (line,) = ax_loss.plot(_smooth(finite, window), label=label, **style)
        if bad is not None:
            ax_loss.axvline(bad, color=line.get_color(), linestyle=":", linewidth=1.5)
        ax_scale.plot([math.log2(s) for s in r.scales], label=r.label, drawstyle="steps-post", **style)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"training loss (moving mean of {window})")
    ax_loss.set_title("loss curves")
    ax_loss.grid(True, which="both", alpha=0.3)
    ax_loss.legend()
    ax_scale.set_xlabel("step")
    ax_scale.set_ylabel("log2(loss scale)")
    ax_scale.set_title("loss scale (dynamic: O1, O2, O2-bf16; static 1: O0, O3)")
    ax_scale.grid(True, alpha=0.3)
    ax_scale.legend()
    fig.suptitle(title)
    return save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> Path:
    """Lay out ``fig``, write it as a PNG to ``path`` (its folder made if needed), close it; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
