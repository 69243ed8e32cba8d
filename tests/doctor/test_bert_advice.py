"""The doctor on a tiny BertForMaskedLM: advice at the scale that will be used, the key bias set apart as
rounding noise, and the printed line, applied, keeps the flagged gradients under fp16 autocast.

The model is built locally from a ``BertConfig`` (hidden 32, 2 layers, vocab 100; no download). Dropout is off
so that the fp32 and fp16 runs see the same network.
"""

from __future__ import annotations

import pytest
import torch

from fp16kit import amp, doctor

transformers = pytest.importorskip("transformers")

KEY = "bert.encoder.layer.0.attention.self.key"
QUERY = "bert.encoder.layer.0.attention.self.query"


def tiny_bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return transformers.BertForMaskedLM(cfg)


def batches(n=3):
    gen = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, 100, (8, 16), generator=gen)
        yield ids, ids.clone()


def watch_run(model, dtype=None, steps=3):
    """Backward passes of ``model`` (every one sampled) in fp32 or under fp16kit's autocast, no scaler."""
    with doctor.watch(model, every=1, activations=True) as w:
        for ids, labels in batches(steps):
            model.zero_grad()
            if dtype is None:
                loss = model(input_ids=ids, labels=labels).loss
            else:
                with amp.autocast(dtype=dtype):
                    loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
    return w


@pytest.fixture(scope="module")
def fp32_report():
    return watch_run(tiny_bert()).report(torch.float16)


def test_without_a_scaler_the_advice_is_at_the_recommended_scale(fp32_report):
    r = fp32_report
    lo, hi = r.primary.keep_range
    assert r.scale_basis == "recommended" and r.scale_exp == hi and lo <= 16 <= hi
    assert "recommended for float16, no scaler watched" in str(r)
    assert r.primary.keep_fp32 == []  # query/key are fine there; what is left over is the key bias: noise
    assert {n for n, _ in r.primary.noise} == {f"bert.encoder.layer.{i}.attention.self.key.bias" for i in (0, 1)}
    # at 2^0 (fp16 without a scaler) the query/key output gradients flush
    at1 = r.rescored(loss_scale=1.0)
    flagged = dict(at1.primary.keep_fp32)
    assert flagged[KEY] > 0.3 and flagged[QUERY] > 0.3
    assert not any(n.endswith("key.bias") for n in flagged)


def test_the_key_bias_is_rounding_noise_with_its_reason(fp32_report):
    reason = fp32_report.noise[KEY + ".bias"]
    assert "rounding noise" in reason and KEY + ".weight" in reason
    text = str(fp32_report)
    assert "rounding noise, not a layer problem" in text and KEY + ".bias" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def zero_share(report, name):
    e = next(e for e in report.entries if e.name == name)
    return e.zeros / e.values


def test_the_printed_line_keeps_the_flagged_gradients_under_fp16_autocast(fp32_report):
    at1 = fp32_report.rescored(loss_scale=1.0)
    fix = at1.fixes[KEY]
    assert fix["O1"] == 'doctor.keep_fp32(model, "bert.encoder.layer.0.attention.self")'  # key's consumer: matmul
    assert fix["O1"] in str(at1)
    predicted = at1.primary.lost(KEY)
    assert zero_share(fp32_report, KEY) == 0

    # fp16 autocast, no scaler: the flushed values are zeros when the doctor sees them
    before = watch_run(tiny_bert(), torch.float16).report(torch.float16, loss_scale=1.0)
    lost_before = zero_share(before, KEY)
    assert lost_before > 0.5 * predicted
    assert set(next(e for e in before.entries if e.name == KEY).dtypes) == {"float16"}

    model = tiny_bert()
    for line in {at1.fixes[n]["O1"] for n, _ in at1.primary.keep_fp32}:  # every printed line, as printed
        exec(line, {"doctor": doctor, "model": model})
    after = watch_run(model, torch.float16).report(torch.float16, loss_scale=1.0)
    for name in (KEY, QUERY):
        assert zero_share(after, name) < 0.02 * lost_before, name
        assert next(e for e in after.entries if e.name == name).dtypes == ("float32",)
    # the doctor sees them as fp32 in this mixed run: no longer flagged
    flagged_after = dict(after.primary.keep_fp32)
    assert KEY not in flagged_after and KEY in dict(after.primary.already_fp32)
    # the amp-only form of the line does the same
    model = tiny_bert()
    exec(fix["amp"], {"amp": amp, "model": model})
    assert zero_share(watch_run(model, torch.float16, steps=1).report(loss_scale=1.0), KEY) < 0.02 * lost_before
