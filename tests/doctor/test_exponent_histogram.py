"""exponent_histogram: Triton (interpreter) and torch implementations against the float64 frexp reference.

Counts are integers, so every comparison is exact: both backends must equal the reference and each
other, on Hypothesis lists with edge values, on every fp16 and bf16 bit pattern, and on hostile layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels import exponent_histogram, use_backend
from fp16kit.kernels.histogram import INF_BIN, MIN_EXP, NAN_BIN, NUM_BINS, ZERO_BIN
from fp16kit.numerics import reference
from fp16kit.numerics import strategies as fst

BACKENDS = [pytest.param("auto", marks=pytest.mark.interpreter, id="interpreter"), "torch"]


def histogram(tensors, backend, out=None):
    with use_backend(backend):
        return exponent_histogram(tensors, out=out)


def all_bit_patterns(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern as a tensor of ``dtype``: all values, both zeros, all subnormals, infs, NaNs."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.interpreter
@settings(max_examples=15, deadline=None)
@given(
    tensors=fst.tensor_lists(max_size=5, max_numel=300, edge_fraction=0.3, exponent_range=(-40, 40)),
    views=st.lists(st.sampled_from(["plain", "transposed", "strided", "offset"]), min_size=5, max_size=5),
)
def test_backends_match_the_reference_and_each_other(tensors, views):
    shaped = []
    for t, view in zip(tensors, views):
        flat = t.reshape(-1)
        if view == "transposed" and flat.numel() >= 4 and flat.numel() % 2 == 0:
            shaped.append(flat.reshape(2, -1).t())
        elif view == "strided":
            shaped.append(flat[::2])
        elif view == "offset" and flat.numel() > 1:
            shaped.append(flat[1:])  # contiguous, storage offset: the table gets an unaligned address
        else:
            shaped.append(t)
    want = reference.exponent_histogram(shaped)
    got_triton = histogram(shaped, "auto")
    got_torch = histogram(shaped, "torch")
    assert got_triton.dtype == torch.int64 and got_triton.shape == (len(shaped), NUM_BINS)
    assert np.array_equal(got_torch.numpy(), want)
    assert torch.equal(got_triton, got_torch)
    assert got_triton.sum(1).tolist() == [t.numel() for t in shaped]  # every element counted once


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_fp16_and_bf16_bit_pattern(backend):
    """Exhaustive for 16-bit formats: each subnormal's exponent, ±0, every NaN payload, both infinities."""
    tensors = [all_bit_patterns(torch.float16), all_bit_patterns(torch.bfloat16)]
    got = histogram(tensors, backend)
    assert np.array_equal(got.numpy(), reference.exponent_histogram(tensors))
    fp16, bf16 = got.tolist()
    # fp16: exponents -24..15, 1024 patterns per normal binade (2 signs x 512)... counted by hand:
    assert fp16[-24 - MIN_EXP] == 2 and fp16[-15 - MIN_EXP] == 2 * 512 and fp16[15 - MIN_EXP] == 2 * 1024
    assert fp16[ZERO_BIN] == 2 and fp16[INF_BIN] == 2 and fp16[NAN_BIN] == 2 * 1023
    assert bf16[-133 - MIN_EXP] == 2 and bf16[127 - MIN_EXP] == 2 * 128 and bf16[NAN_BIN] == 2 * 127
    assert sum(fp16[: -24 - MIN_EXP]) == 0 and sum(fp16[16 - MIN_EXP : ZERO_BIN]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_edges_and_random_bit_patterns(backend):
    fi = torch.finfo(torch.float32)
    tiny = fi.smallest_normal * fi.eps  # 2^-149
    edges = torch.tensor(
        [0.0, -0.0, tiny, -tiny, 3 * tiny, fi.smallest_normal - tiny, fi.smallest_normal, fi.max, -fi.max,
         float("inf"), -float("inf"), float("nan"), 1.0, np.nextafter(np.float32(2), np.float32(0)), 2.0],
        dtype=torch.float32,
    )
    gen = torch.Generator().manual_seed(0)
    randbits = torch.randint(-(2**31), 2**31, (6000,), generator=gen, dtype=torch.int64).to(torch.int32)
    tensors = [edges, randbits.view(torch.float32)]
    got = histogram(tensors, backend)
    assert np.array_equal(got.numpy(), reference.exponent_histogram(tensors))
    row = got[0].tolist()
    assert row[-149 - MIN_EXP] == 2 and row[-148 - MIN_EXP] == 1 and row[-127 - MIN_EXP] == 1
    assert row[-126 - MIN_EXP] == 1 and row[127 - MIN_EXP] == 2 and row[0 - MIN_EXP] == 2  # 1.0 and 2 - ulp
    assert row[1 - MIN_EXP] == 1 and row[ZERO_BIN] == 2 and row[INF_BIN] == 2 and row[NAN_BIN] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_accumulates_and_mixed_dtypes_keep_their_rows(backend):
    torch.manual_seed(3)
    tensors = [torch.randn(5000), torch.randn(7).half(), torch.empty(0), torch.randn(4097).bfloat16(), torch.randn(3)]
    once = histogram(tensors, backend)
    out = torch.zeros(len(tensors), NUM_BINS, dtype=torch.int64)
    assert histogram(tensors, backend, out=out) is out
    histogram(tensors, backend, out=out)
    assert torch.equal(out, 2 * once)
    assert np.array_equal(once.numpy(), reference.exponent_histogram(tensors))
    assert once[2].sum() == 0  # the empty tensor's row is untouched


def test_bad_input_is_rejected_clearly():
    with pytest.raises(TypeError, match=r"float64.*\.float\(\)"):
        exponent_histogram([torch.ones(3, dtype=torch.float64)])
    with pytest.raises(TypeError, match="floating dtype"):
        exponent_histogram([torch.ones(3, dtype=torch.int32)])
    with pytest.raises(TypeError, match="single tensor"):
        exponent_histogram(torch.ones(3))
    with pytest.raises(ValueError, match=r"shape \[2, 280\]"):
        exponent_histogram([torch.ones(3), torch.ones(2)], out=torch.zeros(1, NUM_BINS, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        exponent_histogram([torch.ones(3)], out=torch.zeros(1, NUM_BINS))
    with pytest.raises(ValueError, match="mixed devices"):
        exponent_histogram([torch.ones(3), torch.ones(3, device="meta")])
    assert exponent_histogram([]).shape == (0, NUM_BINS)


@pytest.mark.gpu
def test_compiled_kernel_on_cuda_matches_the_reference():
    """Compiled Triton (real atomics, real tl.histogram) on every 16-bit pattern and random fp32 bit patterns."""
    gen = torch.Generator().manual_seed(5)
    bits32 = torch.randint(-(2**31), 2**31, (300_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    tensors = [all_bit_patterns(torch.float16), all_bit_patterns(torch.bfloat16), bits32.view(torch.float32),
               torch.randn(4097, generator=gen)[1:]]  # an unaligned view
    want = reference.exponent_histogram(tensors)
    cuda = [t.cuda() for t in tensors]
    got = exponent_histogram(cuda)
    assert np.array_equal(got.cpu().numpy(), want)
    exponent_histogram(cuda, out=got)
    assert np.array_equal(got.cpu().numpy(), 2 * want)
