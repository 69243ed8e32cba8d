"""Operators under ``fp16kit.amp.autocast`` follow torch's native type promotion, as under ``torch.autocast``.

cast-policy.md: the arithmetic and comparison operators are not rows of the table; a 0-dim tensor or a Python
scalar does not widen a dimensioned tensor (``x_bf16 * torch.tensor(2.0)`` stays bf16), in-place forms keep the
destination's dtype. Every case runs beside ``torch.autocast("cpu")`` (none of these ops is in torch's lists)
and must give the same dtype and the same bits. PROMOTE stays for ops that do not promote natively.
"""

from __future__ import annotations

import operator

import pytest
import torch

from fp16kit.amp import autocast
from fp16kit.numerics.assertions import assert_bitwise_equal

LOW = (torch.float16, torch.bfloat16)
IDS = ["fp16", "bf16"]

BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "torch.add": torch.add,
    "torch.mul": torch.mul,
    "torch.div": torch.div,
    "Tensor.sub": torch.Tensor.sub,
    "torch.eq": torch.eq,
}
INPLACE = {"iadd": operator.iadd, "isub": operator.isub, "imul": operator.imul, "itruediv": operator.itruediv}


def _operands(low):
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return (torch.rand(shape, generator=g) + 0.5).to(dtype)

    return {
        "low": r(3, 4, dtype=low),
        "fp32": r(3, 4),
        "low_0dim": r(dtype=low),
        "fp32_0dim": r(),
        "fp64_0dim": r(dtype=torch.float64),
        "other_low": r(3, 4, dtype=torch.bfloat16 if low is torch.float16 else torch.float16),
        "int": torch.arange(12).reshape(3, 4) + 1,
        "int_0dim": torch.tensor(3),
        "py_float": 1.7,
        "py_int": 3,
        "py_bool": True,
    }


def _same(fn, *args):
    """fn(*args) under fp16kit's autocast and under torch.autocast("cpu"): same dtype, same bits (or same error)."""
    results = []
    for region in (lambda low: autocast(dtype=low), lambda low: torch.autocast("cpu", dtype=low)):
        with region(_same.low):
            try:
                results.append(fn(*args))
            except RuntimeError as e:  # e.g. an in-place op whose result type cannot be cast back
                results.append(type(e))
    ours, ref = results
    if isinstance(ref, type):
        assert ours is ref
        return
    assert ours.dtype == ref.dtype, f"fp16kit {ours.dtype} != torch.autocast {ref.dtype}"
    if ours.is_floating_point():
        assert_bitwise_equal(ours, ref)
    else:  # bool (comparisons) or integer results
        assert torch.equal(ours, ref)


def _case(table, op, low):
    """``table[op]`` and the operands, with ``_same`` comparing under autocast to ``low``."""
    _same.low = low
    return table[op], _operands(low)


@pytest.mark.parametrize("low", LOW, ids=IDS)
@pytest.mark.parametrize("op", list(BINARY))
def test_binary_operators_follow_native_promotion(op, low):
    fn, vals = _case(BINARY, op, low)
    tensors = [k for k, v in vals.items() if isinstance(v, torch.Tensor)]
    for a in tensors:
        for b in vals:
            _same(fn, vals[a], vals[b])
            if not isinstance(vals[b], torch.Tensor) and op in ("add", "sub", "mul", "truediv", "lt", "eq"):
                _same(fn, vals[b], vals[a])  # reflected: 2.0 * x, 1 - x, 3 < x


@pytest.mark.parametrize("low", LOW, ids=IDS)
@pytest.mark.parametrize("op", list(INPLACE))
def test_inplace_operators_keep_the_destination_dtype(op, low):
    fn, vals = _case(INPLACE, op, low)
    for a in ("low", "fp32", "low_0dim"):
        for b in vals:
            _same(lambda x, y: fn(x.clone(), y), vals[a], vals[b])


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_issue_example_scalar_tensor_does_not_widen(low):
    x, s = torch.randn(4, 4).to(low), torch.tensor(2.0)
    with autocast(dtype=low):
        assert (x * s).dtype == low and (s * x).dtype == low and (x / s).dtype == low
        assert (x + torch.randn(4, 4)).dtype == torch.float32  # a dimensioned fp32 tensor does widen
        assert (x**2).dtype == torch.float32  # pow is an FP32 row (torch's CUDA list), not an operator row


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_promote_rows_still_promote(low):
    a, b = torch.randn(2, 3).to(low), torch.randn(2, 3)
    with autocast(dtype=low):
        assert torch.cat([a, b]).dtype == torch.float32
        assert torch.stack([a, b]).dtype == torch.float32
        assert torch.addcmul(a, a, b).dtype == torch.float32
        assert torch.cat([a, a]).dtype == low
        t = a.clone()
        t.index_put_((torch.tensor([0]),), b[0])  # natively an error (values dtype != self dtype): cast to self's
    assert_bitwise_equal(t[0], b[0].to(low))
