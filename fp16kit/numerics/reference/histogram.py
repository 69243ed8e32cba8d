"""float64 reference of :func:`fp16kit.kernels.exponent_histogram`: numpy's ``frexp``, element by element.

For a finite nonzero ``x``, ``frexp`` gives ``x = m * 2^k`` with ``0.5 <= |m| < 1`` exactly, so
``floor(log2|x|) = k - 1`` with no rounding (a floating ``log2`` can round up near the top of a binade).
Widening fp16, bf16 and fp32 to float64 is exact, subnormals included.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["HISTOGRAM_MAX_EXP", "HISTOGRAM_MIN_EXP", "exponent_histogram"]

HISTOGRAM_MIN_EXP = -149  # fp32's smallest subnormal, 2^-149
HISTOGRAM_MAX_EXP = 127  # fp32's largest binade


def exponent_histogram(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """int64 ``[len(tensors), 280]``: columns ``e + 149`` for ``floor(log2|x|) = e`` (-149..127), then the
    counts of zeros (277), infs (278) and NaNs (279), as :func:`fp16kit.kernels.exponent_histogram`."""
    span = HISTOGRAM_MAX_EXP - HISTOGRAM_MIN_EXP + 1
    out = np.zeros((len(tensors), span + 3), dtype=np.int64)
    for row, t in enumerate(tensors):
        x = t.detach().cpu().to(torch.float64).reshape(-1).numpy()
        finite = np.isfinite(x)
        nonzero = finite & (x != 0)
        _, k = np.frexp(x[nonzero])
        e = k.astype(np.int64) - 1
        if e.size and (e.min() < HISTOGRAM_MIN_EXP or e.max() > HISTOGRAM_MAX_EXP):
            raise ValueError("exponent_histogram reference: a value lies outside fp32's exponent range")
        out[row, :span] = np.bincount(e - HISTOGRAM_MIN_EXP, minlength=span)
        out[row, span] = int(np.sum(x == 0))
        out[row, span + 1] = int(np.sum(np.isinf(x)))
        out[row, span + 2] = int(np.sum(np.isnan(x)))
    return out
