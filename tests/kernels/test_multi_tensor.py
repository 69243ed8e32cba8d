"""The kernels really fuse across tensors: launches per call = number of dtype groups; tables are cached."""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import copy_, l2norm, unscale_and_check
from fp16kit.kernels.engine import table as _table
from fp16kit.kernels.triton import copy as copy_kernel
from fp16kit.kernels.triton import l2norm as l2norm_kernel
from fp16kit.kernels.triton import unscale as unscale_kernel

pytestmark = pytest.mark.interpreter


class LaunchCounter:
    def __init__(self, monkeypatch, module, name):
        self.count = 0
        kernel = getattr(module, name)
        counter = self

        class Proxy:
            def __getitem__(self, grid):
                counter.count += 1
                return kernel[grid]

        monkeypatch.setattr(module, name, Proxy())


def test_unscale_one_launch_per_dtype_pair(monkeypatch):
    counter = LaunchCounter(monkeypatch, unscale_kernel, "_unscale_kernel")
    grads = [torch.randn(n) for n in range(1, 40)] + [torch.randn(n).half() for n in range(1, 30)]
    unscale_and_check(grads, 0.5, torch.zeros(1))
    assert counter.count == 2  # 68 tensors, two dtypes
    masters = [torch.empty(g.shape) for g in grads]
    unscale_and_check(grads, 0.5, torch.zeros(1), out=masters)
    assert counter.count == 4  # fp32->fp32 and fp16->fp32


def test_copy_and_norm_one_launch_per_group(monkeypatch):
    copies = LaunchCounter(monkeypatch, copy_kernel, "_copy_kernel")
    norms = LaunchCounter(monkeypatch, l2norm_kernel, "_sumsq_kernel")
    src = [torch.randn(n) for n in range(1, 50)]
    dst = [torch.empty(n, dtype=torch.float16) for n in range(1, 50)]
    copy_(dst, src)
    assert copies.count == 1
    l2norm(src + dst)
    assert norms.count == 2


def test_tables_are_cached_by_address():
    a = [torch.randn(10), torch.randn(5000)]
    t1 = _table.chunk_table([a])
    assert _table.chunk_table([a]) is t1
    b = [torch.randn(10), torch.randn(5000)]  # same shapes, new storage: a new table, never a stale one
    assert _table.chunk_table([b]) is not t1
    assert t1.num_chunks == 1 + 2 and t1.chunk_counts.tolist() == [1, 2]
    assert t1.chunk_start.tolist() == [0, 0, _table.BLOCK]


def test_misaligned_views_take_the_unaligned_kernels_and_stay_exact():
    base = torch.randn(10001)
    view = base[1:]  # contiguous, but 4 bytes past a 16-byte boundary
    assert view.data_ptr() % 16 != 0
    assert not _table.chunk_table([[view]]).aligned
    assert _table.chunk_table([[base]]).aligned
    found = torch.zeros(1)
    expected = view * 0.5
    unscale_and_check([view], 0.5, found)
    assert torch.equal(view, expected) and not bool(found)
    dst = torch.empty(10001, dtype=torch.float16)[1:]
    copy_([dst], [view])
    assert torch.equal(dst, view.half())
