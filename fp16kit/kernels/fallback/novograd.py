"""Torch twin of the NovoGrad kernel (``fp16kit/kernels/triton/novograd.py``): the same contract and math.

The float64 reference is ``fp16kit/numerics/reference/optim_apex.py``; the step around the rule is
``fp16kit/kernels/fallback/apex_step.py``'s. ``per_tensor_norms`` is the twin of its norms' and max norms'
kernels.

Per element, in the kernel's order (``g`` the unscaled grad, ``d`` its tensor's ``v / bc2 + eps``)::

    if reg_inside_moment:  g = g / d + wd * p
    m = beta1 * m + beta3 * g
    u = m / bc1
    if not reg_inside_moment:  u = u / d + wd * p
    p = p + (-lr) * u
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .apex_step import ApexRows, Scalar, _axpy_, _run

__all__ = ["novograd_", "per_tensor_norms"]


def novograd_(
    rows: ApexRows,
    hp: torch.Tensor,
    denoms: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    reg_inside_moment: bool,
    host_branch: bool | None = None,
    verify: bool = False,
) -> None:
    """The elementwise NovoGrad step (see ``triton/novograd.py``) over ``rows`` (:data:`ApexRows`, the state: the
    first moments); ``denoms`` is the per-tensor ``v / bc2 + eps`` vector (math dtype), in the order of the params;
    ``verify``: the result check only."""

    def rule(p: list[torch.Tensor], states: list[list[torch.Tensor]], d: list[torch.Tensor],
             s: list[Scalar]) -> list[torch.Tensor]:
        beta1, beta3, wd, bc1 = s
        (m,) = states
        den = denoms.tolist() if isinstance(beta1, float) else list(denoms.unbind())  # as _scalars reads hp
        if reg_inside_moment:
            d = torch._foreach_div(d, den)
            _axpy_(d, p, wd)
        torch._foreach_mul_(m, beta1)
        _axpy_(m, d, beta3)
        u = torch._foreach_div(m, bc1)
        if not reg_inside_moment:
            torch._foreach_div_(u, den)
            _axpy_(u, p, wd)
        return u

    _run(rows, hp, found_inf, host_branch, rule, verify)


def per_tensor_norms(
    tensors: Sequence[torch.Tensor], norm_type: int, pre_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Each tensor's L2 (``norm_type=2``) or inf-norm (``0``) of ``x * pre_scale``, as a ``dtype`` [N] vector.

    The norm is taken of the unscaled values and multiplied by ``pre_scale`` afterwards: equal to the norm
    of ``x * pre_scale`` for the inf-norm (rounding is monotonic) and within one rounding for the L2 norm.
    Norms of fp16/bf16/fp32 tensors are rounded once to fp32, as the kernels' (``l2norm``) are: a norm beyond
    fp32's range is inf on both backends (and NovoGrad's result check skips that step).
    """
    if norm_type == 2:
        norms = torch._foreach_norm(list(tensors), 2, dtype=dtype)
    else:
        norms = [n.to(dtype) for n in torch._foreach_norm(list(tensors), float("inf"))]
    out = torch.stack(norms) * pre_scale.reshape(()).to(dtype)
    return out if tensors[0].dtype == torch.float64 else out.float().to(dtype)
