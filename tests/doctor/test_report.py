"""The doctor's report is exact on gradients with known exponents, boundaries and the rounding rule included.

A probe model makes the gradient whatever we choose: ``loss = sum(leaf(p) * c)`` gives ``p.grad = c`` and
the leaf module's output gradient ``c``, times the loss scale.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fp16kit import doctor
from fp16kit.amp import LossScaler
from fp16kit.numerics import strategies as fst

F16 = torch.finfo(torch.float16)
BF16 = torch.finfo(torch.bfloat16)


class Times1(nn.Module):
    def forward(self, x):
        return x * 1.0


class Probe(nn.Module):
    """``p.grad == c * scale`` exactly, and the leaf's output gradient too."""

    def __init__(self, n: int, m: int = 1, dtype=torch.float32):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n, dtype=dtype))
        self.q = nn.Parameter(torch.zeros(m, dtype=dtype))
        self.leaf = Times1()

    def forward(self, c, d):
        return (self.leaf(self.p) * c).sum() + (self.q * d).sum()


def run(values, other=(1.0,), *, scale=1.0, scaler=None, steps=1, every=1, activations=False, dtype=torch.float32):
    c = torch.tensor(values, dtype=torch.float64).to(dtype)
    d = torch.tensor(other, dtype=torch.float64).to(dtype)
    model = Probe(len(values), len(other), dtype)
    with doctor.watch(model, every=every, activations=activations, scaler=scaler) as w:
        for _ in range(steps):
            model.zero_grad()
            (model(c, d) * scale).backward()
    return w, model


def exact(report, dtype, name):
    """The fractions as exact ratios of the class counts (what the floats must equal)."""
    counts = report.formats[dtype].classes[name]
    total = sum(counts.values())
    return {k: Fraction(v, total) for k, v in counts.items()}, report.formats[dtype].fractions(name)


def test_fp16_boundaries_after_scaling_are_exact():
    """Each value is a boundary of fp16 once multiplied by the report's loss scale 2^4."""
    s = 2.0**-4
    values = [
        F16.smallest_normal * s,  # exactly the smallest normal: normal
        F16.smallest_normal * s / 2,  # largest subnormal binade: subnormal
        2.0**-24 * s,  # exactly the smallest subnormal: subnormal
        2.0**-25 * s,  # half of it: flush (a tie to even gives 0)
        F16.max * s,  # exactly the max finite: normal
        2.0**16 * s,  # the first power of two past max: overflow
        -(2.0**16) * s * 3,  # negative, far past: overflow
        0.0,  # zero: not in the fractions
    ]
    w, _ = run(values)
    report = w.report(torch.float16, loss_scale=16.0)
    counts = report.formats[torch.float16].classes["p"]
    assert counts == {"flush": 1, "subnormal": 2, "normal": 2, "overflow": 2}
    want, got = exact(report, torch.float16, "p")
    assert got == {k: float(v) for k, v in want.items()}
    assert got["subnormal"] == 2 / 7 and got["overflow"] == 2 / 7
    entry = report.entries[0]
    assert (entry.zeros, entry.nonzero, entry.values) == (1, 7, 8)
    # the same values in bf16 at 2^4: all normal (bf16 has fp32's range)
    assert report.formats[torch.bfloat16].classes["p"] == {"flush": 0, "subnormal": 0, "normal": 7, "overflow": 0}


def test_bf16_boundaries_are_exact():
    values = [BF16.smallest_normal, 2.0**-133, 2.0**-134, 2.0**-130, float(BF16.max), 2.0**127, 1.0]
    w, _ = run(values)
    at1 = w.report(torch.bfloat16, loss_scale=1.0).formats[torch.bfloat16].classes["p"]
    assert at1 == {"flush": 1, "subnormal": 2, "normal": 4, "overflow": 0}
    at2 = w.report(torch.bfloat16, loss_scale=2.0).formats[torch.bfloat16].classes["p"]
    # x2: 2^-134 -> 2^-133 (smallest subnormal), 2^-133 and 2^-130 stay subnormal, max and 2^127 overflow
    assert at2 == {"flush": 0, "subnormal": 3, "normal": 2, "overflow": 2}


def test_rounding_rule_classifies_by_the_unrounded_binade():
    """Values a real cast rounds across a class boundary keep the class of their exact binade (the documented
    rule); this test states what the real cast does, so a change of rule has to change it."""
    slices = {
        65520.0: "normal",  # [max + ulp/2, 2^16): the cast gives inf
        1.5 * 2.0**-25: "flush",  # (2^-25, 2^-24): the cast rounds up to 2^-24
        2.0**-14 - 2.0**-25: "subnormal",  # halfway to the smallest normal: ties to even, i.e. up to 2^-14
    }
    cast = {v: float(torch.tensor(v, dtype=torch.float64).float().half()) for v in slices}
    assert math.isinf(cast[65520.0]) and cast[1.5 * 2.0**-25] == 2.0**-24 and cast[2.0**-14 - 2.0**-25] == 2.0**-14
    for value, cls in slices.items():
        w, _ = run([value])
        counts = w.report(torch.float16, loss_scale=1.0).formats[torch.float16].classes["p"]
        assert counts[cls] == 1, (value, counts)


def test_scale_at_sampling_is_divided_out_and_the_scaler_scale_is_the_default():
    """Observed grads carry the scaler's 2^8; the histograms hold the unscaled values, so the report at 2^8
    sees them exactly as observed, and at 2^0 as the true gradients."""
    scaler = LossScaler(init_scale=2.0**8, device="cpu")
    values = [2.0**-30, 2.0**-20, 2.0**-10, 2.0**8]
    w, model = run(values, scale=2.0**8, scaler=scaler)
    assert torch.equal(model.p.grad, torch.tensor(values) * 2.0**8)
    default = w.report(torch.float16)
    assert default.loss_scale == 2.0**8 and "LossScaler" in default.scale_source
    assert default.formats[torch.float16].classes["p"] == {"flush": 0, "subnormal": 1, "normal": 2, "overflow": 1}
    at1 = w.report(torch.float16, loss_scale=1.0)
    assert at1.formats[torch.float16].classes["p"] == {"flush": 1, "subnormal": 1, "normal": 2, "overflow": 0}
    # the unscaled exponents themselves
    assert {int(e): int(n) for e, n in zip(at1.exponents, at1.entries[0].counts) if n} == {-30: 1, -20: 1, -10: 1, 8: 1}


@pytest.mark.parametrize("kind", ["torch", "fp16kit"])
def test_grad_scalers_are_read_on_the_device(kind):
    from fp16kit.amp import GradScaler

    scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**5) if kind == "torch"
              else GradScaler("cpu", init_scale=2.0**5))
    model = Probe(2)
    c, d = torch.tensor([2.0**-3, 2.0**-40]), torch.tensor([1.0])
    with doctor.watch(model, every=1, scaler=scaler) as w:
        scaler.scale(model(c, d)).backward()
    report = w.report(torch.float16)
    assert report.loss_scale == 2.0**5
    assert {int(e): int(n) for e, n in zip(report.exponents, report.entries[0].counts) if n} == {-3: 1, -40: 1}


def test_recommended_loss_scale_and_keep_range():
    values = [2.0**-30] + [2.0**-20] * 99
    w, _ = run(values, other=[2.0**-20])
    f16 = w.report(torch.float16, loss_scale=1.0, keep=0.99).formats[torch.float16]
    assert f16.max_scale_exp == 15 - (-20)  # largest exponent -20 lands in fp16's top binade, 15
    assert f16.keep_range == (6, 35)  # 99 of 100 parameter values + the other one: need 2^-20 * 2^s >= 2^-14
    strict = w.report(torch.float16, loss_scale=1.0, keep=1.0).formats[torch.float16]
    assert strict.keep_range == (16, 35)  # 2^-30 * 2^16 = 2^-14
    wide = [2.0**-40, 2.0**10]
    w2, _ = run(wide, other=[2.0**10])
    f16 = w2.report(torch.float16, loss_scale=1.0, keep=1.0).formats[torch.float16]
    assert f16.max_scale_exp == 5 and f16.keep_range is None  # no scale fits 2^-40 .. 2^10 into fp16's normals
    bf16 = w2.report(torch.float16, loss_scale=1.0, keep=1.0).formats[torch.bfloat16]
    assert bf16.keep_range == (-126 + 40, 117)


def test_layers_that_lose_most_are_listed_for_fp32_worst_first():
    # medians 2^-20 and 2^-30: 10 binades apart, less than NOISE_BINADES, so neither is rounding noise
    w, _ = run([2.0**-30, 2.0**-20, 2.0**-20, 2.0**-20], other=[2.0**-30, 2.0**-30, 2.0**-20])
    report = w.report(torch.float16, loss_scale=1.0, fp32_threshold=0.2)
    assert report.noise == {}
    assert report.primary.keep_fp32 == [("q", 2 / 3), ("p", 1 / 4)]
    assert w.report(torch.float16, loss_scale=1.0, fp32_threshold=0.3).primary.keep_fp32 == [("q", 2 / 3)]
    assert w.report(torch.bfloat16, loss_scale=1.0).primary.keep_fp32 == []


def test_activation_gradients_per_module_and_accumulation_over_sampled_steps():
    values = [2.0**-20, 2.0**-10, 0.0]
    w, _ = run(values, scale=1.0, steps=7, every=3, activations=True)
    assert (w.steps, w.samples) == (7, 3)  # steps 0, 3, 6
    report = w.report(torch.float16, loss_scale=1.0)
    names = [(e.name, e.kind, e.module) for e in report.entries]
    assert names == [("p", "param", "Probe"), ("q", "param", "Probe"), ("leaf", "activation", "Times1")]
    for e in (report.entries[0], report.entries[2]):  # p.grad and leaf's output grad are both c
        assert {int(x): int(n) for x, n in zip(report.exponents, e.counts) if n} == {-20: 3, -10: 3}
        assert e.zeros == 3
    with torch.no_grad():  # not a training step
        w.model(torch.ones(3), torch.ones(1))
    assert w.steps == 7
    w.reset()
    assert w.samples == 0 and int(w.histograms().sum()) == 0 and w.report(loss_scale=1.0).entries[0].values == 0


def test_float64_and_float16_models():
    w, _ = run([2.0**-20, 2.0**-149], dtype=torch.float64)  # fp64 grads are counted as fp32 (2^-149 survives)
    report = w.report(loss_scale=1.0)
    assert {int(e): int(n) for e, n in zip(report.exponents, report.entries[0].counts) if n} == {-20: 1, -149: 1}
    assert report.formats[torch.float16].classes["p"] == {"flush": 1, "subnormal": 1, "normal": 0, "overflow": 0}
    w, _ = run([2.0**-20, 2.0**-24], dtype=torch.float16)
    assert w.report(loss_scale=1.0).formats[torch.float16].classes["p"] == {
        "flush": 0, "subnormal": 2, "normal": 0, "overflow": 0}


def test_outputs_table_json_png(tmp_path):
    w, _ = run([2.0**-30, 2.0**-10, 1.0, 2.0**20], activations=True)
    report = w.report(torch.float16, loss_scale=1.0)
    text = str(report)
    for part in ("p ", "leaf", "fp16 at 2^0", "flush", "bf16 at 2^0: flush 0", "recommended loss scale",
                 "keep in fp32"):
        assert part in text
    assert max(len(line) for line in text.splitlines()) <= 100
    data = json.loads(json.dumps(report.to_dict()))
    assert data["formats"]["float16"]["entries"]["p"]["counts"] == {
        "flush": 1, "subnormal": 0, "normal": 2, "overflow": 1}
    assert data["entries"][0]["exponents"] == {"-30": 1, "-10": 1, "0": 1, "20": 1}
    pytest.importorskip("matplotlib")
    path = report.save_png(tmp_path / "d" / "doctor.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_bad_arguments():
    model = Probe(2)
    with pytest.raises(ValueError, match="every"):
        doctor.watch(model, every=0)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        doctor.watch([model.p])
    with pytest.raises(TypeError, match="scaler"):
        doctor.watch(model, scaler="dynamic")
    w, _ = run([1.0])
    with pytest.raises(ValueError, match="power of two"):
        w.report(loss_scale=3.0)
    with pytest.raises(ValueError, match=r"float16 or torch\.bfloat16"):
        w.report(torch.float32)
    with pytest.raises(RuntimeError, match="already active"), w, w:
        pass


def _binade_class(y: float, dtype) -> str:
    sub, norm, top = doctor.format_limits(dtype)
    e = math.frexp(abs(y))[1] - 1
    return "flush" if e < sub else "subnormal" if e < norm else "normal" if e <= top else "overflow"


def _cast_class(y: float, dtype) -> str:
    from fp16kit.numerics.reference import round_to_format

    r = float(round_to_format(torch.tensor(y, dtype=torch.float64), dtype))
    if r == 0:
        return "flush"
    if math.isinf(r):
        return "overflow"
    return "subnormal" if abs(r) < torch.finfo(dtype).smallest_normal else "normal"


def _documented_slice(y: float, doctor_class: str, cast_class: str, dtype) -> bool:
    """The three slices the rounding rule names (fp16kit/doctor/_report.py)."""
    fi = torch.finfo(dtype)
    sub, norm, top = doctor.format_limits(dtype)
    a = abs(y)
    half_ulp_top = 2.0 ** (top - {torch.float16: 10, torch.bfloat16: 7}[dtype] - 1)
    return (
        (doctor_class, cast_class) == ("normal", "overflow") and fi.max + half_ulp_top <= a < 2.0 ** (top + 1)
    ) or (
        (doctor_class, cast_class) == ("flush", "subnormal") and 2.0 ** (sub - 1) < a < 2.0**sub
    ) or (
        (doctor_class, cast_class) == ("subnormal", "normal") and 2.0**norm - 2.0 ** (sub - 1) <= a < 2.0**norm
    )


@settings(max_examples=20, deadline=None)
@given(
    values=fst.float_tensors(torch.float32, edge_fraction=0.3, max_numel=200, exponent_range=(-40, 20)),
    scale_exp=st.integers(-20, 30),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_report_matches_a_float64_reference_and_real_casts_outside_the_documented_slices(values, scale_exp, dtype):
    flat = values.reshape(-1)
    if flat.numel() == 0:
        return
    w, _ = run(flat.double().tolist())
    got = w.report(dtype, loss_scale=2.0**scale_exp).formats[dtype].classes["p"]
    want = dict.fromkeys(doctor.CLASSES, 0)
    for x in flat.double().tolist():
        if x == 0 or not math.isfinite(x):
            continue
        y = x * 2.0**scale_exp  # exact in float64
        cls = _binade_class(y, dtype)
        want[cls] += 1
        cast = _cast_class(y, dtype)
        assert cls == cast or _documented_slice(y, cls, cast, dtype), (x, scale_exp, cls, cast)
    assert got == want
