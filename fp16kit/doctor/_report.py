"""What the doctor's histograms mean for a target format: classification, loss-scale advice, the report.

The input is, per watched tensor, a histogram of the *unscaled* gradient's binary exponents
``e = floor(log2|g|)`` (see ``fp16kit/doctor/_watch.py``). For a power-of-two loss scale ``S = 2^s`` the
scaled value ``g * S`` lies exactly in binade ``e + s``, so its class in a format with smallest subnormal
``2^sub``, smallest normal ``2^norm`` and largest binade ``top`` (fp16: -24, -14, 15; bf16: -133, -126,
127) is::

    e + s <  sub             flush      (cast gives 0)
    sub  <= e + s < norm     subnormal  (kept with fewer significant bits)
    norm <= e + s <= top     normal
    e + s >  top             overflow   (cast gives inf)

**The rounding rule.** Classes are decided by the binade of the exact scaled value, before the cast
rounds it; the histogram has one column per binade, so rounding *within* a binade cannot be seen. Three
thin slices therefore land in a neighbouring class on a real cast (``tests/doctor/test_report.py`` checks
each against ``Tensor.to``):

- the top of the largest binade, ``[max + ulp/2, 2^(top+1))`` (fp16: ``[65520, 65536)``), rounds to inf
  but is counted *normal*;
- the binade below the smallest subnormal, ``(2^(sub-1), 2^sub)``, rounds up to the smallest subnormal
  but is counted *flush* (it keeps no significant bit of the value: relative error up to 100%);
  ``2^(sub-1)`` itself ties to even, i.e. to 0;
- the top of the largest subnormal binade rounds up to the smallest normal but is counted *subnormal*.

Fractions are of the nonzero finite values; zeros, infs and NaNs are counted separately (an inf seen by
the watcher had overflowed already).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..numerics.formats import format_of

__all__ = ["CLASSES", "Entry", "FormatReport", "Report", "classify", "format_limits"]

CLASSES = ("flush", "subnormal", "normal", "overflow")

#: Exponent range of the accumulated (unscaled) histograms: an fp32 value's exponent (-149..127) minus a
#: scale exponent (an fp32 scale is 2^-149 .. 2^127).
TRUE_MIN_EXP = -149 - 127
TRUE_MAX_EXP = 127 + 149
NUM_EXPONENTS = TRUE_MAX_EXP - TRUE_MIN_EXP + 1
_SCALE_MIN_EXP, _SCALE_MAX_EXP = -149, 127  # powers of two an fp32 loss scale can be


def format_limits(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(sub, norm, top)``: exponents of the smallest subnormal, the smallest normal and the largest binade."""
    fmt = format_of(dtype)
    return int(math.log2(fmt.min_subnormal)), fmt.min_exponent, math.floor(math.log2(fmt.max))


def check_report_args(dtype: torch.dtype, keep: float, fp32_threshold: float) -> None:
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"doctor report: dtype must be torch.float16 or torch.bfloat16, got {dtype}.")
    if not 0.0 < keep <= 1.0 or not 0.0 <= fp32_threshold < 1.0:
        raise ValueError(f"doctor report: keep must be in (0, 1] and fp32_threshold in [0, 1); "
                         f"got {keep} and {fp32_threshold}.")


def scale_exponent(loss_scale: float) -> int:
    """``k`` for ``loss_scale == 2^k``; anything else is an error (scaling must only shift exponents)."""
    mantissa, k = math.frexp(float(loss_scale))
    if not math.isfinite(loss_scale) or loss_scale <= 0 or mantissa != 0.5:
        raise ValueError(
            f"doctor report: loss_scale must be a positive power of two (so that scaling is exact and only "
            f"shifts exponents); got {loss_scale}. Pass 2.0**k, e.g. {2.0 ** (k - 1) if loss_scale > 0 else 1.0:g}."
        )
    return k - 1


def classify(exponents: np.ndarray, counts: np.ndarray, scale_exp: int, dtype: torch.dtype) -> dict[str, int]:
    """Counts per class (``CLASSES``) of values with binades ``exponents`` scaled by ``2^scale_exp``."""
    sub, norm, top = format_limits(dtype)
    shifted = exponents + scale_exp
    return {
        "flush": int(counts[shifted < sub].sum()),
        "subnormal": int(counts[(shifted >= sub) & (shifted < norm)].sum()),
        "normal": int(counts[(shifted >= norm) & (shifted <= top)].sum()),
        "overflow": int(counts[shifted > top].sum()),
    }


@dataclass
class Entry:
    """One watched tensor: a parameter's gradient or a module's output gradient (activation)."""

    name: str
    kind: str  # "param" or "activation"
    module: str  # the module's class name
    counts: np.ndarray = field(repr=False)  # int64 [NUM_EXPONENTS]: unscaled exponent TRUE_MIN_EXP + i
    zeros: int
    infs: int
    nans: int

    @property
    def nonzero(self) -> int:
        """Nonzero finite values counted (the denominator of every fraction)."""
        return int(self.counts.sum())

    @property
    def values(self) -> int:
        return self.nonzero + self.zeros + self.infs + self.nans


def _fractions(classes: dict[str, int]) -> dict[str, float]:
    total = sum(classes.values())
    return {k: (v / total if total else 0.0) for k, v in classes.items()}


@dataclass
class FormatReport:
    """The picture for one target format at one loss scale ``2^scale_exp``."""

    dtype: torch.dtype
    scale_exp: int
    classes: dict[str, dict[str, int]]  # entry name -> counts per class
    total: dict[str, int]  # all entries together
    max_scale_exp: int | None  # largest power of two with no overflow (None: nothing nonzero seen)
    keep_range: tuple[int, int] | None  # scale exponents keeping >= keep of the values normal, without overflow
    keep: float
    keep_fp32: list[tuple[str, float]]  # (entry, lost share) above the threshold, worst first
    fp32_threshold: float
    normal_at_max: float | None  # share of nonzero values normal at 2^max_scale_exp

    def fractions(self, name: str | None = None) -> dict[str, float]:
        """Fractions of nonzero values per class, for one entry or (``None``) all together."""
        return _fractions(self.total if name is None else self.classes[name])

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "loss_scale": 2.0**self.scale_exp,
            "total": {"counts": self.total, "fractions": self.fractions()},
            "entries": {k: {"counts": v, "fractions": _fractions(v)} for k, v in self.classes.items()},
            "recommended": {
                "max_loss_scale": None if self.max_scale_exp is None else 2.0**self.max_scale_exp,
                "keep": self.keep,
                "keep_range": None if self.keep_range is None else [2.0**s for s in self.keep_range],
                "normal_at_max_loss_scale": self.normal_at_max,
            },
            "keep_fp32": {"threshold": self.fp32_threshold, "entries": dict(self.keep_fp32)},
        }


def _scale_advice(exponents: np.ndarray, counts: np.ndarray, dtype: torch.dtype, keep: float):
    """(largest s with no overflow, range of s keeping >= keep above the subnormal threshold, or None)."""
    nonzero = counts > 0
    if not nonzero.any():
        return None, None
    _, norm, top = format_limits(dtype)
    e_max = int(exponents[nonzero].max())
    s_max = min(top - e_max, _SCALE_MAX_EXP)  # a loss scale is an fp32 number
    # share of values at or above the smallest normal after scaling by 2^s: norm <= e + s  <=>  e >= norm - s
    above = np.cumsum(counts[::-1])[::-1]  # above[i] = values with exponent >= exponents[i]
    total = int(counts.sum())
    need = keep * total
    # smallest s with above[norm - s] >= need: the largest index i with above[i] >= need gives s = norm - e_i
    ok = np.nonzero(above >= need - 1e-9 * total)[0]
    s_lo = max(norm - int(exponents[ok.max()]), _SCALE_MIN_EXP)
    return s_max, ((s_lo, s_max) if s_lo <= s_max else None)


class Report:
    """What the watched gradients would become in fp16 and bf16; see ``fp16kit/doctor/_report.py``.

    ``formats[dtype]`` holds a :class:`FormatReport` for float16 and bfloat16 (side by side); ``dtype`` is
    the one the table, the ranking and the picture lead with.
    """

    def __init__(
        self,
        entries: Sequence[Entry],
        *,
        dtype: torch.dtype,
        scale_exp: int,
        scale_source: str,
        steps: int,
        samples: int,
        every: int,
        keep: float = 0.99,
        fp32_threshold: float = 0.01,
    ) -> None:
        check_report_args(dtype, keep, fp32_threshold)
        self.entries = list(entries)
        self.dtype = dtype
        self.keep, self.fp32_threshold = keep, fp32_threshold
        self.scale_exp = scale_exp
        self.scale_source = scale_source
        self.steps, self.samples, self.every = steps, samples, every
        self.exponents = np.arange(TRUE_MIN_EXP, TRUE_MAX_EXP + 1)
        self.formats = {d: self._for_format(d, keep, fp32_threshold) for d in (torch.float16, torch.bfloat16)}

    def rescored(
        self,
        dtype: torch.dtype | None = None,
        loss_scale: float | None = None,
        *,
        keep: float | None = None,
        fp32_threshold: float | None = None,
    ) -> Report:
        """The same histograms judged for another format, loss scale (a power of two) or thresholds."""
        return Report(
            self.entries,
            dtype=self.dtype if dtype is None else dtype,
            scale_exp=self.scale_exp if loss_scale is None else scale_exponent(loss_scale),
            scale_source=self.scale_source if loss_scale is None else "given",
            steps=self.steps, samples=self.samples, every=self.every,
            keep=self.keep if keep is None else keep,
            fp32_threshold=self.fp32_threshold if fp32_threshold is None else fp32_threshold,
        )

    @property
    def loss_scale(self) -> float:
        return 2.0**self.scale_exp

    def counts(self, kind: str | None = None) -> np.ndarray:
        """Summed exponent counts of all entries (or of one kind: ``"param"`` / ``"activation"``)."""
        rows = [e.counts for e in self.entries if kind is None or e.kind == kind]
        return np.sum(rows, axis=0) if rows else np.zeros(NUM_EXPONENTS, dtype=np.int64)

    def _for_format(self, dtype: torch.dtype, keep: float, threshold: float) -> FormatReport:
        classes = {e.name: classify(self.exponents, e.counts, self.scale_exp, dtype) for e in self.entries}
        total = {k: sum(c[k] for c in classes.values()) for k in CLASSES}
        s_max, keep_range = _scale_advice(self.exponents, self.counts(), dtype, keep)
        lost = []
        for name, c in classes.items():
            n = sum(c.values())
            share = (c["flush"] + c["overflow"]) / n if n else 0.0
            if share > threshold:
                lost.append((name, share))
        lost.sort(key=lambda item: -item[1])
        at_max = None
        if s_max is not None:
            at_max = _fractions(classify(self.exponents, self.counts(), s_max, dtype))["normal"]
        return FormatReport(dtype, self.scale_exp, classes, total, s_max, keep_range, keep, lost, threshold, at_max)

    @property
    def primary(self) -> FormatReport:
        return self.formats[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-serializable builtins (exponent counts keyed by exponent, nonzero bins only)."""
        return {
            "dtype": str(self.dtype).replace("torch.", ""),
            "loss_scale": self.loss_scale,
            "loss_scale_source": self.scale_source,
            "steps": self.steps,
            "samples": self.samples,
            "every": self.every,
            "entries": [
                {
                    "name": e.name, "kind": e.kind, "module": e.module, "values": e.values, "zeros": e.zeros,
                    "infs": e.infs, "nans": e.nans,
                    "exponents": {str(int(x)): int(c) for x, c in zip(self.exponents, e.counts) if c},
                }
                for e in self.entries
            ],
            "formats": {str(d).replace("torch.", ""): f.to_dict() for d, f in self.formats.items()},
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        from ._table import format_report

        return format_report(self)

    def print(self) -> None:
        print(str(self))

    def save_png(self, path: str | Any) -> Any:
        """Write the picture (histogram with the format's ranges shaded, per-layer bars); returns the path."""
        from ._plot import save_png

        return save_png(self, path)

