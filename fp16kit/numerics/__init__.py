"""fp16kit.numerics: format facts, float64 references, ulp assertions and Hypothesis strategies.

Public, so users can test their own numeric code the way fp16kit tests its kernels:

- :mod:`~fp16kit.numerics.formats`: ``FloatFormat`` facts for fp16/bf16/fp32/fp64 and the fp8 formats torch has
  (``FP8_DTYPES``), ``ulp``, ``ulp_distance``, ``gamma``.
- :mod:`~fp16kit.numerics.reference`: float64 references of every kernel, and of softmax, log-softmax, layer and
  RMS norm, GELU, cross-entropy and a matmul with fp32 accumulation, each with its error bound.
- :mod:`~fp16kit.numerics.assertions`: ``assert_ulp_close``, ``assert_rel_close``, ``assert_gamma_close`` (one
  :func:`assert_close_within` underneath), ``assert_bitwise_equal``, ``assert_nonfinite_agree``; strict about
  shape, dtype and device.
- :mod:`~fp16kit.numerics.strategies`: Hypothesis strategies (needs ``fp16kit[testing]``; imported on use).

May import: numpy, torch and hypothesis only: the references and formats are written independently of the
kernels they check.
"""

from __future__ import annotations

import importlib
from typing import Any

from .assertions import (
    assert_bitwise_equal,
    assert_close_within,
    assert_gamma_close,
    assert_nonfinite_agree,
    assert_rel_close,
    assert_ulp_close,
)
from .formats import FORMATS, FP8_DTYPES, FloatFormat, format_of, gamma, ulp, ulp_distance, unit_roundoff

__all__ = [
    "FORMATS",
    "FP8_DTYPES",
    "FloatFormat",
    "assert_bitwise_equal",
    "assert_close_within",
    "assert_gamma_close",
    "assert_nonfinite_agree",
    "assert_rel_close",
    "assert_ulp_close",
    "format_of",
    "gamma",
    "reference",
    "strategies",
    "ulp",
    "ulp_distance",
    "unit_roundoff",
]


def __getattr__(name: str) -> Any:
    # `strategies` needs hypothesis, an optional dependency: import it only when asked for.
    if name in ("strategies", "reference"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fp16kit.numerics' has no attribute {name!r}")
