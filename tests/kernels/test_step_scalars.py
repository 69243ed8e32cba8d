"""The device step's scalar arithmetic (``fp16kit/kernels/engine/step_scalars.py``) against exact references.

* ``split3``/``join3``: a Python float (float64) travels as three float32 launch arguments whose float64 sum is the
  value exactly, in the documented magnitude range [2**-77, 2**127] (and 0); on the host and through a kernel.
* ``pow_int``: ``beta ** t`` by square-and-multiply in float64, within its rounding budget of the exact rational
  power: ``beta^(2^k)`` after ``k`` squarings carries ``(2^k - 1)`` roundings (each squaring doubles the inherited
  relative error and adds one), and the products of the chosen powers add theirs: at most ``2 t`` roundings of
  ``2**-53`` each.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels.engine.step_scalars import join3, pow_int, split3

IN_RANGE = st.floats(min_value=2.0**-77, max_value=2.0**127, allow_nan=False, allow_infinity=False)
EDGES = [0.0, 2.0**-77, 2.0**127, 1e-3, 0.999, 1 / 3, 1.0 - 2.0**-53, 3.4028234663852886e38, 1e-8]


def _joined(parts: tuple[float, float, float]) -> float:
    hi, mid, lo = (np.float64(np.float32(p)) for p in parts)  # each part is a float32 value
    return float((hi + mid) + lo)  # join3's order


@given(x=IN_RANGE, negative=st.booleans())
def test_split3_parts_are_float32_and_add_back_exactly(x, negative):
    x = -x if negative else x
    parts = split3(x)
    assert all(float(np.float32(p)) == p for p in parts)
    assert _joined(parts) == x


@pytest.mark.parametrize("x", EDGES + [-v for v in EDGES])
def test_split3_edges(x):
    assert _joined(split3(x)) == x


@triton.jit
def _join_kernel(out_ptr, hi, mid, lo):
    tl.store(out_ptr, join3(hi, mid, lo))


@triton.jit
def _pow_kernel(out_ptr, base_ptr, n):
    tl.store(out_ptr, pow_int(tl.load(base_ptr), n))


@pytest.mark.interpreter
@settings(max_examples=40, deadline=None)
@given(x=IN_RANGE)
def test_join3_in_a_kernel_rebuilds_the_float64_value(x):
    out = torch.zeros(1, dtype=torch.float64)
    _join_kernel[(1,)](out, *split3(x))
    assert out.item() == x


@pytest.mark.interpreter
@settings(max_examples=40, deadline=None)
@given(beta=st.floats(min_value=0.5, max_value=1.0 - 2.0**-40), t=st.integers(min_value=0, max_value=1 << 12))
def test_pow_int_within_its_rounding_budget(beta, t):
    out = torch.zeros(1, dtype=torch.float64)
    _pow_kernel[(1,)](out, torch.tensor([beta], dtype=torch.float64), t)
    exact = Fraction(beta) ** t
    if exact == 0:  # underflowed below the smallest float64 subnormal: the computed value must be 0 or tiny too
        assert out.item() < 2.0**-1000
        return
    rel = abs(Fraction(out.item()) - exact) / exact
    budget = 2 * max(t, 1) * 2.0**-53
    if float(exact) > 2.0**-1000:  # away from float64's subnormals, where relative error grows
        assert float(rel) <= budget, (beta, t, float(rel), budget)
    assert math.isfinite(out.item())
