"""fp32 master weights: agreement with the model, zero_grad, gradient accumulation (delay_unscale and plain),
master_params for clipping."""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import batch, make_model, train_steps
from torch import nn
from torch.nn import functional as F

from fp16kit import amp
from fp16kit.numerics.formats import ulp

F16, F32 = torch.float16, torch.float32


def _o2(model=None, lr=0.1, **kwargs):
    model = model or make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return amp.initialize(model, opt, opt_level="O2", verbosity=0, **kwargs)


def _pairs(model, opt):
    return [(q, p) for q, p in zip(amp.master_params(opt), model.parameters()) if p.dtype == F16]


def test_masters_start_from_the_exact_fp32_weights_and_agree_after_steps():
    reference = make_model()
    model, opt = _o2(make_model())
    masters = list(amp.master_params(opt))
    for m, r in zip(masters, reference.parameters()):
        assert m.dtype == F32 and torch.equal(m, r)  # not the fp16 rounding (apex's choice)
    train_steps(model, opt, range(5))
    for master, param in _pairs(model, opt):
        assert torch.equal(master.to(F16), param)  # model = round-to-nearest-even(master), bit for bit
    assert any(not torch.equal(m, r) for m, r in zip(masters, reference.parameters()))


def test_masters_match_an_fp32_sgd_step_on_the_unscaled_grads():
    # one SGD step: master_new = master - lr * fp32(model.grad) / S, computed by hand
    model, opt = _o2(make_model(batchnorm=False), lr=0.5)
    opt.param_groups[0]["momentum"] = 0.0
    start = [m.detach().clone() for m in amp.master_params(opt)]
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    grads = [p.grad.float() / 65536.0 for p in model.parameters()]
    opt.step()
    for m, s, g in zip(amp.master_params(opt), start, grads):
        assert torch.equal(m, s - 0.5 * g)


def test_zero_grad_clears_model_and_master_grads():
    model, opt = _o2()
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(m.grad is not None for m in amp.master_params(opt))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert all(m.grad is None or not m.grad.any() for m in amp.master_params(opt))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in amp.master_params(opt))


def test_two_backwards_without_zero_grad_accumulate_unscaled():
    # without delay_unscale each scale_loss unscales its own grads and adds those already there (apex)
    model, opt = _o2(make_model(batchnorm=False))
    x, y = batch(0)
    for _ in range(2):
        with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
    twice = [m.grad.clone() for m in amp.master_params(opt)]
    opt.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    for t, m in zip(twice, amp.master_params(opt)):
        assert torch.equal(t, 2 * m.grad)  # same grads twice: the fp32 sum is exact


def test_o1_two_backwards_accumulate():
    model = make_model(batchnorm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, y = batch(0)
    for _ in range(2):
        with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
    twice = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    for t, p in zip(twice, model.parameters()):
        assert torch.equal(t, 2 * p.grad)


def _fp16_grad(model: nn.Module, x, y, scale: float) -> list[torch.Tensor]:
    """fp16 model grads (scaled) of a fresh backward, as float64."""
    model.zero_grad()
    (F.cross_entropy(model(x), y, reduction="sum") / 64 * scale).backward()
    return [p.grad.double() for p in model.parameters()]


def test_delay_unscale_accumulation_equals_one_big_batch_to_fp16_rounding():
    """Two micro-batches with delay_unscale vs one batch of both, under O2.

    The per-row forward/backward is identical in both (linear model, loss = sum / 64 with 1/64 exact), so the
    results differ only
    in where fp16 rounds the scaled weight gradients: accumulated = rnd(rnd(S*Ga) + rnd(S*Gb)), one batch =
    rnd(S*(Ga+Gb)). Each rnd errs by at most half an fp16 ulp of its result, so
    |accumulated - one batch| <= (ulp(S*Ga) + ulp(S*Gb) + ulp(accumulated) + ulp(one batch)) / 2, which we
    evaluate from the measured fp16 micro-batch grads (rounded values: one more half ulp each).
    """
    torch.manual_seed(0)
    base = nn.Linear(8, 4)
    x, y = batch(0, n=64)
    xa, ya, xb, yb = x[:32], y[:32], x[32:], y[32:]

    model, opt = _o2(nn.Linear(8, 4), loss_scale=128.0)  # static S = 128: no fp16 overflow at this size
    model.load_state_dict(base.state_dict())
    opt.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(xa), ya, reduction="sum") / 64, opt, delay_unscale=True) as scaled:
        scaled.backward()
    with amp.scale_loss(F.cross_entropy(model(xb), yb, reduction="sum") / 64, opt) as scaled:
        scaled.backward()
    accumulated = [m.grad.double() for m in amp.master_params(opt)]

    big_model, big_opt = _o2(nn.Linear(8, 4), loss_scale=128.0)
    big_model.load_state_dict(base.state_dict())
    with amp.scale_loss(F.cross_entropy(big_model(x), y, reduction="sum") / 64, big_opt) as scaled:
        scaled.backward()
    one_batch = [m.grad.double() for m in amp.master_params(big_opt)]

    s = 128.0
    ga, gb = _fp16_grad(big_model, xa, ya, s), _fp16_grad(big_model, xb, yb, s)
    for acc, big, a, b in zip(accumulated, one_batch, ga, gb):
        u = lambda t: ulp(t, F16)
        bound = (u(a) * 1.5 + u(b) * 1.5 + u(acc * s) + u(big * s)) / 2 / s
        assert ((acc - big).abs() <= bound).all(), float(((acc - big).abs() - bound).max())
        assert not torch.equal(acc, torch.zeros_like(acc))


def test_master_params_are_what_clipping_should_see():
    model, opt = _o2()
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    params = list(amp.master_params(opt))
    assert all(p.dtype == F32 for p in params) and len(params) == len(list(model.parameters()))
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=1e-3)
    assert 0 < float(norm) < 10  # the unscaled norm, not 65536 times it
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    assert abs(float(clipped) - 1e-3) < 1e-6


def test_a_failing_backward_leaves_the_earlier_grads_in_place():
    model = make_model(batchnorm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    before = [p.grad.clone() for p in model.parameters()]
    loss = F.cross_entropy(model(x), y)
    try:
        with amp.scale_loss(loss, opt) as scaled:
            raise KeyboardInterrupt  # e.g. interrupted before backward
    except KeyboardInterrupt:
        pass
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_o2_every_param_group_gets_masters_and_steps_through_them():
    # issue 9, mutation gap: masters made for the first param group only survived the suite (one group everywhere)
    reference = make_model(batchnorm=False)
    model = make_model(batchnorm=False)
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.25}]
    model, opt = amp.initialize(model, torch.optim.SGD(groups, lr=0.5), opt_level="O2", verbosity=0)
    for group, layer in zip(opt.param_groups, (reference[0], reference[2])):
        for q, r in zip(group["params"], layer.parameters()):
            assert q.dtype == F32 and torch.equal(q, r)  # an fp32 master from the exact fp32 start, in each group
    start = [[q.detach().clone() for q in g["params"]] for g in opt.param_groups]
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    grads = [[p.grad.float() / 65536.0 for p in layer.parameters()] for layer in (model[0], model[2])]
    opt.step()
    for group, s, g in zip(opt.param_groups, start, grads):
        for q, q0, gq in zip(group["params"], s, g):
            assert torch.equal(q, q0 - group["lr"] * gq)
    for master, param in _pairs(model, opt):
        assert torch.equal(master.to(F16), param)


@pytest.mark.parametrize(
    ("kwargs", "scale"),
    [({"loss_scale": 128.0}, 128.0), ({"loss_scale": "dynamic", "max_loss_scale": 1024.0}, 1024.0)],
    ids=["static", "dynamic"],
)
def test_o3_two_backwards_before_step_add_their_fp16_grads(kwargs, scale):
    # issue 9, mutation gap: fp16 grad accumulation at O3 overwriting instead of adding survived the suite.
    # Per element: first = fp16(fp32(g1) / S), then grad = fp16(fp32(g2) / S + fp32(first)) (one rounding each).
    model = make_model(batchnorm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0, **kwargs)
    params = list(model.parameters())
    scaled = [torch.autograd.grad(F.cross_entropy(model(x), y).float() * scale, params)
              for x, y in (batch(0), batch(1))]
    first = [(g.float() * (1 / scale)).half() for g in scaled[0]]
    expected = [(g.float() * (1 / scale) + f.float()).half() for g, f in zip(scaled[1], first)]
    for step in (0, 1):
        x, y = batch(step)
        with amp.scale_loss(F.cross_entropy(model(x), y), opt) as loss:
            loss.backward()
    for p, e in zip(params, expected):
        assert p.grad.dtype == F16 and torch.equal(p.grad, e)
    assert not all(torch.equal(e, f) for e, f in zip(expected, first))
