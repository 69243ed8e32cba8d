"""Torch twins of the sum-of-squares kernels (``fp16kit/kernels/triton/l2norm.py``): ``l2norm``'s per-tensor sums
and the optimizers' check-and-norm pass.

The float64 references are ``fp16kit/numerics/reference/kernels.py`` (``l2norm``) and
``fp16kit/numerics/reference/optim.py`` (``global_grad_norm``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from ..engine.table import group_by
from .scratch import _NUMEL, _sumsq32
from .step import F64

__all__ = ["check_and_norm", "check_and_norm_exact", "sumsq_per_tensor"]


def check_and_norm(grads: Sequence[torch.Tensor], inv_scale64: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
    """Torch fallback of the optimizers' check-and-norm pass (``fp16kit.optim.functional.check_and_norm``):
    ``inv_scale * sqrt(sum g^2)`` (0-dim fp32) and the flag ``any(|g| * inv_scale)`` non-finite, fp32 math
    (fp64 for fp64). Reading CPU tensors on the host here syncs nothing (the CPU has no queue).

    ``|g|max * inv_scale`` overflows exactly when some ``g * inv_scale`` does (rounding is monotonic), so the
    flag equals the kernel's; the norm differs from the norm of scaled values by at most one rounding.
    Empty grads are left out (``_foreach_norm`` has no inf-norm of an empty tensor; they add nothing).
    CPU grads of fp32 math take :func:`_cpu_check_and_norm` (one read of the grads, verdicts on the host).
    """
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=found_inf.device)
    sumsq, amax = [], []
    for rows in group_by([F64 if g.dtype == F64 else torch.float32 for g in grads]).values():
        chosen = [grads[i] for i in rows]
        if chosen[0].dtype != F64 and chosen[0].device.type == "cpu":
            sq, worst = _cpu_check_and_norm(chosen, float(inv_scale64.reshape(())))
            sumsq.append(torch.tensor(sq, dtype=F64))
            amax.append(torch.tensor(worst, dtype=F64))
            continue
        norms = torch.stack(torch._foreach_norm(chosen, 2, dtype=F64))
        largest = torch.stack(torch._foreach_norm(chosen, float("inf"))).to(F64)
        sumsq.append(norms.square().sum())
        amax.append(largest.max())
    inv = inv_scale64.reshape(())
    largest = torch.stack(amax).max().float() * inv.float()
    flag = found_inf.reshape(1)
    torch.maximum(flag, (~torch.isfinite(largest)).float().reshape(1), out=flag)
    return (torch.stack(sumsq).sum().sqrt() * inv).float()


#: Elements per piece of :func:`check_and_norm_exact` (its temporaries stay ~1.5 MB, in L2 on the CPU).
_EXACT_PIECE = 1 << 16


def check_and_norm_exact(
    grads: Sequence[torch.Tensor], inv_scale64: torch.Tensor, found_inf: torch.Tensor
) -> torch.Tensor:
    """The optimizers' check-and-norm pass in the kernels' arithmetic (``fp16kit/kernels/triton/l2norm.py``):
    ``y = math(g) * math(inv_scale)`` rounded once (fp32 math, fp64 for fp64 grads), ``norm = fp32(sqrt(sum
    float64(y)^2))``, ``found_inf`` raised when some ``y`` is inf/NaN (no host sync).

    The sums differ from the kernels' only in their float64 summation order (a relative ~1e-16), so the fp32 norm
    is the kernels' bit for bit unless the float64 sum lies within that distance of an fp32 rounding boundary.
    :func:`check_and_norm` sums fp32 squares instead (faster on the CPU, within ``gamma(n)`` of the reference);
    the 8-bit moments, whose bit-for-bit agreement with the kernels needs LAMB's clip divisor to agree, take this
    one. Pieces of ``_EXACT_PIECE`` elements bound the temporaries. Squares of fp32 values cannot overflow float64,
    so their sum is inf/NaN exactly when some fp32 ``y`` is: that is the flag for them; float64 ``y`` (whose
    squares can overflow for a finite ``y``) are checked themselves."""
    grads = [g for g in grads if g.numel()]
    device = found_inf.device
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    narrow_sum = torch.zeros((), dtype=F64, device=device)  # the squares of fp32 y
    wide_sum = torch.zeros((), dtype=F64, device=device)  # the squares of float64 y
    wide_bad = torch.zeros((), dtype=torch.bool, device=device)
    for g in grads:
        wide = g.dtype == F64
        scale = inv_scale64.reshape(()).to(F64 if wide else torch.float32)
        flat = g.reshape(-1)  # a copy only for a non-contiguous grad the caller gave
        for start in range(0, flat.numel(), _EXACT_PIECE):
            y = flat[start : start + _EXACT_PIECE].to(scale.dtype) * scale
            if wide:
                wide_bad |= ~torch.isfinite(y).all()
                wide_sum += torch.dot(y, y)
            else:
                y64 = y.to(F64)
                narrow_sum += torch.dot(y64, y64)
    flag = found_inf.reshape(1)
    torch.maximum(flag, (~torch.isfinite(narrow_sum) | wide_bad).float().reshape(1), out=flag)
    return (narrow_sum + wide_sum).sqrt().float()


# Below this magnitude the squares of an fp32 tensor's elements are subnormal or flush to zero, so its fp32
# sum of squares loses bits or vanishes; above fp32's range (a norm > ~1.8e19) the sum of squares is inf.
_TINY_FOR_FP32_SQUARES = 2.0**-60


def _cpu_check_and_norm(chosen: Sequence[torch.Tensor], inv: float) -> tuple[float, float]:
    """CPU grads, fp32 math: ``(sum of the per-tensor squared norms, a stand-in of max |g|)`` (float64 host
    numbers), from one read of the grads: the per-tensor fp32 2-norms (``torch._foreach_norm``, one call).

    The max-norm of a tensor is read (a second pass over that tensor only, see :func:`_max_norms`) where it
    may matter, and its norm recomputed with float64 accumulation where the fp32 sum of squares over- or
    underflowed (:func:`_repair_fp32_norms`). Every verdict is a host decision on a few host numbers (no
    small tensor ops: on a loaded machine each one that wakes the worker threads can stall for milliseconds).
    The returned max stand-in is ``max |g|`` itself where it was read, else a 2-norm with ``norm * inv <=
    2**127``: its fp32 product with ``inv`` overflows (or is NaN) exactly when some ``|g| * inv`` does.
    """
    norms = list(map(math.sqrt, _sumsq32(chosen)))
    largest = _max_norms(chosen, norms, inv)
    norms = _repair_fp32_norms(chosen, norms, largest)
    total = sum(largest)  # NaN exactly when some max stand-in is NaN (they are >= 0: no inf - inf)
    return math.fsum(map(operator.mul, norms, norms)), max(largest) if total == total else math.nan


def _max_norms(chosen: Sequence[torch.Tensor], norms: list[float], inv: float) -> list[float]:
    """CPU, fp32 math: per-tensor max-norms where the caller needs them, the 2-norms as stand-ins elsewhere,
    so the grads are read once instead of twice. The max-norm is read (a second pass over that tensor only)
    where the 2-norm is not finite, where ``norm * inv_scale > 2**127`` (the scaled max might overflow), or
    where ``norm <= 2 sqrt(n) * _TINY_FOR_FP32_SQUARES`` (the max might be below the tiny threshold). For the
    other tensors ``max <= norm`` (up to rounding, which the 2**127 margin absorbs) and ``max >= tiny``, so
    ``_repair_fp32_norms`` and the inf/NaN flag decide exactly as with the true max-norms. (First a test over
    the whole list, C-level: no tensor is to be read when the sum is finite, the largest norm is below the
    overflow bound and the smallest above the tiny bound of the largest tensor.)"""
    tiny = 2.0 * math.sqrt(max(map(_NUMEL, chosen), default=0)) * _TINY_FOR_FP32_SQUARES
    if norms and math.isfinite(sum(norms)) and max(norms) * inv <= 2.0**127 and min(norms) > tiny:
        return norms
    redo = [
        i
        for i, (n, t) in enumerate(zip(norms, chosen))
        if not math.isfinite(n) or n * inv > 2.0**127 or n <= 2.0 * math.sqrt(t.numel()) * _TINY_FOR_FP32_SQUARES
    ]
    if not redo:
        return norms
    largest = list(norms)
    exact = torch.stack(torch._foreach_norm([chosen[i] for i in redo], float("inf"))).tolist()
    for i, value in zip(redo, exact):
        largest[i] = value
    return largest


def _repair_fp32_norms(chosen: Sequence[torch.Tensor], norms: list[float], largest: list[float]) -> list[float]:
    """CPU only: the fp32 per-tensor norms, with the tensors whose fp32 sum of squares over- or underflowed (a
    finite, nonzero max-norm but an inf norm, or a max-norm below ``_TINY_FOR_FP32_SQUARES``) recomputed with
    float64 accumulation. On other devices the norms are float64 from the start (a memory-bound reduction
    there), so this never syncs a device."""
    if math.isfinite(sum(norms)) and min(largest, default=math.inf) >= _TINY_FOR_FP32_SQUARES:
        return norms  # (a C-level test first: nothing to redo)
    redo = [
        i
        for i, (n, big) in enumerate(zip(norms, largest))
        if math.isfinite(big) and big > 0 and (not math.isfinite(n) or big < _TINY_FOR_FP32_SQUARES)
    ]
    if not redo:
        return norms
    norms = list(norms)
    exact = torch.stack(torch._foreach_norm([chosen[i] for i in redo], 2, dtype=F64)).tolist()
    for i, value in zip(redo, exact):
        norms[i] = value
    return norms


def sumsq_per_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """float64 sum of squares of each tensor (the fp32 products' squares never overflow or underflow there).

    fp16/bf16/fp32 values square into float64's range (|y| <= 3.4e38 gives y^2 <= 1.2e77; the smallest fp32
    subnormal squares to 2e-90), so the sum is exact to float64 rounding for every finite input. float64 inputs
    can square out of range only when their norm is above 1.3e154 or all below 1.5e-154, and then the fp32
    norm the caller returns is inf or 0 anyway.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float64)).square()
