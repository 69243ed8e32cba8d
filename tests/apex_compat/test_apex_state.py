"""apex internals as views: ``amp._amp_state``, ``optimizer._amp_stash`` lists, ``_lazy_init_maybe_master_weights``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16kit import amp
from fp16kit.amp import _amp_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))


def test_loss_scalers_and_opt_properties_view_the_latest_initialize() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    assert len(_amp_state.loss_scalers) == 2
    assert _amp_state.loss_scalers[1].loss_scale() == 65536.0 and _amp_state.loss_scalers[0].dynamic
    _amp_state.loss_scalers[0]._loss_scale = 4.0  # DeepLearningExamples: init_loss_scale
    assert _amp_state.loss_scalers[0]._loss_scale == 4.0
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 4.0
    loss = model(torch.randn(8, 4)).float().sum()
    with amp.scale_loss(loss, opt, loss_id=0) as scaled:
        assert float(scaled.detach()) == pytest.approx(4.0 * float(loss.detach()), rel=1e-6)
        scaled.backward()
    props = _amp_state.opt_properties
    assert (props.opt_level, props.master_weights, props.loss_scale, props.cast_model_type) == (
        "O2", True, "dynamic", torch.float16)
    assert props.enabled and props.keep_batchnorm_fp32 is True
    with pytest.raises(AttributeError, match=r"read-only in fp16kit: pass master_weights= to amp\.initialize"):
        props.master_weights = False
    with pytest.raises(AttributeError, match="no option 'nonsense'"):
        props.nonsense  # noqa: B018
    _amp_state.handle._deactivate()  # apex scripts call it; nothing is patched globally


def test_stash_lists_are_the_optimizers_own_tensors() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    stash = opt._amp_stash
    fp16 = [model[0].weight, model[0].bias, model[2].weight, model[2].bias]
    assert [id(p) for p in stash.all_fp16_params] == [id(p) for p in fp16]
    assert all(p.dtype == torch.float16 for p in stash.all_fp16_params)
    masters = list(amp.master_params(opt))
    assert all(any(m is q for q in masters) for m in stash.all_fp32_from_fp16_params)
    assert all(m.dtype == torch.float32 for m in stash.all_fp32_from_fp16_params)
    assert [id(p) for p in stash.all_fp32_params] == [id(model[1].weight), id(model[1].bias)]
    for p, m in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        assert torch.equal(p, m.half())
    before = [m.clone() for m in stash.all_fp32_from_fp16_params]
    assert opt._lazy_init_maybe_master_weights() is None  # masters exist since initialize: nothing to do
    assert all(torch.equal(a, b) for a, b in zip(before, stash.all_fp32_from_fp16_params))
    stash.lazy_init_called = True  # what BERT's run_pretraining.py sets next; a plain attribute


def test_o1_stash_has_no_masters() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    assert opt._amp_stash.all_fp16_params == [] and opt._amp_stash.all_fp32_from_fp16_params == []
    assert len(opt._amp_stash.all_fp32_params) == 6
    assert _amp_state.opt_properties.master_weights is None


def test_allow_incoming_model_not_fp32() -> None:
    with pytest.raises(RuntimeError, match="expected a float32 parameter"):
        amp.initialize(_model().half(), opt_level="O2", verbosity=0)
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        model = _model().half()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        assert len(opt._amp_stash.all_fp32_from_fp16_params) == 6  # BN is fp16 too: mastered
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False


def test_amp_state_is_a_private_name() -> None:
    assert "_amp_state" not in amp.__all__
    from fp16kit.amp import _amp_state as again

    assert again is _amp_state


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_param_group_added_after_initialize_gets_unscaled_grads(opt_level) -> None:
    """apex's test_add_param_group: without the wrap, the new group's grads reached step() still scaled."""
    def build():
        torch.manual_seed(0)
        return nn.Linear(3, 2), nn.Linear(3, 2)

    x = torch.randn(5, 3)
    m0, m1 = build()
    ref_opt = torch.optim.SGD(m0.parameters(), lr=0.25, momentum=0.5)
    ref_opt.add_param_group({"params": m1.parameters(), "lr": 0.5})
    for _ in range(2):
        ref_opt.zero_grad()
        (m0(x).square().mean() + m1(x).square().mean()).backward()
        ref_opt.step()

    a0, a1 = build()
    opt = torch.optim.SGD(a0.parameters(), lr=0.25, momentum=0.5)
    [a0, a1], opt = amp.initialize([a0, a1], opt, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    opt.add_param_group({"params": a1.parameters(), "lr": 0.5})
    n_masters = len(opt._amp_stash.all_fp32_from_fp16_params)
    assert n_masters == (4 if opt_level == "O2" else 0)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(a0(x).float().square().mean() + a1(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    for p, q in zip([*m0.parameters(), *m1.parameters()], [*a0.parameters(), *a1.parameters()]):
        torch.testing.assert_close(q.float(), p, rtol=1e-2, atol=2e-3)  # fp16 math: a few fp16 ulps
