"""What the doctor tells the user: one line per misuse it can see, noise apart, the fix lines, the 100-column
report with the top entries, ``from_dict``; exact cases on the probe model of ``test_report.py``."""

from __future__ import annotations

import json

import pytest
import torch
from test_report import Probe, run
from torch import nn

from fp16kit import amp, doctor


def advice(report, part):
    lines = [a for a in report.advice if part in a]
    assert len(lines) <= 1, report.advice
    return lines


def test_a_clean_fp32_run_without_a_scaler_gets_no_advice_and_the_recommended_scale():
    w, _ = run([2.0**-20] * 10, other=[2.0**-18])
    r = w.report(torch.float16)
    assert r.advice == [] and r.scale_basis == "recommended"
    assert r.scale_exp == r.primary.keep_range[1] == 15 + 18  # the top of the range: 2^-18 lands in fp16's top
    assert "no scaler watched" in r.scale_source
    # 2^0 is in bf16's range: no scale needed there
    assert r.rescored(torch.bfloat16).scale_exp == 0
    assert r.rescored(loss_scale="recommended").scale_exp == 33
    assert r.rescored(loss_scale=4.0).scale_basis == "given"


def test_bf16_with_a_loss_scaler():
    w, _ = run([2.0**-20, 1.0], scale=2.0**16, scaler=2.0**16, dtype=torch.bfloat16)
    r = w.report(torch.bfloat16)
    assert r.scale_basis == "run" and r.scale_exp == 16
    assert advice(r, "bf16 gradients with a loss scaler (float, at 2^16)")
    assert "GradScaler(enabled=False)" in str(r)


def test_torch_grad_scaler_on_a_bf16_model():
    model = Probe(2, dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with doctor.watch(model, every=1, scaler=scaler) as w:
        scaler.scale(model(torch.tensor([1.0, 2.0**-20], dtype=torch.bfloat16),
                           torch.ones(1, dtype=torch.bfloat16))).backward()
    assert advice(w.report(torch.bfloat16), "bf16 gradients with a loss scaler (GradScaler, at 2^16)")


def test_fp16_gradients_without_a_watched_scaler():
    w, _ = run([2.0**-20, 2.0**-10], dtype=torch.float16)
    r = w.report(torch.float16)
    assert advice(r, "fp16 gradients but no scaler passed to doctor.watch")
    assert advice(r, "observed in float16: they are what survived the cast")


def test_non_finite_gradients():
    w, _ = run([float("inf"), float("nan"), 1.0])
    assert advice(w.report(loss_scale=1.0), "1 inf and 1 NaN gradient values were seen")


def test_the_runs_scale_overflows():
    w, _ = run([2.0**10, 1.0], scale=2.0**8, scaler=2.0**8)
    r = w.report(torch.float16)
    assert r.scale_basis == "run" and r.primary.total["overflow"] == 1
    assert advice(r, "overflow") == [  # 2^10 * 2^8 of the three values 2^10, 1 (p) and 1 (q)
        f"at the run's loss scale 2^8 33% of the values overflow fp16: a dynamic scaler skips those steps; a static "
        f"one must be <= 2^{15 - 10}."]


def test_the_runs_scale_is_below_the_recommended_range():
    w, _ = run([2.0**-20] * 100, scale=2.0, scaler=2.0)
    r = w.report(torch.float16)
    assert r.primary.keep_range == (6, 15)  # q's gradient is 1
    assert advice(r, "the run's loss scale 2^1 is below the recommended 2^6 .. 2^15 for fp16")
    assert not advice(r.rescored(loss_scale=2.0), "below the recommended")  # a given scale is a question, not a run


def test_rounding_noise_is_listed_apart_with_its_reason():
    # q's median binade is 30 below p's, in the same module: noise; losing it is not a reason to keep fp32
    w, _ = run([1.0, 1.0, 2.0**-3], other=[2.0**-30, 2.0**-31])
    r = w.report(torch.float16, loss_scale=1.0)
    assert r.primary.keep_fp32 == [] and r.primary.noise == [("q", 1.0)]
    assert r.noise["q"].startswith("median |g| 2^-31 is 2^-31 of p's (2^0)")  # the lower median
    text = str(r)
    assert "rounding noise, not a layer problem" in text and "q*" in text
    assert doctor.NOISE_BINADES == 12


def test_fix_lines():
    seq = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    with doctor.watch(seq, every=1, activations=True) as w:
        seq(torch.randn(8, 4)).mul(2.0**-40).sum().backward()
    r = w.report(torch.float16, loss_scale=1.0)
    assert r.consumers == {"0": ["1"], "1": ["2"], "2": ["3"]}
    assert r.fixes["0"]["O1"] == 'doctor.keep_fp32(model, "0", "1")'  # the module and what consumed its output
    assert r.fixes["3"]["O1"] == 'doctor.keep_fp32(model, "3")'  # its output went to the loss
    assert r.fixes["1.weight"]["O2"] == 'amp.initialize(model, optimizer, opt_level="O2", keep_batchnorm_fp32=True)'
    assert r.fixes["0.weight"]["O2"].startswith("none per module")
    assert r.fixes["0"]["amp"] == ('for n in ["0", "1"]: m = model.get_submodule(n); '
                                   'm.forward = amp.float_function(amp.disable_casts()(m.forward))')
    flagged = [n for n, _ in r.primary.keep_fp32]
    assert "3" in flagged and set(r.to_dict()["fixes"]) == set(flagged)
    # a module whose output a functional op of its parent consumed: the parent
    entry = doctor.Entry("enc.attn.key", "activation", "Linear", r.entries[0].counts, 0, 0, 0)
    assert doctor.fix_for(entry)["modules"] == ["enc.attn"]


def test_keep_fp32_runs_the_module_in_fp32_under_autocast():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    with amp.autocast(torch.float16):
        assert seq(x).dtype == torch.float16
    doctor.keep_fp32(seq, "2")
    with amp.autocast(torch.float16):
        assert seq[0](x).dtype == torch.float16 and seq(x).dtype == torch.float32
    assert torch.equal(seq(x), seq[2](seq[1](seq[0](x))))  # outside a region: as before


def test_report_fits_100_columns_shows_the_worst_and_counts_the_rest():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)])
    with doctor.watch(model, every=1) as w:
        model(torch.randn(2, 4)).sum().mul(2.0**-20).backward()
    r = w.report(torch.float16, loss_scale=1.0)
    text = str(r)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "the 15 worst of 40 gradients" in text and "... 25 more: each loses at most" in text
    assert len(r.to_dict()["entries"]) == 40


def test_from_dict_round_trip():
    w, _ = run([2.0**-30, 2.0**-10, 1.0, 2.0**20], activations=True)
    r = w.report(torch.float16)
    back = doctor.Report.from_dict(json.loads(r.to_json()))
    assert back.to_dict() == r.to_dict()
    assert str(back) == str(r)


@pytest.mark.parametrize("bad", [3.0, "big"])
def test_rescored_rejects_what_is_not_a_power_of_two(bad):
    w, _ = run([1.0])
    with pytest.raises((ValueError, TypeError)):
        w.report().rescored(loss_scale=bad)


class Mixed(nn.Module):
    """An fp16 parameter and an fp32 one: a mixed-precision run in miniature."""

    def __init__(self):
        super().__init__()
        self.low = nn.Parameter(torch.zeros(2, dtype=torch.float16))
        self.full = nn.Parameter(torch.zeros(2))

    def forward(self):
        return (self.low.float() * 2.0**-16).sum() + (self.full * 2.0**-26).sum()  # 10 binades apart: no noise


def test_fp32_gradients_of_a_mixed_run_are_already_fp32_only_at_the_runs_scale():
    model = Mixed()
    with doctor.watch(model, every=1) as w:
        model().backward()
    at_run = w.report(torch.float16, loss_scale=1.0)  # no scaler: the run's scale is 2^0
    assert at_run.run_scale_exp == 0
    assert at_run.primary.already_fp32 == [("full", 1.0)] and at_run.primary.keep_fp32 == []
    assert "fp32 in this run already (not cast): full" in str(at_run)
    # at another scale the dtype proves nothing (a gradient cast back from fp16 is fp32 too): listed to keep
    other = at_run.rescored(loss_scale=2.0**-8)
    assert [n for n, _ in other.primary.keep_fp32] == ["full"]
    assert other.primary.already_fp32 == []
