"""The four classes a gradient value falls in for a format, and the format's exponent limits.

``flush`` (below the smallest subnormal: rounds to zero), ``subnormal``, ``normal``, ``overflow`` (beyond the largest
finite value). Shared by the report (``fp16kit/doctor/_report.py``) and its renderers (``_table.py``, ``_plot.py``),
which import it instead of the report module.
"""

from __future__ import annotations

import math

import torch

from ..numerics.formats import format_of

__all__ = ["CLASSES", "format_limits"]

CLASSES = ("flush", "subnormal", "normal", "overflow")


def format_limits(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(sub, norm, top)``: exponents of the smallest subnormal, the smallest normal and the largest binade."""
    fmt = format_of(dtype)
    return int(math.log2(fmt.min_subnormal)), fmt.min_exponent, math.floor(math.log2(fmt.max))
