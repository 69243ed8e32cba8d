"""float64 references for apex's other optimizers: FusedSGD, FusedAdagrad, FusedNovoGrad, and LARC's gradient
rewrite. (FusedMixedPrecisionLamb is LAMB: :func:`fp16kit.numerics.reference.lamb_step`.)

Plain float64 torch code, one tensor at a time: every input is converted to float64 first and every result
is a new float64 tensor (nothing is modified in place). The math is apex's (``csrc/multi_tensor_sgd_kernel.cu``,
``multi_tensor_adagrad.cu``, ``multi_tensor_novograd.cu``, ``apex/parallel/LARC.py``), written out in
``docs/optim-apex.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._per_tensor import F64, f64, per_tensor

__all__ = ["adagrad_step", "larc_grads", "novograd_step", "sgd_step"]


def sgd_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor | None],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    wd_after_momentum: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """One apex FusedSGD step. ``momentum_buffers[i] is None`` means the buffer does not exist yet (first use:
    it becomes the gradient). Returns ``(params, momentum_buffers)``; buffers are None when momentum is 0.

    Math::

        if wd != 0 and not wd_after_momentum: g = g + wd * p
        if momentum != 0:
            m = g (first use)  or  m = momentum * m + (1 - dampening) * g
            g = g + momentum * m  if nesterov  else  m
        if wd != 0 and wd_after_momentum: g = g + wd * p
        p = p - lr * g
    """

    def one(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None) -> tuple:
        if weight_decay != 0 and not wd_after_momentum:
            g = g + weight_decay * p
        buf = None
        if momentum != 0:
            buf = g if m is None else momentum * m.detach().to(F64) + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g + weight_decay * p
        return p - lr * g, buf

    return per_tensor(one, (f64(params), f64(grads), momentum_buffers), outputs=2)


def adagrad_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    sums: Sequence[torch.Tensor],
    *,
    lr: float,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    adagrad_w_mode: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One apex FusedAdagrad step. Returns ``(params, sums)``.

    Math::

        if not adagrad_w_mode: g = g + wd * p                   # L2 penalty
        h = h + g * g
        u = g / (sqrt(h) + eps)
        if adagrad_w_mode: u = u + wd * p                       # decoupled decay
        p = p - lr * u
    """

    def one(p: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> tuple:
        if not adagrad_w_mode:
            g = g + weight_decay * p
        h = h + g * g
        u = g / (torch.sqrt(h) + eps)
        if adagrad_w_mode:
            u = u + weight_decay * p
        return p - lr * u, h

    return per_tensor(one, (f64(params), f64(grads), f64(sums)), outputs=2)


def _grad_norm(g: torch.Tensor, norm_type: int) -> float:
    return float(g.abs().max()) if norm_type == 0 else float(torch.linalg.vector_norm(g))


def novograd_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    norms: Sequence[float | None],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    reg_inside_moment: bool = False,
    norm_type: int = 2,
    init_zero: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """One apex FusedNovoGrad step (``step`` = the number of this step, 1 first). ``norms[i]`` is tensor i's
    blended gradient norm so far, or None before its first step. Returns ``(params, exp_avgs, norms)``.

    Math, per tensor (``n`` = its gradient's L2 norm, or max |g| for ``norm_type=0``)::

        v = n (first step, init_zero=False) or 0 (first step, init_zero=True) or the stored value
        v = sqrt(b2 v^2 + (1 - b2) n^2)   (L2)      v = b2 v + (1 - b2) n   (inf-norm)
        bc1, bc2 = (1 - b1^step, sqrt(1 - b2^step)) if bias_correction else (1, 1)
        beta3 = 1 - b1 if grad_averaging else 1;   denom = v / bc2 + eps
        reg_inside_moment:   g = g / denom + wd p;  m = b1 m + beta3 g;  u = m / bc1
        otherwise:           m = b1 m + beta3 g;    u = (m / bc1) / denom + wd p
        p = p - lr u
    """
    b1, b2 = betas
    bc1, bc2 = (1 - b1**step, math.sqrt(1 - b2**step)) if bias_correction else (1.0, 1.0)
    beta3 = 1 - b1 if grad_averaging else 1.0

    def one(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: float | None) -> tuple:
        n = _grad_norm(g, norm_type)
        if v is None:
            v = 0.0 if init_zero else n
        v = math.sqrt(b2 * v * v + (1 - b2) * n * n) if norm_type == 2 else b2 * v + (1 - b2) * n
        denom = v / bc2 + eps
        if reg_inside_moment:
            g = g / denom + weight_decay * p
            m = b1 * m + beta3 * g
            u = m / bc1
        else:
            m = b1 * m + beta3 * g
            u = (m / bc1) / denom + weight_decay * p
        return p - lr * u, m, v

    return per_tensor(one, (f64(params), f64(grads), f64(exp_avgs), norms), outputs=3)


def larc_grads(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    lr: float,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.02,
    clip: bool = True,
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """The gradients apex's LARC hands to the wrapped optimizer (whose weight decay it sets to 0 meanwhile).

    Math, per tensor, when ``|p| != 0`` and ``|g| != 0`` (otherwise ``g`` is unchanged and gets no decay)::

        a = trust_coefficient * |p| / (|g| + |p| * wd + eps)
        if clip: a = min(a / lr, 1)
        g = (g + wd * p) * a
    """

    def one(p: torch.Tensor, g: torch.Tensor) -> tuple:
        pn, gn = float(torch.linalg.vector_norm(p)), float(torch.linalg.vector_norm(g))
        if pn != 0 and gn != 0:
            a = trust_coefficient * pn / (gn + pn * weight_decay + eps)
            if clip:
                a = min(a / lr, 1.0)
            g = (g + weight_decay * p) * a
        return (g,)

    return per_tensor(one, (f64(params), f64(grads)), outputs=1)[0]
