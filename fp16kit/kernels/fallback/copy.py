"""Torch twin of the cast-copy kernel (``fp16kit/kernels/triton/copy.py``): ``copy_``'s contract.

The float64 reference is ``fp16kit/numerics/reference/kernels.py`` (``copy``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_"]


def _round_to_odd_fp32(y: torch.Tensor) -> torch.Tensor:
    """float64 -> fp32 rounded *to odd*: truncate, then set the last bit if anything was cut off.

    Rounding to odd at fp32 (24 bits) and then to nearest even at fp16/bf16 (11/8 bits, 2+ bits fewer) equals one
    round-to-nearest-even from float64, which torch's own float64 -> fp16/bf16 conversion is not: it rounds to
    nearest at fp32 first, so ``1 + 2^-11 + 2^-40`` becomes the tie ``1 + 2^-11`` and then 1.0 instead of
    ``1 + 2^-10``. inf and NaN pass through; values beyond fp32's range become its largest finite value (odd),
    which still rounds to inf in the narrow format.
    """
    t = y.float()
    t = torch.where(t.double().abs() > y.abs(), torch.nextafter(t, torch.zeros_like(t)), t)  # toward zero
    return torch.where(t.double() != y, (t.view(torch.int32) | 1).view(torch.float32), t)


def _narrowable(tensors: Sequence[torch.Tensor], dst_dtype: torch.dtype) -> list[torch.Tensor]:
    """``tensors`` ready for a ``copy_`` into ``dst_dtype`` with a single correct rounding (see above)."""
    if tensors and tensors[0].dtype == torch.float64 and dst_dtype in (torch.float16, torch.bfloat16):
        return [_round_to_odd_fp32(t) for t in tensors]
    return list(tensors)


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for the whole list, except that float64 -> fp16/bf16 rounds once, correctly."""
    if dst:
        torch._foreach_copy_(list(dst), _narrowable(src, dst[0].dtype))
