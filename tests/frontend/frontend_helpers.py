"""Small models, data and a training loop shared by the frontend tests (CPU, deterministic)."""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from fp16kit import amp


def make_model(seed: int = 0, batchnorm: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def batch(step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step`` of a fixed synthetic 4-class problem (the same for every run)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return x, y


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range,
                inject_inf: Callable[[int], bool] = lambda step: False) -> list[float]:
    """apex-style loop; ``inject_inf(step)`` makes that step's loss inf (so its grads overflow)."""
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        if inject_inf(step):
            loss = loss * float("inf")
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def roundtrip(obj: object) -> object:
    """``torch.save`` then ``torch.load``: what a checkpoint on disk gives back."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()
