"""The apex-style frontend hands ``found_inf`` in the form the optimizer declares (``fp16kit.kernels.flag_for``).

Before issue 10's tidy the frontend decided by ``type(optimizer).__module__``: any optimizer outside ``torch.*``
that follows torch's fused contract (``_step_supports_amp_scaling``) got fp16kit's ``[1]`` flag instead of the
0-dim flag torch's contract documents.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp16kit import amp
from fp16kit.amp._frontend import stepping


@pytest.fixture(autouse=True)
def _drop_pending_overflow_reports():
    yield
    stepping.REPORTS.clear()


class _Recording(torch.optim.Optimizer):
    """A fused-contract optimizer outside torch (plain SGD): skips on the device flag, records the flag's shape."""

    _step_supports_amp_scaling = True

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})
        self.shapes = []

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        self.shapes.append(None if found_inf is None else tuple(found_inf.shape))
        scale = getattr(self, "grad_scale", None)
        skip = found_inf is not None and float(found_inf.reshape(())) != 0.0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not skip:
                    g = p.grad if scale is None else p.grad / scale.reshape(())
                    p.add_(g.to(p.dtype), alpha=-group["lr"])


class _RecordingFp16kit(_Recording):
    _fp16kit_checks_inf = True


@pytest.mark.parametrize(("cls", "shape"), [(_Recording, ()), (_RecordingFp16kit, (1,))])
def test_frontend_hands_the_declared_form(cls, shape):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = cls(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert opt.shapes == [shape]
    assert not hasattr(opt, "found_inf")  # handed over for the step only


@pytest.mark.parametrize(("cls", "shape"), [(_Recording, ()), (_RecordingFp16kit, (1,))])
def test_grad_scaler_hands_the_declared_form(cls, shape):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = cls(model.parameters())
    scaler = amp.GradScaler(device="cpu", init_scale=2.0**4)
    loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert opt.shapes == [shape]
