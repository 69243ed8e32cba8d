"""Torch twin of the two LAMB kernels (``fp16kit/kernels/triton/lamb.py``): the same contract and math.

The float64 reference is ``fp16kit/numerics/reference/optim.py``; the 8-bit moments' twin is
``fp16kit/kernels/state8/fallback.py``, the bf16 weight modes' ``fp16kit/kernels/bf16_weights/``, and the opt-in
C++ CPU kernel ``fp16kit/kernels/fallback/lamb_native.py``. The skip and the commit are
:mod:`fp16kit.kernels.fallback.step`'s.

Fast CPU path: LAMB's stage 1 *is* the Adam update direction when grad averaging is on and there is no L2 term, so
with a step counter torch's fused CPU Adam kernel runs it with lr = 1 on a scratch buffer holding ``-wd p`` (or 0)
in place of the param, which leaves ``-u = -wd p - (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`` there; the
per-tensor norms and ``p += ratio * buf`` follow, batch by batch (:func:`_lamb_fused`,
:mod:`fp16kit.kernels.fallback.scratch`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .scratch import _add_scaled, _batches, _grads_for, _scaled_into, _scratch_views, _sumsq32, _write_models
from .step import (
    FusedAdamArgs,
    GradMoments,
    Rows,
    _finish,
    _fused_takes,
    _math,
    _second_moment,
    _skip,
    _write_params,
    bump_versions,
)

__all__ = ["lamb_", "lamb_direction", "lamb_moments", "lamb_u"]


def lamb_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    trust: bool,
    host_branch: bool | None = None,
    fused: FusedAdamArgs | None = None,
) -> None:
    """Both LAMB stages (see ``triton/lamb.py`` for the math); ``models[i]`` may be None. ``fused`` enables
    the fast CPU path (module docstring)."""
    if not params:
        return
    skip = _skip(found_inf, host_branch)
    if skip is True:
        return
    if skip is False:
        modes = {"l2_mode": l2_mode, "decoupled": decoupled, "trust": trust}
        _lamb_host((params, grads, exp_avgs, exp_avg_sqs, models), hp, **modes, fused=fused)
        return
    lr = hp[0]
    p = _math(params, hp.dtype)  # may alias the params: only out-of-place ops on it
    m, v, u = lamb_direction(p, (grads, exp_avgs, exp_avg_sqs), hp.unbind()[1:], (l2_mode, decoupled), in_place=False)
    torch._foreach_mul_(u, _trust_ratios(p, u, lr, trust))
    _finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, u, skip)


def lamb_direction(
    p: list[torch.Tensor],
    rows: GradMoments,
    scalars: Sequence[torch.Tensor | float],
    modes: tuple[bool, bool],
    *,
    in_place: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """LAMB's stage 1 in torch ops, the one copy every torch path shares (``lamb_`` and the sharded
    ``optimizers.lamb_stage1``; the math of ``triton/lamb.py``): returns ``(m, v, u)`` with
    ``g = grad * inv_scale / clip (+ wd p in l2 mode)``, ``m = beta1 m + beta3 g``,
    ``v = beta2 v + (1 - beta2) g g``, ``u = (m / bc1) / (sqrt(v / bc2) + eps) (+ wd p when decoupled)``.

    ``rows``: ``(grads, exp_avgs, exp_avg_sqs)``; ``modes``: ``(l2_mode, decoupled)``; ``scalars`` are ``hp[1:]``
    (0-dim tensors, or host numbers where the skip was read on the host); ``p`` is the params in the math dtype
    (only read). ``in_place``: m and v are the state tensors themselves, else new tensors (committed later under
    the skip mask). The rounding sequence (a multiply, then an add, no fused ``alpha``) is the kernel's;
    ``_lamb_host`` keeps its own in-place sequence for the CPU fast path.
    """
    l2_mode, decoupled = modes
    m, v = lamb_moments(p, rows, scalars, l2_mode, in_place=in_place)
    _, _, _, _, eps, wd, bc1, bc2, _, _ = scalars
    return m, v, lamb_u(p, m, v, eps, wd, bc1, bc2, decoupled)


def lamb_moments(
    p: list[torch.Tensor], rows: GradMoments, scalars: Sequence[torch.Tensor | float], l2_mode: bool, *, in_place: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LAMB's new moments ``(m, v)`` in the kernels' rounding sequence (:func:`lamb_direction`'s first half; also the
    8-bit CPU chunks', ``state8/fallback.py``): ``g = grad * inv_scale / clip (+ wd p in l2 mode)``,
    ``m = beta1 m + beta3 g``, ``v = beta2 v + (1 - beta2) g g``; in place on ``exp_avgs``/``exp_avg_sqs`` with
    ``in_place``, else new tensors. ``rows``: ``(grads, exp_avgs, exp_avg_sqs)``."""
    grads, exp_avgs, exp_avg_sqs = rows
    beta1, beta2, beta3, one_minus_beta2, _, wd, _, _, inv_scale, clip = scalars
    g = torch._foreach_mul(_math(grads, p[0].dtype), inv_scale)
    torch._foreach_div_(g, clip)
    if l2_mode:
        torch._foreach_add_(g, torch._foreach_mul(p, wd))
    if in_place:
        m = list(exp_avgs)
        torch._foreach_mul_(m, beta1)
    else:
        m = torch._foreach_mul(list(exp_avgs), beta1)
    torch._foreach_add_(m, torch._foreach_mul(g, beta3))
    return m, _second_moment(exp_avg_sqs, g, beta2, one_minus_beta2, in_place=in_place)


def lamb_u(
    p: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    eps: torch.Tensor | float,
    wd: torch.Tensor | float,
    bc1: torch.Tensor | float,
    bc2: torch.Tensor | float,
    decoupled: bool,
) -> list[torch.Tensor]:
    """LAMB's update direction ``u = (m / bc1) / (sqrt(v / bc2) + eps) (+ wd p when decoupled)`` from the new
    moments (new tensors; the kernel's rounding sequence)."""
    u = torch._foreach_div(m, bc1)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    if decoupled:
        torch._foreach_add_(u, torch._foreach_mul(p, wd))
    return u


def _trust_ratios(
    p: list[torch.Tensor], u: list[torch.Tensor], lr: torch.Tensor | float, trust: bool
) -> list[torch.Tensor] | torch.Tensor | float:
    """Per-tensor ``lr * |p| / |u|`` (``lr`` where either norm is 0), or plain ``lr`` without the trust ratio."""
    if not trust:
        return lr
    pn = torch.stack(torch._foreach_norm(p))
    un = torch.stack(torch._foreach_norm(u))
    return list(torch.where((pn != 0) & (un != 0), lr * (pn / un), lr).unbind())


def _lamb_host(
    rows: Rows, hp: torch.Tensor, *, l2_mode: bool, decoupled: bool, trust: bool, fused: FusedAdamArgs | None = None
) -> None:
    """LAMB when the skip was decided on the host (CPU): in place, host-number hyper-parameters (reading a
    CPU tensor costs no sync), no copy of the grads when there is nothing to unscale or clip: ~13 passes and
    two temporaries instead of ~22 passes and seven; with ``fused`` and where it applies, torch's fused Adam
    kernel for stage 1 (module docstring): ~4 passes. ``rows``: :data:`fp16kit.kernels.fallback.step.Rows`."""
    params, grads, exp_avgs, exp_avg_sqs, models = rows
    lr, beta1, beta2, beta3, one_minus_beta2, eps, wd, bc1, bc2, inv_scale, clip = hp.tolist()
    p = _math(params, hp.dtype)
    if fused is not None and not l2_mode and _fused_takes(fused, p, exp_avgs, exp_avg_sqs, lamb=True):
        scaling = (inv_scale, clip)
        _lamb_fused((p, grads, exp_avgs, exp_avg_sqs, models), fused, scaling, lr=lr, wd=wd if decoupled else 0.0,
                    trust=trust)
        _write_params(params, [None] * len(p), p, False)  # models: written batch by batch
        return
    g = _math(grads, hp.dtype)  # read only
    if inv_scale != 1.0 or clip != 1.0:
        g = torch._foreach_mul(g, inv_scale)
        if clip != 1.0:
            torch._foreach_div_(g, clip)
    if l2_mode:
        g = torch._foreach_add(g, p, alpha=wd)
    m, v = list(exp_avgs), list(exp_avg_sqs)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=beta3)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, one_minus_beta2)
    u = lamb_u(p, m, v, eps, wd, bc1, bc2, decoupled=False)  # the decoupled term in one fused pass instead:
    if decoupled:
        torch._foreach_add_(u, p, alpha=wd)
    torch._foreach_mul_(u, _trust_ratios(p, u, lr, trust))
    torch._foreach_sub_(p, u)
    _write_params(params, models, p, False)


def _lamb_fused(
    rows: Rows, fused: FusedAdamArgs, scaling: tuple[float, float], *, lr: float, wd: float, trust: bool
) -> None:
    """LAMB stage 1 in torch's fused Adam kernel, then the trust ratio and the update, batch by batch:
    ``buf = -wd p`` (or 0), ``buf -= (1 / bc1) m / (sqrt(v) / sqrt(bc2) + eps)`` (the kernel with lr = 1 and
    ``buf`` as its param), so ``buf = -u``; then ``p += ratio * buf`` with ``ratio = lr |p| / |buf|``
    (``|buf| = |u|``; float64 host numbers from the fp32 norms). Without the trust ratio (then ``wd == 0``)
    the step is ``p -= lr u``: the kernel runs on ``p`` itself with the learning rate, no buffer, no norms.
    ``scaling = (inv_scale, clip)``. Model copies are written per batch, from cache."""
    p, grads, exp_avgs, exp_avg_sqs, models = rows  # p: the params in the math dtype, contiguous
    lr64, beta1, beta2, _, _, eps, *_ = fused.hp64.tolist()
    with_models = any(m is not None for m in models)
    for rows in _batches(p):
        pb, mb, vb = [p[i] for i in rows], [exp_avgs[i] for i in rows], [exp_avg_sqs[i] for i in rows]
        gb = _grads_for(pb, [grads[i] for i in rows], *scaling)
        steps = [fused.step] * len(rows)
        if not trust:
            torch._fused_adam_(
                pb, gb, mb, vb, [], steps,
                lr=lr64, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
            )  # fmt: skip
            if with_models:
                _write_models(models, rows, pb)
            continue
        flat, buf = _scratch_views("update", pb)
        if wd != 0.0:
            _scaled_into(flat, buf, pb, -wd)
        else:
            flat.zero_()
        torch._fused_adam_(
            buf, gb, mb, vb, [], steps,
            lr=1.0, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        ratios = [
            lr * math.sqrt(pp / uu) if pp != 0 and uu != 0 else lr
            for pp, uu in zip(_sumsq32(pb), _sumsq32(buf, tiled=flat if buf[0].dtype is torch.float32 else None))
        ]
        _add_scaled(pb, buf, flat, ratios)
        if with_models:
            _write_models(models, rows, pb)
    bump_versions(exp_avgs, exp_avg_sqs, [] if trust else p)  # once (``add_`` bumps ``p`` itself)
