"""The silent traps of apex-style amp under trainers that own the backward or the clipping now warn, once, naming the
fix; correct loops stay silent. Plain torch: no transformers needed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fp16kit import amp
from fp16kit.optim import FusedLAMB


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _loss(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return nn.functional.cross_entropy(model(torch.randn(4, 5, generator=g)).float(), torch.tensor([0, 1, 2, 0]))


def _setup(opt_level: str, opt_cls: type = torch.optim.SGD, **kw):
    model = _model()
    opt = opt_cls(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **kw)


def _steps(model, opt, n: int, body) -> None:
    for _ in range(n):
        body(model, opt)
        opt.step()
        opt.zero_grad()


def _scaled_backward(model, opt, **kw) -> None:
    with amp.scale_loss(_loss(model), opt, **kw) as scaled:
        scaled.backward()


def test_o1_backward_outside_scale_loss_warns_once_and_still_steps() -> None:
    model, opt = _setup("O1")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match=r"no amp\.scale_loss produced.*not loss-scaled.*AmpTrainer") as rec:
        _steps(model, opt, 3, lambda m, o: _loss(m).backward())
    assert sum("no amp.scale_loss produced" in str(w.message) for w in rec) == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_o1_last_backward_with_delay_unscale_warns() -> None:
    model, opt = _setup("O1")
    with pytest.warns(RuntimeWarning, match="still multiplied by the loss scale"):
        _steps(model, opt, 1, lambda m, o: _scaled_backward(m, o, delay_unscale=True))


def test_o2_fused_clipping_of_scaled_model_grads_warns() -> None:
    model, opt = _setup("O2", FusedLAMB)

    def body(m, o):
        _scaled_backward(m, o)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # what the stock HF Trainer does

    with pytest.warns(RuntimeWarning, match=r"clips the scaled gradients.*amp\.master_params\(optimizer\)") as rec:
        _steps(model, opt, 2, body)
    assert sum("clips the scaled gradients" in str(w.message) for w in rec) == 1


def test_o2_stash_path_clipping_of_model_grads_warns_it_has_no_effect() -> None:
    model, opt = _setup("O2", torch.optim.SGD)

    def body(m, o):
        _scaled_backward(m, o)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)

    with pytest.warns(RuntimeWarning, match=r"has no effect.*amp\.master_params\(optimizer\)"):
        _steps(model, opt, 2, body)


@pytest.mark.parametrize("opt_level, opt_cls", [("O1", torch.optim.SGD), ("O2", torch.optim.SGD), ("O2", FusedLAMB),
                                                ("O1", FusedLAMB)])
def test_correct_loops_are_silent(opt_level, opt_cls) -> None:
    model, opt = _setup(opt_level, opt_cls)

    def body(m, o):
        _scaled_backward(m, o, delay_unscale=True)  # accumulation: the last one unscales
        _scaled_backward(m, o)
        torch.nn.utils.clip_grad_norm_(amp.master_params(o), 1.0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(model, opt, 3, body)
        _steps(model, opt, 2, lambda m, o: _scaled_backward(m, o))
        opt.step()  # a step with nothing new: stale grads were zeroed, nothing to say


@pytest.mark.parametrize("opt_level", ["O0", "O3"])
def test_no_scaling_levels_accept_a_plain_backward(opt_level) -> None:
    model, opt = _setup(opt_level)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _steps(model, opt, 2, lambda m, o: _loss(m).backward())
