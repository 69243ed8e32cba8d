"""Hyper-parameter and parameter checks shared by FusedLAMB, FusedAdam and the functional API.

Every error names the offending value and says what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch

__all__ = ["check_hyperparams", "check_param_tensor", "check_sparse_grad"]


def _number(fn: str, name: str, value: Any) -> float | None:
    """The value as a float, or None for a tensor (its value lives on the device: not checked, no sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{fn}: {name} must be a number or a one-element floating tensor, got {value!r}.")
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{fn}: {name} must be a real number, got {type(value).__name__} {value!r}.")
    return float(value)


def check_hyperparams(
    fn: str,
    *,
    lr: Any,
    betas: Any,
    eps: Any,
    weight_decay: Any,
    max_grad_norm: Any = None,
) -> None:
    """lr >= 0, 0 <= beta1, beta2 < 1, eps >= 0, weight_decay >= 0, max_grad_norm >= 0 (all finite).

    A tensor ``lr`` is accepted unchecked: reading it would sync a GPU with the host.
    """
    lr_value = _number(fn, "lr", lr)
    if lr_value is not None and not (0.0 <= lr_value < float("inf")):
        raise ValueError(f"{fn}: invalid learning rate lr={lr!r}; it must be a finite number >= 0.")
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"{fn}: betas must be a pair (beta1, beta2), got {betas!r}.")
    for i, beta in enumerate(betas):
        value = _number(fn, f"betas[{i}]", beta)
        if value is None or not (0.0 <= value < 1.0):
            raise ValueError(f"{fn}: invalid beta{i + 1}={beta!r} in betas={tuple(betas)!r}; each must lie in [0, 1).")
    eps_value = _number(fn, "eps", eps)
    if eps_value is None or not (0.0 <= eps_value < float("inf")):
        raise ValueError(f"{fn}: invalid eps={eps!r}; it must be a finite number >= 0 (e.g. 1e-6).")
    wd_value = _number(fn, "weight_decay", weight_decay)
    if wd_value is None or not (0.0 <= wd_value < float("inf")):
        raise ValueError(f"{fn}: invalid weight_decay={weight_decay!r}; it must be a finite number >= 0.")
    if max_grad_norm is not None:
        mgn = _number(fn, "max_grad_norm", max_grad_norm)
        if mgn is None or not (0.0 <= mgn < float("inf")):
            raise ValueError(
                f"{fn}: invalid max_grad_norm={max_grad_norm!r}; it must be a finite number >= 0 (0 disables clipping)."
            )


def check_param_tensor(fn: str, index: int, p: torch.Tensor) -> None:
    """A dense real floating tensor (fp16, bf16, fp32, fp64)."""
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{fn}: params[{index}] is a {type(p).__name__}, not a torch.Tensor.")
    if p.is_sparse or p.layout != torch.strided:
        raise TypeError(
            f"{fn}: params[{index}] has layout {p.layout}; only dense (strided) parameters are supported. "
            f"Use torch.optim.SparseAdam for sparse parameters."
        )
    if p.is_complex():
        raise TypeError(
            f"{fn}: params[{index}] is complex ({p.dtype}); complex parameters are not supported. "
            f"Optimize torch.view_as_real(p) instead."
        )
    if p.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{fn}: params[{index}] has dtype {p.dtype}; expected float16, bfloat16, float32 or float64.")


def check_sparse_grad(fn: str, index: int, g: torch.Tensor) -> None:
    """Sparse gradients (e.g. from ``nn.Embedding(sparse=True)``) cannot be used."""
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(
            f"{fn}: the gradient of params[{index}] is sparse ({g.layout}); {fn} needs dense gradients. "
            f"Use nn.Embedding(sparse=False), or torch.optim.SparseAdam for that parameter."
        )
