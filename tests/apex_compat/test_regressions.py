"""Bugs that apex's own test suite found in fp16kit (tests/apex_suite), pinned here so they stay fixed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp16kit import amp
from fp16kit.kernels import unscale_and_check


@pytest.mark.parametrize("first_in_place", [True, False])
def test_unscale_fallback_with_in_place_and_out_of_place_pairs_in_one_call(first_in_place) -> None:
    """The torch fallback decided "in place" from the first pair only: the other pairs' outputs stayed unwritten
    (apex's test_multiple_models_optimizers_losses: a fp32 param whose grad accumulates over two losses)."""
    a, b = torch.full((3,), 8.0), torch.full((2,), 4.0)
    out_b = torch.full((2,), -1.0)
    flag = torch.zeros(1)
    if first_in_place:
        unscale_and_check([a, b], 0.25, flag, out=[a, out_b])
        assert torch.equal(a, torch.full((3,), 2.0)) and torch.equal(out_b, torch.ones(2))
    else:
        unscale_and_check([b, a], 0.25, flag, out=[out_b, a])
        assert torch.equal(out_b, torch.ones(2)) and torch.equal(a, torch.full((3,), 2.0))
    assert torch.equal(b, torch.full((2,), 4.0)) and float(flag) == 0.0


def test_o1_grad_of_a_model_shared_by_two_losses_accumulates() -> None:
    torch.manual_seed(0)
    models = [nn.Linear(3, 1), nn.Linear(3, 1), nn.Linear(3, 1)]
    ref = [nn.Linear(3, 1) for _ in models]
    for r, m in zip(ref, models):
        r.load_state_dict(m.state_dict())
    x = torch.randn(4, 3)
    (ref[0](x).sum() + ref[2](x).sum()).backward()
    (ref[1](x).sum() + ref[2](x).sum()).backward()
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    models, opt = amp.initialize(models, opt, opt_level="O1", loss_scale=128.0, verbosity=0)  # no fp16 overflow
    l0 = models[0](x).sum() + models[2](x).sum()
    l1 = models[1](x).sum() + models[2](x).sum()
    for loss in (l0, l1):
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    for r, m in zip(ref, models):
        for p, q in zip(r.parameters(), m.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=2e-3, atol=1e-3)  # O1: fp16 matmuls
