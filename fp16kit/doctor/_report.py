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

**Which scale the advice is for.** ``keep_fp32`` is judged at one loss scale: the one the watched run used
(its scaler's), one the caller gives, or, where the run had none, the *recommended* one for the leading format
(2^0 when that already keeps the ``keep`` share normal, else the top of the recommended range, where a dynamic
scaler settles: it grows until the gradients overflow). ``Report.scale_basis`` says which.

**Rounding noise is not a layer problem.** A parameter gradient whose median binade lies ``NOISE_BINADES`` or
more below the median of another gradient of the same module (its other parameters, its output gradient) is
listed apart, in ``noise``, not in ``keep_fp32``. A gradient that is zero in exact arithmetic comes out of the
fp32 backward as the rounding error of a sum of terms that cancel, about 2^-24 of those terms: the key bias of
an attention layer (softmax does not change when a query's scores all move by the same amount, and the key bias
moves them so), a bias followed by batchnorm. Real gradients of one module differ by the size of its inputs,
rarely by 2^12. Losing noise in fp16 costs nothing.

**What to do.** Each ``keep_fp32`` entry comes with code (:func:`fix_for`): under autocast / O1 the module is
run in fp32 with ``fp16kit.amp``'s public decorators (:func:`keep_fp32`); under O2 the only per-module option
``amp.initialize`` has is ``keep_batchnorm_fp32``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._classes import CLASSES, format_limits

__all__ = ["CLASSES", "NOISE_BINADES", "Entry", "FormatReport", "Report", "classify", "format_limits", "keep_fp32"]

#: Exponent range of the accumulated (unscaled) histograms: an fp32 value's exponent (-149..127) minus a
#: scale exponent (an fp32 scale is 2^-149 .. 2^127).
TRUE_MIN_EXP = -149 - 127
TRUE_MAX_EXP = 127 + 149
NUM_EXPONENTS = TRUE_MAX_EXP - TRUE_MIN_EXP + 1
_SCALE_MIN_EXP, _SCALE_MAX_EXP = -149, 127  # powers of two an fp32 loss scale can be
#: a parameter gradient this many binades below another gradient of its module is rounding noise (see above)
NOISE_BINADES = 12
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


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
    dtypes: tuple[str, ...] = ()  # dtypes the gradient was observed in ("float32", "float16", ...)

    @property
    def nonzero(self) -> int:
        """Nonzero finite values counted (the denominator of every fraction)."""
        return int(self.counts.sum())

    @property
    def values(self) -> int:
        return self.nonzero + self.zeros + self.infs + self.nans

    @property
    def module_path(self) -> str:
        """The dotted name of the module this gradient belongs to (a parameter's owner, or the module itself)."""
        return self.name.rpartition(".")[0] if self.kind == "param" else self.name


def _fractions(classes: dict[str, int]) -> dict[str, float]:
    total = sum(classes.values())
    return {k: (v / total if total else 0.0) for k, v in classes.items()}


def _median_exp(counts: np.ndarray) -> int | None:
    """The binade (unscaled exponent) holding the median nonzero value, or None if there is none."""
    cum = np.cumsum(counts)
    if not cum.size or cum[-1] == 0:
        return None
    return TRUE_MIN_EXP + int(np.searchsorted(cum, (cum[-1] + 1) // 2))


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
    keep_fp32: list[tuple[str, float]]  # (entry, lost share) above the threshold, worst first; noise excluded
    fp32_threshold: float
    normal_at_max: float | None  # share of nonzero values normal at 2^max_scale_exp
    noise: list[tuple[str, float]] = field(default_factory=list)  # noise entries above the threshold
    already_fp32: list[tuple[str, float]] = field(default_factory=list)  # above it, but fp32 in a mixed run

    def fractions(self, name: str | None = None) -> dict[str, float]:
        """Fractions of nonzero values per class, for one entry or (``None``) all together."""
        return _fractions(self.total if name is None else self.classes[name])

    def lost(self, name: str) -> float:
        """Share of an entry's nonzero values that flush or overflow."""
        fr = self.fractions(name)
        return fr["flush"] + fr["overflow"]

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
            "keep_fp32": {"threshold": self.fp32_threshold, "entries": dict(self.keep_fp32),
                          "noise": dict(self.noise), "already_fp32": dict(self.already_fp32)},
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


def recommended_scale_exp(s_max: int | None, keep_range: tuple[int, int] | None) -> tuple[int, str]:
    """The scale to judge at where the run had none, and why: 2^0 if it is in the recommended range, else the
    range's top (where a dynamic scaler settles), else the largest scale without overflow, else 2^0."""
    if keep_range is not None:
        if keep_range[0] <= 0 <= keep_range[1]:
            return 0, "no loss scale needed: 2^0 is in the recommended range"
        return keep_range[1], "the top of the recommended range, where a dynamic scaler settles"
    if s_max is not None:
        return s_max, "the largest scale without overflow (no scale keeps the asked share normal)"
    return 0, "no nonzero gradient seen"


def find_noise(entries: Sequence[Entry]) -> dict[str, str]:
    """Parameter gradients that are rounding noise (see the module docstring): name -> reason."""
    median = {e.name: _median_exp(e.counts) for e in entries if e.nonzero}
    by_module: dict[str, list[str]] = {}
    for e in entries:
        if e.name in median:
            by_module.setdefault(e.module_path, []).append(e.name)
    out = {}
    for e in entries:
        if e.kind != "param" or e.name not in median:
            continue
        others = [n for n in by_module[e.module_path] if n != e.name]
        if not others:
            continue
        ref = max(others, key=lambda n: median[n])
        gap = median[ref] - median[e.name]
        if gap >= NOISE_BINADES:
            out[e.name] = (f"median |g| 2^{median[e.name]} is 2^-{gap} of {ref}'s (2^{median[ref]}): rounding noise "
                           f"of a gradient that is zero in exact arithmetic")
    return out


_BATCHNORM = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d", "LazyBatchNorm2d",
              "LazyBatchNorm3d")


def fix_for(entry: Entry, consumers: Sequence[str] = ()) -> dict[str, Any]:
    """The code that keeps ``entry``'s gradient in fp32: ``{"modules", "O1", "amp", "O2"}``.

    A parameter's gradient is computed by its module's backward: keep that module fp32. A module's output
    gradient is computed by whatever consumes the output, and is fp32 only if the output is: keep the module
    and the modules that consumed its output (``consumers``, seen by the watcher) fp32, or, where no watched
    module consumed it (a functional op in the parent's ``forward``, e.g. attention's matmul), the parent.
    ``"O1"`` is the one line with :func:`keep_fp32`; ``"amp"`` the same with ``fp16kit.amp`` alone;
    ``"O2"`` what ``amp.initialize`` offers (``keep_batchnorm_fp32`` for batchnorm, nothing per module else).
    """
    path = entry.module_path
    if entry.kind == "param":
        modules = [path]
    elif consumers:
        modules = [path, *(c for c in consumers if c != path)]
    else:
        parent = path.rpartition(".")[0]
        modules = [parent] if parent else [path]
    names = ", ".join(f'"{m}"' for m in modules)
    one = f"doctor.keep_fp32(model, {names})"
    amp_line = (f"for n in [{names}]: m = model.get_submodule(n); "
                f"m.forward = amp.float_function(amp.disable_casts()(m.forward))")
    if entry.kind == "param" and entry.module in _BATCHNORM:
        o2 = 'amp.initialize(model, optimizer, opt_level="O2", keep_batchnorm_fp32=True)'
    else:
        o2 = f"none per module (O2 casts all but batchnorm): train with O1 and {one}"
    return {"modules": modules, "O1": one, "amp": amp_line, "O2": o2}


def keep_fp32(model: torch.nn.Module, *names: str) -> None:
    """Run the named submodules in fp32 under ``fp16kit.amp.autocast`` and O1 (their gradients stay fp32).

    Each module's ``forward`` becomes ``amp.float_function(amp.disable_casts()(forward))``: in a casting region
    its floating inputs are cast to fp32 and nothing inside is cast, so its outputs, and the gradients its
    backward receives and computes, are fp32. Outside a region it runs as before. This is the line each
    ``keep_fp32`` entry of a report comes with. O2 casts the parameters themselves: there it does not apply.
    """
    from .. import amp

    for name in names:
        module = model.get_submodule(name)
        module.forward = amp.float_function(amp.disable_casts()(module.forward))


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


class Report:
    """What the watched gradients would become in fp16 and bf16; see ``fp16kit/doctor/_report.py``.

    ``formats[dtype]`` holds a :class:`FormatReport` for float16 and bfloat16 (side by side); ``dtype`` is
    the one the table, the ranking and the picture lead with. ``scale_exp`` is the judged scale: the run's
    (``scale_basis == "run"``), a given one (``"given"``) or, with ``scale_exp=None``, the recommended one for
    ``dtype`` (``"recommended"``). ``noise`` (name -> reason), ``fixes`` (name -> :func:`fix_for`) and
    ``advice`` (one line per misuse the histograms show) complete it.
    """

    def __init__(
        self,
        entries: Sequence[Entry],
        *,
        dtype: torch.dtype,
        scale_exp: int | None,
        scale_source: str,
        steps: int,
        samples: int,
        every: int,
        keep: float = 0.99,
        fp32_threshold: float = 0.01,
        scale_basis: str | None = None,
        scaler: str | None = None,
        consumers: dict[str, list[str]] | None = None,
        run_scale_exp: int | None = None,
    ) -> None:
        check_report_args(dtype, keep, fp32_threshold)
        self.run_scale_exp = run_scale_exp  # the scale the run used (0 without a scaler), None if unknown
        self.entries = list(entries)
        self.dtype = dtype
        self.keep, self.fp32_threshold = keep, fp32_threshold
        self.steps, self.samples, self.every = steps, samples, every
        self.scaler = scaler  # the watched scaler's kind, None if none was watched
        self.consumers = dict(consumers or {})
        self.exponents = np.arange(TRUE_MIN_EXP, TRUE_MAX_EXP + 1)
        self._plain_source = scale_source  # what the source was before a recommendation was added to it
        if scale_exp is None:
            s_max, keep_range = _scale_advice(self.exponents, self.counts(), dtype, keep)
            scale_exp, why = recommended_scale_exp(s_max, keep_range)
            scale_basis = "recommended"
            scale_source = f"recommended for {_dtype_name(dtype)}, {scale_source}: {why}"
        self.scale_exp = scale_exp
        self.scale_source = scale_source
        self.scale_basis = scale_basis or "given"
        self.noise = find_noise(self.entries)
        seen = {d for e in self.entries for d in e.dtypes}
        self.mixed = bool(seen & {"float16", "bfloat16"})
        self.fixes = {e.name: fix_for(e, self.consumers.get(e.name, ())) for e in self.entries}
        self.formats = {d: self._for_format(d, keep, fp32_threshold) for d in (torch.float16, torch.bfloat16)}
        self.advice = self._advice()

    def rescored(
        self,
        dtype: torch.dtype | None = None,
        loss_scale: float | str | None = None,
        *,
        keep: float | None = None,
        fp32_threshold: float | None = None,
        reason: str = "asked for",
    ) -> Report:
        """The same histograms judged for another format, loss scale (a power of two) or thresholds.

        ``loss_scale="recommended"`` judges at the scale recommended for the format (as for a run without a
        scaler); ``reason`` says why, in the report's description of its scale. Without ``loss_scale`` the
        scale stays, except a recommended one, which is recommended anew for the new format and thresholds."""
        if loss_scale == "recommended":
            return Report(self.entries, dtype=self.dtype if dtype is None else dtype, scale_exp=None,
                          scale_source=reason, steps=self.steps, samples=self.samples, every=self.every,
                          keep=self.keep if keep is None else keep,
                          fp32_threshold=self.fp32_threshold if fp32_threshold is None else fp32_threshold,
                          scaler=self.scaler, consumers=self.consumers, run_scale_exp=self.run_scale_exp)
        recommend = loss_scale is None and self.scale_basis == "recommended"
        return Report(
            self.entries,
            dtype=self.dtype if dtype is None else dtype,
            scale_exp=(None if recommend else self.scale_exp if loss_scale is None
                       else scale_exponent(float(loss_scale))),
            scale_source=(self._plain_source if recommend else self.scale_source if loss_scale is None else "given"),
            steps=self.steps, samples=self.samples, every=self.every,
            keep=self.keep if keep is None else keep,
            fp32_threshold=self.fp32_threshold if fp32_threshold is None else fp32_threshold,
            scale_basis=self.scale_basis if loss_scale is None else "given",
            scaler=self.scaler, consumers=self.consumers, run_scale_exp=self.run_scale_exp,
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
        lost, noise, already = [], [], []
        for e in self.entries:
            c = classes[e.name]
            n = sum(c.values())
            share = (c["flush"] + c["overflow"]) / n if n else 0.0
            if share > threshold:
                if e.name in self.noise:
                    noise.append((e.name, share))
                elif self.mixed and e.dtypes == ("float32",) and self.scale_exp == self.run_scale_exp:
                    # seen in fp32 at the run's own scale with values fp16/bf16 would lose: they never went
                    # through a cast (a gradient cast back from fp16 is fp32 too, but holds only fp16 values)
                    already.append((e.name, share))
                else:
                    lost.append((e.name, share))
        for items in (lost, noise, already):
            items.sort(key=lambda item: -item[1])
        at_max = None
        if s_max is not None:
            at_max = _fractions(classify(self.exponents, self.counts(), s_max, dtype))["normal"]
        return FormatReport(dtype, self.scale_exp, classes, total, s_max, keep_range, keep, lost, threshold, at_max,
                            noise, already)

    def _advice(self) -> list[str]:
        """One line per misuse these histograms show (tests/doctor/test_advice.py has one case each)."""
        out = []
        seen = {d for e in self.entries for d in e.dtypes}
        p = self.primary
        s = self.scale_exp
        if "bfloat16" in seen and "float16" not in seen and self.scaler is not None and s != 0:
            out.append(f"bf16 gradients with a loss scaler ({self.scaler}, at 2^{s}): bf16 has fp32's exponent range, "
                       f"so scaling only shifts exponents it already holds; drop the scaler (e.g. "
                       f"GradScaler(enabled=False), or loss_scale=1.0 in amp.initialize).")
        if "float16" in seen and self.scaler is None:
            out.append("fp16 gradients but no scaler passed to doctor.watch: if the loss is scaled, pass scaler= "
                       "(else these histograms hold scaled values); if it is not, fp16 needs one: amp.GradScaler().")
        infs = sum(e.infs for e in self.entries)
        nans = sum(e.nans for e in self.entries)
        if infs or nans:
            out.append(f"{infs} inf and {nans} NaN gradient values were seen (overflowed before the doctor saw them):"
                       f" the loss scale was too large for some steps, or the run diverged.")
        if self.scale_basis == "run" and p.total["overflow"] and p.max_scale_exp is not None:
            out.append(f"at the run's loss scale 2^{s} {100 * p.fractions()['overflow']:.2g}% of the values overflow "
                       f"{_SHORT[self.dtype]}: a dynamic scaler skips those steps; a static one must be <= "
                       f"2^{p.max_scale_exp}.")
        if self.scale_basis == "run" and p.keep_range is not None and s < p.keep_range[0]:
            fr = p.fractions()
            out.append(f"the run's loss scale 2^{s} is below the recommended 2^{p.keep_range[0]} .. "
                       f"2^{p.keep_range[1]} for {_SHORT[self.dtype]} ({100 * fr['flush']:.2g}% flush, "
                       f"{100 * fr['subnormal']:.2g}% subnormal): use a dynamic scaler, or a static "
                       f"2^{p.keep_range[1]}.")
        low = sorted(seen & {"float16", "bfloat16"})
        if low:
            out.append(f"some gradients were observed in {' and '.join(low)}: they are what survived the cast (values "
                       f"flushed before the doctor saw them count as zeros); watch an fp32 run to see what a cast "
                       f"would lose.")
        return out

    @property
    def primary(self) -> FormatReport:
        return self.formats[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON-serializable builtins (exponent counts keyed by exponent, nonzero bins only).

        :meth:`from_dict` reads it back (``python -m fp16kit doctor --model doctor.json``)."""
        return {
            "dtype": _dtype_name(self.dtype),
            "loss_scale": self.loss_scale,
            "loss_scale_source": self.scale_source,
            "loss_scale_basis": self.scale_basis,
            "scaler": self.scaler,
            "run_loss_scale": None if self.run_scale_exp is None else 2.0**self.run_scale_exp,
            "steps": self.steps,
            "samples": self.samples,
            "every": self.every,
            "keep": self.keep,
            "fp32_threshold": self.fp32_threshold,
            "entries": [
                {
                    "name": e.name, "kind": e.kind, "module": e.module, "values": e.values, "zeros": e.zeros,
                    "infs": e.infs, "nans": e.nans, "dtypes": list(e.dtypes),
                    "exponents": {str(int(x)): int(c) for x, c in zip(self.exponents, e.counts) if c},
                }
                for e in self.entries
            ],
            "consumers": self.consumers,
            "noise": self.noise,
            "fixes": {name: self.fixes[name] for name, _ in self.primary.keep_fp32},
            "advice": self.advice,
            "formats": {_dtype_name(d): f.to_dict() for d, f in self.formats.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The report :meth:`to_dict` described (its histograms, settings and judged scale)."""
        entries = []
        for d in data["entries"]:
            counts = np.zeros(NUM_EXPONENTS, dtype=np.int64)
            for x, c in d["exponents"].items():
                counts[int(x) - TRUE_MIN_EXP] = int(c)
            entries.append(Entry(d["name"], d["kind"], d["module"], counts, int(d["zeros"]), int(d["infs"]),
                                 int(d["nans"]), tuple(d.get("dtypes", ()))))
        basis = data.get("loss_scale_basis", "given")
        return cls(entries, dtype=getattr(torch, data["dtype"]), scale_exp=scale_exponent(data["loss_scale"]),
                   scale_source=data.get("loss_scale_source", "saved"), steps=int(data["steps"]),
                   samples=int(data["samples"]), every=int(data["every"]), keep=float(data.get("keep", 0.99)),
                   fp32_threshold=float(data.get("fp32_threshold", 0.01)), scale_basis=basis,
                   scaler=data.get("scaler"), consumers=data.get("consumers"),
                   run_scale_exp=(None if data.get("run_loss_scale") is None
                                  else scale_exponent(data["run_loss_scale"])))

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
