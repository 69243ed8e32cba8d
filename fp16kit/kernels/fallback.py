"""Torch implementations of the multi-tensor kernels, for where Triton cannot run.

Same contracts as the Triton kernels (see ``fp16kit.kernels``), built from ``torch._foreach_*`` ops so
that a list still costs a handful of launches, and with no host sync: flags and norms stay tensors.
They also serve tensors the Triton kernels do not take (non-contiguous, float64), so they accept any
strided layout; float64 tensors are computed in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_", "flag_nonfinite_", "scaled", "sumsq_per_tensor", "unscale"]


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def flag_nonfinite_(tensors: Sequence[torch.Tensor], found_inf: torch.Tensor) -> None:
    """Raise ``found_inf`` to 1 if any element of ``tensors`` is inf/NaN (no host sync).

    Uses torch's fused check (``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1), which
    writes every value back unchanged: call it only on tensors the caller has just written or owns.
    (``_foreach_norm(ord=inf)`` would not write, but is ~25x slower on CPU.)
    """
    if tensors:
        one = torch.ones(1, dtype=torch.float32, device=found_inf.device)
        torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found_inf, one)


def _may_overflow(inv_scale: torch.Tensor) -> bool:
    """Can multiplying a finite value by ``inv_scale`` give inf/NaN? Only if ``|inv_scale| > 1`` or it is
    non-finite. On the CPU the value is read for free; on a GPU reading it would sync, so assume yes."""
    if inv_scale.device.type != "cpu":
        return True
    value = float(inv_scale)
    return not (abs(value) <= 1.0)


def scaled(tensors: Sequence[torch.Tensor], scale: torch.Tensor) -> list[torch.Tensor]:
    """``math(x) * scale`` for each tensor (fp32 math, fp64 for fp64 tensors), as new tensors."""
    math = _math_dtype(tensors[0].dtype)
    return torch._foreach_mul([x.to(math) for x in tensors], scale.to(math).reshape(()))


def unscale(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    sq_norm: torch.Tensor | None,
) -> None:
    """``outputs[i] = round(math(inputs[i]) * inv_scale)``; flag and sum of squares as the kernel does.

    One dtype pair per call. Fewest passes that keep the contract's single fp32 multiply:
    in place, ``_foreach_mul_`` computes in fp32 (opmath) and rounds once; into a destination at
    least as wide as fp32, an exact widening copy then an in-place multiply; otherwise (narrowing,
    or when the unrounded squares are needed) the fp32 products are formed, then copied out.
    """
    if not inputs:
        return
    same = [i.data_ptr() == o.data_ptr() for i, o in zip(inputs, outputs)]  # a call may mix both kinds of pairs
    in_place = all(same)
    widening = outputs[0].dtype in (torch.float32, torch.float64) and outputs[0].dtype == _math_dtype(inputs[0].dtype)
    if sq_norm is None and (in_place or widening):
        # torch's fused op: one pass that multiplies in fp32 opmath (one rounding) and checks the inputs.
        if not in_place:  # exact widening of every pair that is not in place
            moved = [k for k, s in enumerate(same) if not s]
            torch._foreach_copy_([outputs[k] for k in moved], [inputs[k] for k in moved])
        torch._amp_foreach_non_finite_check_and_unscale_(list(outputs), found_inf, inv_scale)
        if _may_overflow(inv_scale):  # a finite input can still overflow after the multiply
            flag_nonfinite_(outputs, found_inf)
        return
    ys = scaled(inputs, inv_scale)
    torch._foreach_copy_(list(outputs), ys)
    if sq_norm is not None:
        sq_norm.add_(sumsq_per_tensor(ys).sum().float().reshape(sq_norm.shape))
    flag_nonfinite_(outputs, found_inf)


def sumsq_per_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """fp32 (fp64 for fp64 input) sum of squares of each tensor, accumulated in fp32 or wider."""
    if not tensors:
        return torch.zeros(0)
    math = _math_dtype(tensors[0].dtype)
    norms = torch._foreach_norm(list(tensors), 2, dtype=math)
    return torch.stack(norms).square()


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for the whole list."""
    if dst:
        torch._foreach_copy_(list(dst), list(src))
