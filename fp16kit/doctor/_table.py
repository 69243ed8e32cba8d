"""The doctor's printed table: one row per watched tensor, fp16 and bf16 side by side."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._report import CLASSES

if TYPE_CHECKING:
    from ._report import FormatReport, Report

_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _pct(x: float) -> str:
    if x == 0:
        return "0"
    if x < 0.0001:
        return "<0.01%"
    return f"{100 * x:.2f}%"


def _pow2(s: int | None) -> str:
    return "-" if s is None else f"2^{s}"


def _advice(f: FormatReport) -> str:
    if f.max_scale_exp is None:
        return "no nonzero gradient seen"
    rng = (f"2^{f.keep_range[0]} .. 2^{f.keep_range[1]}" if f.keep_range is not None
           else "none (no scale keeps that share normal without overflow)")
    return (f"largest without overflow {_pow2(f.max_scale_exp)} (keeps {_pct(f.normal_at_max or 0.0)} normal); "
            f"keeping >= {100 * f.keep:g}% normal: {rng}")


def format_report(r: Report) -> str:
    """The report as text (``str(report)``)."""
    order = [r.dtype] + [d for d in r.formats if d != r.dtype]
    header = ["name", "kind", "values", "zeros"]
    for d in order:
        header += [f"{_SHORT[d]} {c}" for c in CLASSES]
    rows = []
    for e in r.entries:
        row = [e.name, e.kind if e.kind == "param" else f"act ({e.module})", str(e.values),
               _pct(e.zeros / e.values) if e.values else "-"]
        for d in order:
            fr = r.formats[d].fractions(e.name)
            row += [_pct(fr[c]) if e.nonzero else "-" for c in CLASSES]
        rows.append(row)
    total_values = sum(e.values for e in r.entries)
    zeros = sum(e.zeros for e in r.entries)
    total = ["all", "", str(total_values), _pct(zeros / total_values) if total_values else "-"]
    for d in order:
        fr = r.formats[d].fractions()
        total += [_pct(fr[c]) for c in CLASSES]
    widths = [max(len(h), *(len(x[i]) for x in [*rows, total])) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    infs = sum(e.infs for e in r.entries)
    nans = sum(e.nans for e in r.entries)
    out = [
        f"fp16kit doctor: {r.samples} sampled backward(s) of {r.steps} step(s) (every {r.every}); "
        f"gradients x loss scale {r.loss_scale:g} = 2^{r.scale_exp} ({r.scale_source}), cast to each format. "
        f"Fractions are of nonzero finite values.",
        "",
        line(header),
        "  ".join("-" * w for w in widths),
        *(line(x) for x in rows),
        "  ".join("-" * w for w in widths),
        line(total),
        "",
    ]
    if infs or nans:
        out.append(f"non-finite values seen (already overflowed when observed): {infs} inf, {nans} NaN")
    out.append("recommended loss scale:")
    for d in order:
        out.append(f"  {_SHORT[d]}: {_advice(r.formats[d])}")
    p = r.primary
    if p.keep_fp32:
        worst = ", ".join(f"{n} ({100 * s:.2f}%)" for n, s in p.keep_fp32[:8])
        more = f" and {len(p.keep_fp32) - 8} more" if len(p.keep_fp32) > 8 else ""
        out.append(f"keep in fp32 (lose > {100 * p.fp32_threshold:g}% to flush/overflow in {_SHORT[r.dtype]} at "
                   f"2^{r.scale_exp}): {worst}{more}")
    else:
        out.append(f"keep in fp32: none (no entry loses > {100 * p.fp32_threshold:g}% in {_SHORT[r.dtype]} at "
                   f"2^{r.scale_exp})")
    return "\n".join(out)
