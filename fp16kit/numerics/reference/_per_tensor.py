"""What the optimizer references (``optim.py``, ``optim_apex.py``) share: float64 copies of their inputs, and
the loop that steps one tensor at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

F64 = torch.float64


def f64(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """float64 copies (new tensors unless already float64: the references never write them)."""
    return [t.detach().to(F64) for t in tensors]


def per_tensor(step: Callable[..., tuple], columns: Sequence[Sequence[Any]], outputs: int) -> tuple[list, ...]:
    """``step`` on each tensor's row (the ``columns`` zipped: its param, grad, state...), its ``outputs`` results
    regrouped as one list each (the new params, the new states...)."""
    results: tuple[list, ...] = tuple([] for _ in range(outputs))
    for row in zip(*columns):
        for out, value in zip(results, step(*row), strict=True):
            out.append(value)
    return results
