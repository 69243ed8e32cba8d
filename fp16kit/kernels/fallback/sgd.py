"""Torch twin of the SGD kernel (``fp16kit/kernels/triton/sgd.py``): the same contract and math.

The float64 reference is ``fp16kit/numerics/reference/optim_apex.py``; the step around the rule is
``fp16kit/kernels/fallback/apex_step.py``'s.

Per element, in the kernel's order (``g`` the unscaled grad, ``m`` the momentum buffer)::

    if weight_decay and not wd_after_momentum:  g = g + wd * p
    m = g on the first step, else momentum * m + (1 - dampening) * g
    g = g + momentum * m if nesterov else m
    if weight_decay and wd_after_momentum:      g = g + wd * p
    p = p + (-lr) * g
"""

from __future__ import annotations

import torch

from .apex_step import ApexRows, Scalar, _axpy, _axpy_, _run

__all__ = ["sgd_"]


def sgd_(
    rows: ApexRows,
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    weight_decay: bool,
    wd_after_momentum: bool,
    nesterov: bool,
    first_run: bool,
    host_branch: bool | None = None,
    verify: bool = False,
) -> None:
    """One SGD step (see ``triton/sgd.py`` for the math) over ``rows`` (:data:`ApexRows`, the state: the momentum
    buffers, or none for SGD without momentum). ``verify``: the result check only (:func:`_run`)."""

    def rule(p: list[torch.Tensor], states: list[list[torch.Tensor]], d: list[torch.Tensor],
             s: list[Scalar]) -> list[torch.Tensor]:
        momentum, one_minus_dampening, wd = s
        if weight_decay and not wd_after_momentum:
            d = _axpy(d, p, wd)
        if states:
            (m,) = states
            if first_run:
                torch._foreach_copy_(m, d)
            else:
                torch._foreach_mul_(m, momentum)
                _axpy_(m, d, one_minus_dampening)
            d = _axpy(d, m, momentum) if nesterov else m
        if weight_decay and wd_after_momentum:
            d = _axpy(d, p, wd)
        return d

    _run(rows, hp, found_inf, host_branch, rule, verify)
