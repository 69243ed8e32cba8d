"""The column layout of ``exponent_histogram`` (``fp16kit/kernels/histogram.py``), shared by the public op, its
Triton kernel (``fp16kit/kernels/triton/histogram.py``) and its torch twin (``fp16kit/kernels/fallback/histogram.py``).

The float64 reference (``fp16kit/numerics/reference/histogram.py``) writes the same columns from their definition.
"""

from __future__ import annotations

import torch

from .table import upload as _upload

__all__ = ["INF_BIN", "MAX_EXP", "MIN_EXP", "NAN_BIN", "NUM_BINS", "ZERO_BIN", "upload"]

MIN_EXP = -149
MAX_EXP = 127
ZERO_BIN = MAX_EXP - MIN_EXP + 1
INF_BIN = ZERO_BIN + 1
NAN_BIN = ZERO_BIN + 2
NUM_BINS = ZERO_BIN + 3

_FORMATS = {  # integer view, exponent bits, mantissa bits, bias (for the kernel's bit decoding)
    torch.float16: (torch.int16, 5, 10, 15),
    torch.bfloat16: (torch.int16, 8, 7, 127),
    torch.float32: (torch.int32, 8, 23, 127),
}


def upload(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device`` without a host sync (``_table.upload``: pinned, non-blocking).
    ``fp16kit.doctor`` histograms freshly allocated gradients, whose tables cannot always come from a cache."""
    return _upload(values, device)[0]
