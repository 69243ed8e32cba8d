"""The measure of success: a training script written for apex.amp runs unchanged with ``from fp16kit import amp``.

The loop below is the pattern of apex's README and ImageNet example (initialize after building the optimizer,
an LR scheduler, scale_loss, clipping the master params, checkpointing model / optimizer / amp), with only
the import changed and ``.cuda()`` left out.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fp16kit import amp  # was: from apex import amp

TEACHER = torch.randn(20, 5, generator=torch.Generator().manual_seed(99))


def apex_style_training(opt_level: str, steps: int, checkpoint: dict | None = None) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 5))
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale="dynamic", verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        amp.load_state_dict(checkpoint["amp"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    start = 0 if checkpoint is None else checkpoint["step"]
    losses = []
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        inputs = torch.randn(16, 20, generator=g)
        target = (inputs @ TEACHER).argmax(1)  # a learnable task
        output = model(inputs)
        loss = criterion(output, target)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict(),
             "scheduler": scheduler.state_dict(), "step": steps}
    return losses, state


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_apex_script_runs_unchanged_and_resumes_exactly(opt_level):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" and the like
        full, _ = apex_style_training(opt_level, steps=10)
        first, ckpt = apex_style_training(opt_level, steps=5)
        rest, _ = apex_style_training(opt_level, steps=10, checkpoint=ckpt)
    assert first + rest == full
    assert sum(full[-3:]) < sum(full[:3])
