"""The doctor's printed report: the verdict first, then the worst entries, in at most 100 columns.

``str(report)`` shows the leading format's classes for the ``top`` entries that lose most (flush + overflow,
then subnormal) and a count of the rest; every entry, both formats, the consumers and the fixes are in
``report.to_dict()``.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import torch

from ._classes import CLASSES

if TYPE_CHECKING:
    from ._report import FormatReport, Report

_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}
WIDTH = 100
TOP = 15
_NAME = 40  # name column; longer names keep their end
_KIND = 18


def _pct(x: float) -> str:
    if x == 0:
        return "0"
    if x < 0.0001:
        return "<0.01%"
    return f"{100 * x:.2f}%"


def _pow2(s: int | None) -> str:
    return "-" if s is None else f"2^{s}"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[len(text) - width + 1:]


def _advice(f: FormatReport) -> str:
    if f.max_scale_exp is None:
        return "no nonzero gradient seen"
    rng = (f"2^{f.keep_range[0]} .. 2^{f.keep_range[1]}" if f.keep_range is not None
           else "none (the gradients span more binades than the normal range)")
    return (f"keep >= {100 * f.keep:g}% normal: {rng}; largest without overflow {_pow2(f.max_scale_exp)} "
            f"({_pct(f.normal_at_max or 0.0)} normal)")


def _wrap(text: str, indent: str = "  ", first: str | None = None) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent if first is None else first,
                         subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)


def _code(line: str, indent: str = "    ") -> list[str]:
    """A line of Python in at most WIDTH columns: broken after commas inside its parentheses."""
    if len(indent + line) <= WIDTH:
        return [indent + line]
    out, current = [], indent
    for part in line.split(", "):
        piece = part if current == indent else ", " + part
        if len(current + piece) > WIDTH - 1 and current.strip():
            out.append(current + ",")
            current = indent + "    " + part
        else:
            current += piece
    out.append(current)
    return out


def ranked(r: Report) -> list[int]:
    """Entry indices, worst first in the leading format: lost share, then subnormal share; empty ones last."""
    p = r.primary

    def key(i: int) -> tuple[float, float, int]:
        e = r.entries[i]
        if not e.nonzero:
            return (1.0, 1.0, i)
        fr = p.fractions(e.name)
        return (-(fr["flush"] + fr["overflow"]), -fr["subnormal"], i)

    return sorted(range(len(r.entries)), key=key)


def format_report(r: Report, top: int = TOP) -> str:
    """The report as text (``str(report)``): at most ``WIDTH`` columns, the ``top`` worst entries."""
    p = r.primary
    short = _SHORT[r.dtype]
    total_values = sum(e.values for e in r.entries)
    out = [
        f"fp16kit doctor: {r.samples} sampled backward(s) of {r.steps} step(s), every {r.every}; "
        f"{len(r.entries)} gradients, {total_values:,} values",
        *_wrap(f"judged in {short} at loss scale 2^{r.scale_exp} ({r.scale_source})", first=""),
        "",
        "recommended loss scale:",
    ]
    order = [r.dtype] + [d for d in r.formats if d != r.dtype]
    for d in order:
        out += _wrap(f"{_SHORT[d]}: {_advice(r.formats[d])}")
    out.append("")
    header = ["name", "kind", "zeros", *(c if c != "subnormal" else "subnorm" for c in CLASSES)]
    widths = [_NAME, _KIND, 7, 7, 7, 7, 8]  # 100 columns with the single spaces between

    def line(cells: list[str]) -> str:
        return " ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    def row(name: str, kind: str, zeros: float | None, fr: dict[str, float] | None) -> str:
        cells = [_cut(name, _NAME), _cut(kind, _KIND), "-" if zeros is None else _pct(zeros)]
        cells += [_pct(fr[c]) if fr is not None else "-" for c in CLASSES]
        return line(cells)

    idx = ranked(r)
    shown = [i for i in idx[:top] if r.entries[i].nonzero and p.fractions(r.entries[i].name)["normal"] < 1.0]
    shown = shown or idx[:min(top, 3)]
    out.append(f"{short} at 2^{r.scale_exp}, % of nonzero values; the {len(shown)} worst of {len(r.entries)} "
               f"gradients (all: to_dict())")
    out.append(line(header))
    out.append("-" * len(line(header)))
    for i in shown:
        e = r.entries[i]
        kind = "param" if e.kind == "param" else f"out {e.module}"
        note = "*" if e.name in r.noise else ""
        out.append(row(e.name + note, kind, e.zeros / e.values if e.values else None,
                       p.fractions(e.name) if e.nonzero else None))
    rest = [r.entries[i] for i in idx if i not in shown]
    if rest:
        worst = max((p.lost(e.name) for e in rest if e.nonzero), default=0.0)
        sub = max((p.fractions(e.name)["subnormal"] for e in rest if e.nonzero), default=0.0)
        empty = sum(1 for e in rest if not e.nonzero)
        out += _wrap(f"... {len(rest)} more: each loses at most {_pct(worst)} (flush + overflow) and has at most "
                     f"{_pct(sub)} subnormal" + (f"; {empty} saw no nonzero value" if empty else ""), first="")
    out.append("-" * len(line(header)))
    zeros = sum(e.zeros for e in r.entries)
    out.append(row("all", "", zeros / total_values if total_values else None, p.fractions()))
    other = r.formats[order[1]]
    out.append(f"{_SHORT[order[1]]} at 2^{r.scale_exp}: " + ", ".join(f"{c} {_pct(v)}" for c, v in
                                                                        other.fractions().items()))
    out.append("")

    limit = f"lose > {100 * p.fp32_threshold:g}% to flush/overflow in {short} at 2^{r.scale_exp}"
    if p.keep_fp32:
        out.append(f"keep in fp32 ({limit}):")
        groups = fix_groups(r)
        for n, (one, items) in enumerate(groups.items()):
            if n == 8:
                out.append(f"  ... and {len(groups) - 8} more fixes (to_dict()['fixes'])")
                break
            out += _wrap(", ".join(f"{name} ({'param' if _kind(r, name) == 'param' else 'out grad'}) "
                                   f"{_pct(share)}" for name, share in items), first="  - ")
            out += _code(f"O1/autocast: {one}")
            o2 = r.fixes[items[0][0]]["O2"]
            out += _code(f"O2: {o2}") if o2.startswith("amp.") else _wrap(f"O2: {o2}", indent="    ")
    else:
        out.append(f"keep in fp32: none (no gradient would {limit})")
    noise = [(e.name, p.lost(e.name)) for e in r.entries if e.name in r.noise]
    if noise:
        out.append("rounding noise, not a layer problem (*; losing it costs nothing, docs/doctor.md):")
        for name, share in sorted(noise, key=lambda item: -item[1]):
            out += _wrap(f"{name}: {_pct(share)} lost; {r.noise[name]}", first="  - ")
    if p.already_fp32:
        out += _wrap(f"fp32 in this run already (not cast): {', '.join(n for n, _ in p.already_fp32)}", indent="",
                     first="")
    if r.advice:
        out.append("advice:")
        for a in r.advice:
            out += _wrap(a, first="  - ")
    return "\n".join(out)


def fix_groups(r: Report) -> dict[str, list[tuple[str, float]]]:
    """``keep_fp32`` entries by the line that fixes them; an entry whose modules lie inside another line's
    modules (a parameter of a module that another entry keeps fp32 with its parent) joins that line."""
    groups: dict[str, list[tuple[str, float]]] = {}
    targets: dict[str, list[str]] = {}
    for name, share in r.primary.keep_fp32:
        fix = r.fixes[name]
        groups.setdefault(fix["O1"], []).append((name, share))
        targets[fix["O1"]] = fix["modules"]
    for line in sorted(groups, key=lambda x: min(m.count(".") for m in targets[x])):
        for other in groups:
            if other != line and groups.get(line) and all(
                any(m == t or m.startswith(t + ".") for t in targets[other]) for m in targets[line]
            ) and groups[other]:
                groups[other] += groups.pop(line)
                break
    for items in groups.values():
        items.sort(key=lambda item: -item[1])
    return groups


def _kind(r: Report, name: str) -> str:
    return next(e.kind for e in r.entries if e.name == name)
