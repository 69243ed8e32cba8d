"""No kernel touches memory outside the tensors it was given (docs/kernels.md, "The memory invariant").

Every tensor of a call is a view into a larger buffer, with guard elements before and after it holding a
sentinel. After the call every guard element must still hold the sentinel bit for bit (no write past a view),
and the results must match the float64 reference (a read past a view would pull the sentinel, a large finite
value, into the output or the norm). Sizes sit around the 4096-element chunk boundary, where an off-by-one in
``engine/chunks.py``'s full-chunk test (``start + BLOCK <= n``) writes one element past a tensor; views are placed
16-byte aligned (the vectorized, unmasked full-chunk path) and misaligned.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.kernels import copy_, l2norm, unscale_and_check
from fp16kit.numerics import assert_bitwise_equal, reference

BACKENDS = [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]
SIZES = (4095, 1, 4096, 4097, 8191, 8192, 8193, 3)
GUARD = 5  # sentinel elements at least, before and after each view
SENTINEL = 1000.0  # exact in every format; its square would shift any norm far past the budget
OUT_SENTINEL = -96.0  # another one in output buffers: a copy of an input's sentinel must show
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


class Guarded:
    """Views of ``sizes`` into one sentinel-filled buffer, with guard elements around each."""

    def __init__(self, sizes, dtype, *, aligned: bool, seed: int, values: bool = True):
        sentinel = SENTINEL if values else OUT_SENTINEL
        per16 = 128 // torch.finfo(dtype).bits  # elements per 16 bytes
        offsets, pos = [], GUARD
        for n in sizes:
            start = -(-pos // per16) * per16 + (0 if aligned else 1)
            offsets.append(start)
            pos = start + n + GUARD
        self.buffer = torch.full((pos + GUARD,), sentinel, dtype=dtype)
        self.inside = torch.zeros(pos + GUARD, dtype=torch.bool)
        gen = torch.Generator().manual_seed(seed)
        self.views = []
        for start, n in zip(offsets, sizes):
            view = self.buffer[start : start + n]
            if values:
                view.copy_(torch.randn(n, generator=gen) * 4)
            self.inside[start : start + n] = True
            self.views.append(view)
        assert all((v.data_ptr() % 16 == 0) == aligned for v in self.views)
        self.sentinel_bits = torch.full((1,), sentinel, dtype=dtype).view(_int(dtype))

    def assert_guards_untouched(self, what: str) -> None:
        bits = self.buffer.view(_int(self.buffer.dtype))[~self.inside]
        bad = (bits != self.sentinel_bits).nonzero().reshape(-1)
        assert bad.numel() == 0, f"{what}: {bad.numel()} guard element(s) overwritten, first values " + str(
            self.buffer[~self.inside][bad[:5]].tolist()
        )


def _int(dtype: torch.dtype) -> torch.dtype:
    return {F16: torch.int16, BF16: torch.int16, F32: torch.int32}[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,aligned", [(F16, True), (BF16, False), (F32, True), (F32, False)])
def test_unscale_in_place_stays_inside_views(backend, aligned, dtype):
    g = Guarded(SIZES, dtype, aligned=aligned, seed=1)
    before = [v.clone() for v in g.views]
    found = torch.zeros(1)
    unscale_and_check(g.views, 0.5, found)
    g.assert_guards_untouched("in-place unscale")
    for v, ref in zip(g.views, reference.unscale_and_check(before, 0.5).outputs):
        assert_bitwise_equal(v, ref)
    assert not bool(found)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_dtype,dst_dtype,aligned", [(F16, F32, True), (F32, BF16, False), (BF16, F16, True)])
def test_unscale_out_of_place_with_norm_stays_inside_views(backend, aligned, src_dtype, dst_dtype):
    src = Guarded(SIZES, src_dtype, aligned=aligned, seed=2)
    dst = Guarded(SIZES, dst_dtype, aligned=not aligned, seed=0, values=False)
    found, sq = torch.zeros(1), torch.zeros(1, dtype=torch.float64)
    unscale_and_check(src.views, 0.25, found, out=dst.views, sq_norm=sq)
    src.assert_guards_untouched("unscale input")
    dst.assert_guards_untouched("unscale output")
    ref = reference.unscale_and_check(src.views, 0.25, [dst_dtype] * len(SIZES))
    for v, r in zip(dst.views, ref.outputs):
        assert_bitwise_equal(v, r)
    assert not bool(found)
    assert abs(float(sq) - ref.sq_norm) <= 1e-12 * ref.sq_norm  # float64 accumulation: reads past a view show


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,aligned", [(F16, False), (BF16, True), (F32, False)])
def test_l2norm_reads_only_its_views(backend, aligned, dtype):
    g = Guarded(SIZES, dtype, aligned=aligned, seed=3)
    found = torch.zeros(1)
    total, per = l2norm(g.views, per_tensor=True, found_inf=found)
    g.assert_guards_untouched("l2norm")
    ref_total, ref_per, _ = reference.l2norm(g.views)
    for got, want in zip([float(total), *per.tolist()], [ref_total, *ref_per]):
        assert math.isclose(got, want, rel_tol=2**-23), (got, want)  # 1 ulp (fp32) budget
    assert not bool(found)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "src_dtype,dst_dtype,aligned", [(F32, F16, True), (F32, BF16, False), (F16, F16, False), (BF16, F32, True)]
)
def test_copy_stays_inside_views(backend, aligned, src_dtype, dst_dtype):
    src = Guarded(SIZES, src_dtype, aligned=aligned, seed=4)
    dst = Guarded(SIZES, dst_dtype, aligned=aligned, seed=0, values=False)
    copy_(dst.views, src.views)
    src.assert_guards_untouched("copy_ source")
    dst.assert_guards_untouched("copy_ destination")
    for d, s in zip(dst.views, src.views):
        assert_bitwise_equal(d, s.to(dst_dtype))


_TABLE_SHAPES_SCRIPT = """
import torch
from fp16kit.kernels import copy_, l2norm
x, y = torch.arange(8.0), torch.full((8,), -1.0)
l2norm([x, y])        # one list of two tensors: the flat address tuple (x, y)
copy_([y], [x])       # two lists of one tensor (sources, destinations): the same flat address tuple
assert torch.equal(y, x), y
print("ok")
"""


@pytest.mark.interpreter
def test_a_table_is_never_shared_between_list_structures():
    """The address-table cache once keyed tables by the flat tuple of addresses alone: ``l2norm([x, y])``'s table
    (one list of two tensors) was handed to ``copy_([y], [x])`` (two lists of one), whose kernel then read a
    numel as the destination address and wrote there (a segfault, or silent corruption). Run in a subprocess:
    the old code crashes the interpreter."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "FP16KIT_BACKEND": "triton"}
    run = subprocess.run([sys.executable, "-c", _TABLE_SHAPES_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])
