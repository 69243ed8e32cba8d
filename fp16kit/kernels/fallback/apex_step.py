"""The step the torch twins of the SGD, Adagrad and NovoGrad kernels share (``fallback/sgd.py``,
``fallback/adagrad.py``, ``fallback/novograd.py``), as the kernels share ``fp16kit/kernels/engine/results.py``.

The ``found_inf`` skip follows ``fallback/step.py``: on CPU the flag is read on the host (no queue to drain)
and a clear flag runs the math *in place* on the params and state (no copies when they already have the math
dtype); elsewhere the math runs on copies and is committed with ``torch.where(found_inf != 0, old, new)``,
which keeps old values bit for bit even when the new ones are NaN. Each optimizer's math is written once
(``rule`` inside ``sgd_``, ...) and runs on either kind of working list; with host numbers the
multiply-adds are torch's fused ``alpha=`` forms (``torch.optim.SGD``'s own sequence), with device scalars a
multiply and an add.

What the three share, as the kernels share ``engine/skeleton.py``, is :func:`_run`: the skip, the working lists,
the grads widened and unscaled (:func:`_scaled`, ``hp = [lr, ..., inv_scale]`` in all three), the param step
``p += (-lr) * u`` after the rule, then the result check or the commit of params, model copies and state. A
``rule`` holds only what is its own: from ``p``, its state lists, the unscaled grads and its hyper-parameters
between ``lr`` and ``inv_scale``, it updates the state in place and returns the direction ``u``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..engine.rows import ApexRows
from .step import _commit, _math, _skip, _write_params

__all__ = ["ApexRows", "Rule", "Scalar", "raise_if_nonfinite"]

Scalar = float | torch.Tensor


def _scalars(hp: torch.Tensor, skip: bool | torch.Tensor) -> list[Scalar]:
    """Host numbers on the host path (reading a CPU tensor costs no sync), 0-dim device tensors otherwise."""
    return hp.tolist() if skip is False else list(hp.unbind())

#: An optimizer's own math (see the module docstring): ``rule(p, states, d, hparams) -> u``, where ``d`` (read
#: only: it may be the grads themselves) is the unscaled grads and ``hparams`` the scalars between ``lr`` and
#: ``inv_scale``; it may update ``states`` in place, never ``p``.
Rule = Callable[[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor], list[Scalar]], list[torch.Tensor]]


def _run(
    rows: ApexRows,
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    host_branch: bool | None,
    rule: Rule,
    verify: bool = False,
) -> None:
    """One step around ``rule`` (:data:`Rule`) over ``rows`` (:data:`ApexRows`), on working lists, committed (see
    the module docstring); with ``verify``, on copies, committing nothing and raising ``found_inf`` instead when a
    value the step would store is inf/NaN (:func:`raise_if_nonfinite`)."""
    params, grads, states, models = rows
    if not params:
        return
    skip = _skip(found_inf, host_branch)
    if skip is True:
        return
    if skip is False and not verify:
        p = _math(params, hp.dtype)  # aliases the params when they already have the math dtype
        _step(p, grads, [list(s) for s in states], hp, skip, rule)
        _write_params(params, models, p, False)
        return
    p = [t.to(hp.dtype, copy=True) for t in params]
    work = [[t.clone() for t in s] for s in states]
    _step(p, grads, work, hp, skip, rule)
    if verify:
        stored = [(new, dst.dtype) for dst, new in zip(params, p)]
        stored += [(new, m.dtype) for m, new in zip(models, p) if m is not None]
        stored += [(new, dst.dtype) for dsts, news in zip(states, work) for dst, new in zip(dsts, news)]
        raise_if_nonfinite(stored, hp[0], found_inf)
        return
    for dst, new in zip(states, work):
        _commit(dst, new, skip)
    _write_params(params, models, p, skip)


def _step(
    p: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: list[list[torch.Tensor]],
    hp: torch.Tensor,
    skip: bool | torch.Tensor,
    rule: Rule,
) -> None:
    """``p += (-lr) * rule(p, states, grads * inv_scale, hp[1:-1])`` in place on the working lists."""
    lr, *hparams, inv_scale = _scalars(hp, skip)
    u = rule(p, states, _scaled(grads, hp.dtype, inv_scale), hparams)
    _axpy_(p, u, _neg(lr))


def raise_if_nonfinite(
    stored: Sequence[tuple[torch.Tensor, torch.dtype]], lr: torch.Tensor, found_inf: torch.Tensor
) -> None:
    """The result check of the torch fallback (the kernels' ``VERIFY`` pass, ``engine/results.py``): raise
    ``found_inf`` in place, on the device, when some ``value`` rounded to its stored ``dtype`` is inf/NaN and
    ``lr`` is a valid learning rate (finite, >= 0: a bad tensor lr is the optimizer's own skip)."""
    tensors = [v if v.dtype == d else v.to(d) for v, d in stored if v.numel()]
    if not tensors:
        return
    largest = torch.stack([t.abs().amax().float() for t in tensors])  # NaN propagates through amax
    bad = ~(largest < float("inf")).all() & (lr >= 0) & (lr < float("inf"))
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype)))


def _neg(x: Scalar) -> Scalar:
    return -x


def _scaled(grads: Sequence[torch.Tensor], dtype: torch.dtype, inv_scale: Scalar) -> list[torch.Tensor]:
    """The grads in the math dtype times ``inv_scale``; without a scale on the host path, the grads themselves
    (so callers only ever read the result, never write it in place)."""
    g = _math(grads, dtype)
    if not isinstance(inv_scale, torch.Tensor) and inv_scale == 1.0:
        return g
    return torch._foreach_mul(g, inv_scale)


def _axpy(x: list[torch.Tensor], y: list[torch.Tensor], a: Scalar) -> list[torch.Tensor]:
    """``x + a * y`` as new tensors: one fused pass for a host number, two for a device scalar."""
    if isinstance(a, torch.Tensor):
        return torch._foreach_add(x, torch._foreach_mul(y, a))
    return torch._foreach_add(x, y, alpha=a)


def _axpy_(x: list[torch.Tensor], y: list[torch.Tensor], a: Scalar) -> None:
    """``x += a * y`` in place (see :func:`_axpy`)."""
    if isinstance(a, torch.Tensor):
        torch._foreach_add_(x, torch._foreach_mul(y, a))
    else:
        torch._foreach_add_(x, y, alpha=a)
