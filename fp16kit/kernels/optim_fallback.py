"""Torch fallbacks of the LAMB and Adam kernels (``torch._foreach_*``), same contracts and same math.

Used where Triton cannot run (CPU tensors without the interpreter, platforms without Triton) and for
tensors the kernels do not take (non-contiguous, float64). ``hp`` is the hyper-parameter tensor
described in ``lamb_kernel.py`` / ``adam_kernel.py``; its dtype is the math dtype (float32, or float64
for float64 params).

The ``found_inf`` skip never syncs a GPU with the host. On CPU tensors the flag is read directly (a CPU
tensor has no queue to drain): a set flag returns at once, a clear one runs the fast host path (in place,
hyper-parameters as host numbers; Adam is ``torch.optim.Adam``'s own foreach sequence). Elsewhere every new
value is computed out of place and committed with ``torch.where(found_inf != 0, old, new)``, which keeps
old values bit for bit even when the new ones are NaN. ``host_branch`` overrides the choice, per call or
for a block (:func:`masked_commits`): tests exercise the masked path on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["adam_", "lamb_", "masked_commits"]

_forced_host_branch: list[bool] = []


@contextlib.contextmanager
def masked_commits() -> Iterator[None]:
    """Within the block, every call takes the masked (off-CPU) path, on CPU tensors too (for tests)."""
    _forced_host_branch.append(False)
    try:
        yield
    finally:
        _forced_host_branch.pop()


def _skip(found_inf: torch.Tensor, host_branch: bool | None) -> bool | torch.Tensor:
    """``True``/``False`` decided on the host, or a 0-dim bool tensor for masked commits."""
    if host_branch is None and _forced_host_branch:
        host_branch = _forced_host_branch[-1]
    if host_branch is None:
        host_branch = found_inf.device.type == "cpu"
    flag = found_inf.reshape(()) != 0
    return bool(flag) if host_branch else flag


def _commit(dsts: Sequence[torch.Tensor], news: Sequence[torch.Tensor], skip: bool | torch.Tensor) -> None:
    """``dst.copy_(new)`` (rounding to dst's dtype), or keep ``dst`` where ``skip`` is a set device flag."""
    for dst, new in zip(dsts, news):
        if isinstance(skip, torch.Tensor):
            new = torch.where(skip, dst.to(new.dtype), new)
        dst.copy_(new)


def _write_params(
    params: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    new_params: Sequence[torch.Tensor],
    skip: bool | torch.Tensor,
) -> None:
    """Params (unless ``new_params[i]`` already is ``params[i]``, updated in place) and model copies."""
    moved = [(d, n) for d, n in zip(params, new_params) if d is not n]
    _commit([d for d, _ in moved], [n for _, n in moved], skip)
    pairs = [(m, p) for m, p in zip(models, new_params) if m is not None]
    _commit([m for m, _ in pairs], [p for _, p in pairs], skip)


def _second_moment(
    exp_avg_sqs: Sequence[torch.Tensor],
    g: list[torch.Tensor],
    beta2: torch.Tensor,
    one_minus_beta2: torch.Tensor,
) -> list[torch.Tensor]:
    """``v * beta2 + (1 - beta2) * g * g``, out of place."""
    v = torch._foreach_mul(list(exp_avg_sqs), beta2)
    gg = torch._foreach_mul(g, one_minus_beta2)
    torch._foreach_mul_(gg, g)
    torch._foreach_add_(v, gg)
    return v


def _math(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.to(dtype) for t in tensors]


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
) -> None:
    """Both LAMB stages (see ``lamb_kernel.py`` for the math); ``models[i]`` may be None."""
    if not params:
        return
    skip = _skip(found_inf, host_branch)
    if skip is True:
        return
    if skip is False:
        modes = {"l2_mode": l2_mode, "decoupled": decoupled, "trust": trust}
        _lamb_host(params, grads, exp_avgs, exp_avg_sqs, models, hp, **modes)
        return
    lr, beta1, beta2, beta3, one_minus_beta2, eps, wd, bc1, bc2, inv_scale, clip = hp.unbind()
    p = _math(params, hp.dtype)  # may alias the params: only out-of-place ops on it
    g = torch._foreach_mul(_math(grads, hp.dtype), inv_scale)
    torch._foreach_div_(g, clip)
    if l2_mode:
        torch._foreach_add_(g, torch._foreach_mul(p, wd))
    m = torch._foreach_mul(list(exp_avgs), beta1)
    torch._foreach_add_(m, torch._foreach_mul(g, beta3))
    v = _second_moment(exp_avg_sqs, g, beta2, one_minus_beta2)
    u = torch._foreach_div(m, bc1)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    if decoupled:
        torch._foreach_add_(u, torch._foreach_mul(p, wd))
    torch._foreach_mul_(u, _trust_ratios(p, u, lr, trust))
    _finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, u, skip)


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
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    trust: bool,
) -> None:
    """LAMB when the skip was decided on the host (CPU): in place, host-number hyper-parameters (reading a
    CPU tensor costs no sync), no copy of the grads when there is nothing to unscale or clip: ~13 passes and
    two temporaries instead of ~22 passes and seven."""
    lr, beta1, beta2, beta3, one_minus_beta2, eps, wd, bc1, bc2, inv_scale, clip = hp.tolist()
    p = _math(params, hp.dtype)
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
    u = torch._foreach_div(m, bc1)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    if decoupled:
        torch._foreach_add_(u, p, alpha=wd)
    torch._foreach_mul_(u, _trust_ratios(p, u, lr, trust))
    torch._foreach_sub_(p, u)
    _write_params(params, models, p, False)


def _finish(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    p: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    delta: list[torch.Tensor],
    skip: torch.Tensor,
) -> None:
    """Masked commit of ``p - delta`` (params, model copies) and of the new moments."""
    new_p = torch._foreach_sub(p, delta)
    _commit(exp_avgs, m, skip)
    _commit(exp_avg_sqs, v, skip)
    _write_params(params, models, new_p, skip)


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
) -> None:
    """One Adam/AdamW step (see ``adam_kernel.py`` for the math); ``models[i]`` may be None."""
    if not params:
        return
    skip = _skip(found_inf, host_branch)
    if skip is True:
        return
    if skip is False:
        _adam_host(params, grads, exp_avgs, exp_avg_sqs, models, hp, l2_mode=l2_mode, decoupled=decoupled)
        return
    _, _, beta2, one_minus_beta1, one_minus_beta2, eps, wd, neg_step_size, bc2_sqrt, inv_scale, decay = hp.unbind()
    p = _math(params, hp.dtype)
    g = torch._foreach_mul(_math(grads, hp.dtype), inv_scale)
    if l2_mode:
        torch._foreach_add_(g, torch._foreach_mul(p, wd))
    # m + (1 - beta1) * (g - m): torch.optim.Adam's lerp (for 1 - beta1 < 0.5, i.e. every usual beta1)
    diff = torch._foreach_sub(g, list(exp_avgs))
    torch._foreach_mul_(diff, one_minus_beta1)
    m = torch._foreach_add(list(exp_avgs), diff)
    v = _second_moment(exp_avg_sqs, g, beta2, one_minus_beta2)
    if decoupled:
        p = torch._foreach_mul(p, decay)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    step = torch._foreach_div(m, denom)
    # p + (-lr/bc1) * step, written as p - (lr/bc1) * step: the same rounding (negation is exact)
    torch._foreach_mul_(step, -neg_step_size)
    _finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, step, skip)


def _adam_host(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
) -> None:
    """Adam when the skip was decided on the host (CPU): ``torch.optim.Adam``'s own foreach sequence, in place,
    with the hyper-parameters as host numbers (reading a CPU tensor costs no sync): 8 passes, 1 temporary."""
    _, _, beta2, one_minus_beta1, one_minus_beta2, eps, wd, neg_step_size, bc2_sqrt, inv_scale, decay = hp.tolist()
    p = _math(params, hp.dtype)
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
