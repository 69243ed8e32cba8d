"""Torch twin of the Adam/AdamW kernel (``fp16kit/kernels/triton/adam.py``): the same contract and math.

The float64 reference is ``fp16kit/numerics/reference/optim.py``; the 8-bit moments' twin is
``fp16kit/kernels/state8/fallback.py``, the bf16 weight modes' ``fp16kit/kernels/bf16_weights/``. The skip, the
commit and the fast CPU path are :mod:`fp16kit.kernels.fallback.step`'s; with a step counter, CPU rows of
contiguous fp32/fp64 tensors run in torch's fused CPU Adam kernel (:func:`_adam_fused`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat

import torch

from .scratch import _batches, _grads_for, _reads_grads_as_they_are, _write_models
from .step import (
    FusedAdamArgs,
    Rows,
    _finish,
    _fused_takes,
    _math,
    _remembered,
    _second_moment,
    _skip,
    _write_params,
    bump_versions,
)

__all__ = ["adam_", "adam_terms"]


def adam_(
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
    host_branch: bool | None = None,
    fused: FusedAdamArgs | None = None,
) -> None:
    """One Adam/AdamW step (see ``triton/adam.py`` for the math); ``models[i]`` may be None. ``fused``
    enables the fast CPU path (module docstring)."""
    if not params:
        return
    skip = _skip(found_inf, host_branch)
    if skip is True:
        return
    if skip is False:
        _adam_host((params, grads, exp_avgs, exp_avg_sqs, models), hp, l2_mode=l2_mode, decoupled=decoupled,
                   fused=fused)
        return
    p, m, v, step = adam_terms(_math(params, hp.dtype), grads, exp_avgs, exp_avg_sqs, hp.unbind(), l2_mode,
                               decoupled, in_place=False)
    _finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, step, skip)


def adam_terms(
    p: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: Sequence[torch.Tensor],
    l2_mode: bool,
    decoupled: bool,
    *,
    in_place: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Adam's terms in the kernels' rounding sequence (``triton/adam.py``), the one copy the masked step of
    :func:`adam_` and the 8-bit CPU chunks (``state8/fallback.py``) share: ``(p', m, v, step)`` with the new
    step ``p' - step`` (``p'``: ``p`` decayed when ``decoupled``, else ``p`` itself). ``p``: the params in the math
    dtype (only read); ``scalars``: ``hp.unbind()`` (0-dim tensors); ``in_place``: m and v are updated in place
    (then the state tensors, or temporaries, themselves), else new tensors."""
    _, _, beta2, one_minus_beta1, one_minus_beta2, eps, wd, neg_step_size, bc2_sqrt, inv_scale, decay = scalars
    g = torch._foreach_mul(_math(grads, p[0].dtype), inv_scale)
    if l2_mode:
        torch._foreach_add_(g, torch._foreach_mul(p, wd))
    # m + (1 - beta1) * (g - m): torch.optim.Adam's lerp (for 1 - beta1 < 0.5, i.e. every usual beta1)
    diff = torch._foreach_sub(g, list(exp_avgs))
    torch._foreach_mul_(diff, one_minus_beta1)
    if in_place:
        m = list(exp_avgs)
        torch._foreach_add_(m, diff)
    else:
        m = torch._foreach_add(list(exp_avgs), diff)
    v = _second_moment(exp_avg_sqs, g, beta2, one_minus_beta2, in_place=in_place)
    if decoupled:
        p = torch._foreach_mul(p, decay)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    step = torch._foreach_div(m, denom)
    # p + (-lr/bc1) * step, written as p - (lr/bc1) * step: the same rounding (negation is exact)
    torch._foreach_mul_(step, -neg_step_size)
    return p, m, v, step


def _adam_host(
    rows: Rows, hp: torch.Tensor, *, l2_mode: bool, decoupled: bool, fused: FusedAdamArgs | None = None
) -> None:
    """Adam when the skip was decided on the host (CPU): ``torch.optim.Adam``'s own foreach sequence, in place,
    with the hyper-parameters as host numbers (reading a CPU tensor costs no sync): 8 passes, 1 temporary;
    with ``fused`` and where it applies, torch's fused Adam kernel: one pass (module docstring). ``rows``:
    :data:`fp16kit.kernels.fallback.step.Rows`."""
    params, grads, exp_avgs, exp_avg_sqs, models = rows
    _, _, beta2, one_minus_beta1, one_minus_beta2, eps, wd, neg_step_size, bc2_sqrt, inv_scale, decay = hp.tolist()
    p = _math(params, hp.dtype)
    if fused is not None and _fused_takes(fused, p, exp_avgs, exp_avg_sqs, lamb=False):
        _adam_fused((p, grads, exp_avgs, exp_avg_sqs, models), fused, inv_scale, l2_mode=l2_mode, decoupled=decoupled)
        _write_params(params, [None] * len(p), p, False)  # models: written batch by batch
        return
    g = _math(grads, hp.dtype)
    if inv_scale != 1.0:
        g = torch._foreach_mul(g, inv_scale)
    if l2_mode:
        g = torch._foreach_add(g, p, alpha=wd)
    torch._foreach_lerp_(list(exp_avgs), g, one_minus_beta1)
    torch._foreach_mul_(list(exp_avg_sqs), beta2)
    torch._foreach_addcmul_(list(exp_avg_sqs), g, g, one_minus_beta2)
    if decoupled:
        torch._foreach_mul_(p, decay)
    denom = torch._foreach_sqrt(list(exp_avg_sqs))
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p, list(exp_avgs), denom, neg_step_size)
    _write_params(params, models, p, False)


def _adam_fused(rows: Rows, fused: FusedAdamArgs, inv_scale: float, *, l2_mode: bool, decoupled: bool) -> None:
    """Adam/AdamW in torch's fused CPU kernel (``p`` contiguous, in place), batch by batch: a batch's scaled
    grads (when they need a copy) and its model copies are written while its data is in cache. With neither
    (the kernel reads the caller's grads, no model copies) one call takes the whole list: batches would only
    add per-call host work (74 calls instead of 1 on a BERT-base-shaped list)."""
    p, grads, exp_avgs, exp_avg_sqs, models = rows  # p: the params in the math dtype, contiguous
    lr, beta1, beta2, _, _, eps, wd = fused.hp64.tolist()[:7]
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    whole = (
        inv_scale == 1.0
        and _remembered(fused.memo, "grads_as_they_are", lambda: _reads_grads_as_they_are(p, grads))
        and all(map(operator.is_, models, repeat(None)))
    )
    decay = wd if (decoupled or l2_mode) else 0.0

    def run(pb: list, gb: list, mb: list, vb: list) -> None:
        kernel(
            pb, gb, mb, vb, [], [fused.step] * len(pb),
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=decay, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        bump_versions(pb, mb, vb)

    if whole:  # the caller's lists as they are (the layout verdict is the plan group's: no per-tensor pass)
        run(p, list(grads), list(exp_avgs), list(exp_avg_sqs))
        return
    for rows in _batches(p):
        pb, mb, vb = [p[i] for i in rows], [exp_avgs[i] for i in rows], [exp_avg_sqs[i] for i in rows]
        run(pb, _grads_for(pb, [grads[i] for i in rows], inv_scale, 1.0), mb, vb)
        _write_models(models, rows, pb)
