"""Torch twin of the Adagrad kernel (``fp16kit/kernels/triton/adagrad.py``): the same contract and math.

The float64 reference is ``fp16kit/numerics/reference/optim_apex.py``; the step around the rule is
``fp16kit/kernels/fallback/apex_step.py``'s.

Per element, in the kernel's order (``g`` the unscaled grad, ``h`` the sum of squares)::

    if l2_mode:    g = g + wd * p
    h = h + g * g
    u = g / (sqrt(h) + eps)
    if decoupled:  u = u + wd * p
    p = p + (-lr) * u
"""

from __future__ import annotations

import torch

from .apex_step import ApexRows, Scalar, _axpy, _axpy_, _run

__all__ = ["adagrad_"]


def adagrad_(
    rows: ApexRows,
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    host_branch: bool | None = None,
    verify: bool = False,
) -> None:
    """One Adagrad step (see ``triton/adagrad.py`` for the math) over ``rows`` (:data:`ApexRows`, the state: the
    sums of squares); ``verify``: the result check only."""

    def rule(p: list[torch.Tensor], states: list[list[torch.Tensor]], d: list[torch.Tensor],
             s: list[Scalar]) -> list[torch.Tensor]:
        eps, wd = s
        (h,) = states
        if l2_mode:
            d = _axpy(d, p, wd)
        torch._foreach_addcmul_(h, d, d)
        denom = torch._foreach_sqrt(h)
        torch._foreach_add_(denom, eps)
        u = torch._foreach_div(d, denom)
        if decoupled:
            _axpy_(u, p, wd)
        return u

    _run(rows, hp, found_inf, host_branch, rule, verify)
