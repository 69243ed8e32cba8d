"""The 8-bit state quantizer: Triton (interpreter) vs torch vs the float64 spec, exact codes, edge values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels.state8 import rule as q
from fp16kit.kernels.state8 import triton as kq
from fp16kit.numerics import strategies as fst
from fp16kit.numerics.reference import state8 as ref

SIGNS = (True, False)


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality, NaN included."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
        an, bn = a.view(torch.float32).isnan(), b.view(torch.float32).isnan()
        assert torch.equal(an, bn), what
        a, b = torch.where(an, 0, a), torch.where(bn, 0, b)
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{what}: first mismatch at {bad[:5].tolist()}"


@pytest.mark.parametrize("signed", SIGNS)
def test_books_match_the_spec(signed):
    b = q.book(torch.device("cpu")).double().numpy()
    o = 0 if signed else 512
    assert np.array_equal(b[o : o + 256], ref.code_book(signed))
    assert np.all(np.diff(b[o : o + 256]) > 0)
    mids = ref.midpoints(signed)
    thr = b[o + 256 : o + 511]
    below = np.nextafter(thr.astype(np.float32), np.float32(-np.inf)).astype(np.float64)
    assert np.all(thr >= mids) and np.all(below < mids)  # T_k: the smallest fp32 not below midpoint k
    assert b[o + 511] == np.inf


def test_book_layout_stated_in_the_docstring():
    signed, unsigned = ref.code_book(True), ref.code_book(False)
    assert signed[0] == -1.0 and signed[127] == 0.0 and signed[255] == 1.0
    assert signed[128] == np.float32(2.0**-15.875) and signed[126] == -np.float32(2.0**-15.75)
    assert unsigned[0] == 0.0 and unsigned[1] == np.float32(2.0**-31.75) and unsigned[255] == 1.0
    assert tuple(ref.magnitudes(8)) == q.EIGHTHS


def _check(x: torch.Tensor, signed: bool, triton: bool) -> None:
    want_c, want_a = ref.quantize(x, signed)
    want_v = ref.dequantize(want_c, want_a, signed)
    c, a = q.quantize(x, signed)
    _same(c, want_c, "torch codes")
    _same(a, want_a, "torch absmax")
    _same(q.dequantize(c, a, signed), want_v, "torch dequantize")
    if triton:
        c, a, v = kq.launch_quantize(x.contiguous(), signed)
        _same(c, want_c, "triton codes")
        _same(a, want_a, "triton absmax")
        _same(v, want_v, "triton values")
        _same(kq.launch_dequantize(c, a, signed), want_v, "triton dequantize")


def _midpoint_blocks(signed: bool, picks: list[int], scale_exp: int) -> torch.Tensor:
    """Blocks whose quotients are exact midpoints (where fp32 holds them) and their fp32 neighbours."""
    mids = ref.midpoints(signed)
    vals = []
    for k in picks:
        m = np.float32(mids[k])
        vals += [m, np.nextafter(m, np.float32(-2)), np.nextafter(m, np.float32(2))]
    x = np.array(vals, dtype=np.float32).clip(-1, 1) * np.float32(2.0**scale_exp)
    # every block of q.QBLOCK values starts with 2**scale_exp, its absmax, so every quotient is exact (a single
    # leading absmax would leave the later blocks with an absmax of their own values and tie nothing there)
    per = q.QBLOCK - 1
    blocks = [np.concatenate([[np.float32(2.0**scale_exp)], x[i : i + per]]) for i in range(0, len(x), per)]
    return torch.from_numpy(np.concatenate(blocks).astype(np.float32))


@settings(max_examples=80, deadline=None)
@given(signed=st.booleans(), picks=st.lists(st.integers(0, 254), min_size=1, max_size=40),
       scale_exp=st.integers(-100, 100))
def test_ties_and_neighbours_torch(signed, picks, scale_exp):
    _check(_midpoint_blocks(signed, picks, scale_exp), signed, triton=False)


#: fp32 values across the whole exponent range (subnormals to near the top), some of them edge values
_VALUES = fst.float_tensors(torch.float32, max_numel=1100, exponent_range=(-150, 120), edge_fraction=0.05)


def _check_values(x, signed, triton):
    _check(x if signed else x.abs(), signed, triton=triton)  # an unsigned state holds magnitudes only


@settings(max_examples=200, deadline=None)
@given(signed=st.booleans(), x=_VALUES)
def test_torch_matches_spec(signed, x):
    _check_values(x, signed, triton=False)


@pytest.mark.interpreter
@settings(max_examples=40, deadline=None)
@given(signed=st.booleans(), x=_VALUES)
def test_triton_matches_torch_and_spec(signed, x):
    _check_values(x, signed, triton=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("signed", SIGNS)
def test_triton_ties_every_midpoint(signed):
    _check(_midpoint_blocks(signed, list(range(255)), 3), signed, triton=True)


@pytest.mark.parametrize("signed", SIGNS)
def test_edge_blocks(signed):
    nan, inf = math.nan, math.inf
    x = torch.zeros(3 * q.QBLOCK + 7)
    x[1] = nan  # block 0 poisoned
    x[q.QBLOCK + 2] = inf  # block 1 poisoned
    x[2 * q.QBLOCK : 2 * q.QBLOCK + 5] = torch.tensor([-0.0, 1e-45, 3.0, 2.0**-140, 0.0])  # block 2 finite
    codes, absmax = q.quantize(x, signed)
    assert math.isnan(absmax[0]) and math.isnan(absmax[1]) and absmax[2] == 3.0 and absmax[3] == 0.0
    assert (codes[: 2 * q.QBLOCK] == 0).all()
    zero = 127 if signed else 0
    assert codes[2 * q.QBLOCK] == zero and codes[3 * q.QBLOCK] == zero  # -0.0 and an all-zero (ragged) block
    values = q.dequantize(codes, absmax, signed)
    assert values[: 2 * q.QBLOCK].isnan().all() and (values[3 * q.QBLOCK :] == 0).all()
    assert values[2 * q.QBLOCK + 2] == 3.0  # the absmax element is exact
    _check(x, signed, triton=False)


@settings(max_examples=100, deadline=None)
@given(signed=st.booleans(),
       x=fst.float_tensors(torch.float32, max_numel=700, exponent_range=(-30, 30), edge_fraction=0.0))
def test_resolution_bound(signed, x):
    """|dequantize(quantize(x)) - x| <= ERR_REL |x| + c_min absmax / 2 + 2**-24 absmax (the spec's bound)."""
    if not signed:
        x = x.abs()
    codes, absmax = q.quantize(x, signed)
    err = (q.dequantize(codes, absmax, signed).double() - x.double()).abs().reshape(-1)
    rel, cmin = ref.resolution(signed)
    scale = absmax.double().repeat_interleave(q.QBLOCK)[: x.numel()]
    assert (err <= rel * x.double().abs().reshape(-1) + (cmin / 2 + 2.0**-24) * scale).all()


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="float32"):
        q.quantize(torch.zeros(3, dtype=torch.float16), True)
