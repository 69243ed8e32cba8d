"""The small seeded model and data the apex-compat tests train."""

from __future__ import annotations

import torch
from torch import nn


def classifier(norm: type[nn.Module]) -> nn.Module:
    """``Linear(6, 8) -> norm(8) -> ReLU -> Linear(8, 3)``, seeded (the same weights every call)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), norm(8), nn.ReLU(), nn.Linear(8, 3))


def batches(n: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` reproducible ``(inputs, class labels)`` batches of ``size`` rows for :func:`classifier`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]
