"""Checkpoints: model / optimizer / amp state_dicts restored after a fresh initialize continue bit-identically
(O1 and O2, fp32 masters included), in either load order; apex-format amp state; load errors and warnings."""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import bits, make_model, roundtrip, train_steps

from fp16kit import amp
from fp16kit.amp._frontend.masters import MASTERS_KEY

# overflows at steps 2, 3 and 8; with scale_window=3 and hysteresis=2 the scale grows and backs off on both
# sides of the resume point, and the hysteresis and growth trackers are mid-count when the checkpoint is taken
OVERFLOWS = {2, 3, 8}
KW = {"scale_window": 3, "hysteresis": 2, "verbosity": 0}


def _fresh(level, seed=0, optimizer="adam"):
    model = make_model(seed)
    if optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:  # fp16kit's FusedLAMB: device-side skips, its own load_state_dict
        from fp16kit.optim import FusedLAMB

        opt = FusedLAMB(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=level, **KW)


def _train(model, opt, steps):
    return train_steps(model, opt, steps, inject_inf=lambda s: s in OVERFLOWS)


def _everything(model, opt):
    out = [bits(t) for t in model.state_dict().values() if t.is_floating_point()]
    out += [bits(p) for p in model.parameters()] + [bits(p) for p in amp.master_params(opt)]
    for state in opt.state.values():
        out += [bits(v) if v.is_floating_point() else v for v in state.values()]
    return out


def _checkpoint(model, opt):
    return roundtrip({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()})


@pytest.mark.parametrize(
    ("level", "model_first", "optimizer"),
    [("O1", True, "adam"), ("O1", False, "adam"), ("O2", True, "adam"), ("O2", False, "adam"),
     ("O1", True, "lamb"), ("O2", True, "lamb")],
)
def test_resume_is_bit_identical(level, model_first, optimizer):
    model, opt = _fresh(level, optimizer=optimizer)
    losses = _train(model, opt, range(12))
    expected, expected_amp = _everything(model, opt), amp.state_dict()

    model, opt = _fresh(level, optimizer=optimizer)
    first = _train(model, opt, range(6))
    ckpt = _checkpoint(model, opt)
    assert ckpt["amp"]["loss_scaler0"]["fp16kit"]["hysteresis_tracker"] == 2
    assert ckpt["amp"]["loss_scaler0"]["unskipped"] == 2

    # a different initialisation: everything must come from the checkpoint
    model, opt = _fresh(level, seed=7, optimizer=optimizer)
    if model_first:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
    else:
        opt.load_state_dict(ckpt["optimizer"])
        model.load_state_dict(ckpt["model"])
    amp.load_state_dict(ckpt["amp"])
    rest = _train(model, opt, range(6, 12))

    assert first + rest == losses
    got = _everything(model, opt)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"tensor {i} differs after resume"
    assert amp.state_dict() == expected_amp


def test_o2_optimizer_checkpoint_carries_exact_masters():
    model, opt = _fresh("O2")
    _train(model, opt, range(4))
    sd = roundtrip(opt.state_dict())
    masters = list(amp.master_params(opt))
    saved = sd[MASTERS_KEY]
    assert sorted(saved) == [0, 1, 4, 5]  # the fp16 params' positions; batchnorm's fp32 params are not mastered
    for i, tensor in saved.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, masters[i])
    # the masters carry information the fp16 model does not: re-deriving them from the model would lose it
    assert any(not torch.equal(masters[i], masters[i].half().float()) for i in saved)


def test_checkpoint_without_masters_rederives_them_from_the_model():
    model, opt = _fresh("O2")
    _train(model, opt, range(3))
    sd = roundtrip(opt.state_dict())
    del sd[MASTERS_KEY]  # what an apex checkpoint looks like
    model_sd = model.state_dict()
    model2, opt2 = _fresh("O2", seed=5)
    model2.load_state_dict(model_sd)
    with pytest.warns(RuntimeWarning, match="no fp32 master weights.*rebuilt from the fp16/bf16 model parameters"):
        opt2.load_state_dict(sd)
    for master, param in zip(amp.master_params(opt2), model2.parameters()):
        assert torch.equal(master, param.float())


def test_loading_new_model_weights_resyncs_stale_masters():
    # apex left the masters at the pre-load weights: the first step then undid the load (loss spike)
    donor = make_model(seed=3)
    model, opt = _fresh("O2")
    model.load_state_dict(donor.state_dict())
    for master, ref in zip(amp.master_params(opt), donor.parameters()):
        assert torch.equal(master, ref.half().float()) or torch.equal(master, ref)


def test_apex_format_amp_state_loads():
    _fresh("O1")
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5}})
    sd = amp.state_dict()["loss_scaler0"]
    assert sd["loss_scale"] == 1024.0 and sd["unskipped"] == 5


def test_amp_state_dict_shape_and_multiple_scalers():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", num_losses=3, verbosity=0)
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert sd["loss_scaler1"]["loss_scale"] == 65536.0 and sd["loss_scaler1"]["unskipped"] == 0
    assert type(sd["loss_scaler1"]["loss_scale"]) is float and type(sd["loss_scaler1"]["unskipped"]) is int


def test_amp_load_state_dict_count_mismatch_and_unexpected_key(capsys):
    _fresh("O1")
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1},
                         "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0}})
    out = capsys.readouterr().out
    assert out == ("Warning: state_dict contains 2 entries, while 1 loss_scalers are used\n"
                   "Skipping loss_scaler[1], since num_losses was set to 1\n")
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 8.0
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "scaler_extra"'):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 1}, "scaler_extra": {}})
