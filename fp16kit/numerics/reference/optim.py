"""float64 references for the optimizers: LAMB exactly as apex's FusedLAMB computes it, and Adam/AdamW.

These are the specs (``docs/specs/lamb.md``) written as plain float64 torch code, one tensor at a time, with no
fusion and no cleverness. Every input is converted to float64 first, every result is a new float64
tensor: nothing is modified in place. The fp32 kernels and fallbacks of :mod:`fp16kit.optim` are tested
against them with ulp budgets.

``step`` is always the number of the step being taken (1 for the first update), i.e. the counter after
the increment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._per_tensor import f64, per_tensor

__all__ = ["adam_step", "global_grad_norm", "lamb_clip_factor", "lamb_step"]


def global_grad_norm(grads: Sequence[torch.Tensor]) -> float:
    """``sqrt(sum of g*g over every element of every tensor)`` in float64 (NaN/inf propagate)."""
    total = sum(float((g ** 2).sum()) for g in f64(grads))
    return math.sqrt(total)


def lamb_clip_factor(gnorm: float, max_grad_norm: float) -> float:
    """apex's global clipping divisor: ``gnorm / max_grad_norm`` when ``0 < max_grad_norm < gnorm``, else 1."""
    if max_grad_norm > 0 and gnorm > max_grad_norm:
        return gnorm / max_grad_norm
    return 1.0


def lamb_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    use_nvlamb: bool = False,
    max_grad_norm: float = 1.0,
    global_norm: float | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One LAMB step of one parameter group, in float64. Returns ``(params, exp_avgs, exp_avg_sqs)``.

    Math (apex ``FusedLAMB``, ``docs/specs/lamb.md``)::

        clip = gnorm / max_grad_norm if 0 < max_grad_norm < gnorm else 1
        bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1, 1)
        beta3 = 1 - b1 if grad_averaging else 1
        g = grad / clip
        if not adam_w_mode and wd != 0: g = g + wd * p          # L2: decay enters the moments
        m = b1 * m + beta3 * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / bc1) / (sqrt(v / bc2) + eps)
        if adam_w_mode and wd != 0: u = u + wd * p                # decoupled decay
        ratio = lr * |p| / |u|  if (use_nvlamb or wd != 0) and |p| != 0 and |u| != 0  else lr
        p = p - ratio * u

    ``gnorm`` is the norm over the gradients of *all* groups: pass ``global_norm`` (see
    :func:`global_grad_norm`) when the step spans several groups; by default it is computed from ``grads``.
    """
    b1, b2 = betas
    if global_norm is None:
        global_norm = global_grad_norm(grads)
    clip = lamb_clip_factor(global_norm, max_grad_norm)
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
    beta3 = 1 - b1 if grad_averaging else 1.0
    wd = weight_decay

    def one(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> tuple:
        g = g / clip
        if not adam_w_mode and wd != 0:
            g = g + wd * p
        m = b1 * m + beta3 * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
        if adam_w_mode and wd != 0:
            u = u + wd * p
        pn = float(torch.linalg.vector_norm(p))
        un = float(torch.linalg.vector_norm(u))
        ratio = lr * pn / un if (use_nvlamb or wd != 0) and pn != 0 and un != 0 else lr
        return p - ratio * u, m, v

    return per_tensor(one, (f64(params), f64(grads), f64(exp_avgs), f64(exp_avg_sqs)), outputs=3)


def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """One Adam (``adam_w_mode=False``) or AdamW step in float64, as ``torch.optim.Adam``/``AdamW``.

    Math::

        if not adam_w_mode: g = g + wd * p                      # Adam: L2 penalty in the gradient
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1, 1)
        if adam_w_mode: p = p * (1 - lr * wd)                    # AdamW: decoupled decay
        p = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

    Returns ``(params, exp_avgs, exp_avg_sqs)`` as new float64 tensors.
    """
    b1, b2 = betas
    bc1, bc2 = (1 - b1**step, 1 - b2**step) if bias_correction else (1.0, 1.0)
    wd = weight_decay

    def one(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> tuple:
        if not adam_w_mode and wd != 0:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        if adam_w_mode and wd != 0:
            p = p * (1 - lr * wd)
        return p - (lr / bc1) * m / (torch.sqrt(v) / math.sqrt(bc2) + eps), m, v

    return per_tensor(one, (f64(params), f64(grads), f64(exp_avgs), f64(exp_avg_sqs)), outputs=3)
