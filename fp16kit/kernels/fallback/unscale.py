"""Torch twin of the unscale kernel (``fp16kit/kernels/triton/unscale.py``): ``unscale_and_check``'s contract.

Built from ``torch._foreach_*`` ops so that a list still costs a handful of launches, and with no host sync: flags
and norms stay tensors. The twins also serve tensors the Triton kernels do not take (non-contiguous, float64), so
they accept any strided layout; float64 tensors are computed in float64 (scale included: it is not rounded to
fp32). The float64 reference is ``fp16kit/numerics/reference/kernels.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.checks import same_view
from .copy import _narrowable
from .l2norm import sumsq_per_tensor

__all__ = ["flag_nonfinite_", "fused_unscale_", "fused_unscale_mode", "in_place_pairs", "scaled", "unscale"]


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
    with_norm: bool,
    *,
    in_place: list[bool] | None = None,
) -> torch.Tensor | None:
    """``outputs[i] = round(math(inputs[i]) * inv_scale)``; flag as the kernel does; with ``with_norm`` returns
    the float64 sum of the squares of the unrounded products (a 1-element tensor).

    One dtype pair per call. Whether a pair is in place is decided per pair (``outputs[i]`` the same view as
    ``inputs[i]``): a list may mix both, e.g. when the amp frontend unscales a parameter's grad into its own
    master for some params and in place for others. ``in_place``: that verdict, when the caller has it cached
    (:func:`in_place_pairs`).
    """
    if not inputs:
        return None
    if in_place is None:
        in_place = in_place_pairs(inputs, outputs)
    if all(in_place) or not any(in_place):
        return _unscale_group((inputs, outputs), in_place[0], inv_scale, found_inf, with_norm)
    sums = []
    for flag in (True, False):
        idx = [i for i, p in enumerate(in_place) if p is flag]
        pairs = ([inputs[i] for i in idx], [outputs[i] for i in idx])
        sums.append(_unscale_group(pairs, flag, inv_scale, found_inf, with_norm))
    return sums[0] + sums[1] if with_norm else None


def in_place_pairs(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> list[bool]:
    """Per pair: ``outputs[i]`` is the same view as ``inputs[i]`` (depends on addresses and layouts only)."""
    return [x is y or same_view(x, y) for x, y in zip(inputs, outputs)]


def _unscale_group(
    pairs: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    in_place: bool,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    with_norm: bool,
) -> torch.Tensor | None:
    """``pairs``: ``(inputs, outputs)``, all pairs in place, or none. Fewest passes that keep the contract's single
    multiply in the math dtype: for fp32 math, in place, ``_amp_foreach_non_finite_check_and_unscale_`` multiplies
    in fp32 (opmath) and rounds once; into an fp32 destination, an exact widening copy then that in-place
    multiply. Otherwise (narrowing, float64 math whose scale must not be rounded to fp32, or when the unrounded
    squares are needed) the products are formed in the math dtype, then copied out."""
    inputs, outputs = pairs
    mode = "" if with_norm else fused_unscale_mode(inputs, outputs, [in_place])
    if mode:
        fused_unscale_(inputs, outputs, mode == "widen", inv_scale.to(torch.float32), found_inf)
        return None
    ys = scaled(inputs, inv_scale)
    torch._foreach_copy_(list(outputs), _narrowable(ys, outputs[0].dtype))
    flag_nonfinite_(outputs, found_inf)
    return sumsq_per_tensor(ys).sum().reshape(1) if with_norm else None


def fused_unscale_mode(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], in_place: list[bool]) -> str:
    """Can these pairs (one dtype pair; ``in_place``: :func:`in_place_pairs`) run as torch's fused unscale
    (:func:`fused_unscale_`)? ``"in_place"`` (every pair the same view, one dtype, fp32 math), ``"widen"`` (no pair
    in place, fp32 math into fp32 destinations), else ``""``: a mixed list, a narrowing (a bf16 view of fp16 grads:
    the products must be formed before anything is written) or float64 math, whose scale must not be rounded to
    fp32. Depends on addresses, layouts and dtypes only, so a caller may remember it with its plan."""
    if _math_dtype(inputs[0].dtype) != torch.float32:
        return ""
    if all(in_place) and outputs[0].dtype == inputs[0].dtype:
        return "in_place"
    if not any(in_place) and outputs[0].dtype == torch.float32:
        return "widen"
    return ""


def fused_unscale_(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    widen: bool,
    scale32: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    """The pairs :func:`fused_unscale_mode` accepts: ``_amp_foreach_non_finite_check_and_unscale_`` multiplies in
    fp32 (opmath) and rounds once, after an exact widening copy when ``widen``; the flag also rises where a finite
    input overflows only after the multiply. ``scale32``: fp32, one element. Bumps no version (torch's op does
    not)."""
    if widen:
        torch._foreach_copy_(list(outputs), list(inputs))  # exact widening
    outputs = list(outputs)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(outputs, found_inf, scale32)
    except RuntimeError:
        # torch's op refuses a list holding a view with the negative bit, even an empty one (which holds nothing and
        # which the planner lets through: no element to write); other failures are not ours to hide
        kept = [t for t in outputs if t.numel()]
        if len(kept) == len(outputs):
            raise
        outputs = kept
        if outputs:
            torch._amp_foreach_non_finite_check_and_unscale_(outputs, found_inf, scale32)
    if _may_overflow(scale32) and outputs:  # a finite input can still overflow after the multiply
        flag_nonfinite_(outputs, found_inf)
