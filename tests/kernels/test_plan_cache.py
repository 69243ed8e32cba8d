"""The plan cache (fp16kit/kernels/engine/plan.py): a repeated call plans nothing and builds no table; everything a user
can change on a tensor without changing its identity invalidates the plan.

Each invalidation test changes a tensor *in place of the same Python object* (``.data =``, ``resize_``,
``as_strided_``, a dtype view through ``.data``, the negative bit, an alias) between two calls. A cache keyed on
``id()`` alone would reuse the first call's verdict: under the Triton interpreter it would replay the recorded
address table (writing the old storage, past a shrunk tensor, contiguously into a strided one, or in the old
dtype); on the torch backend it would skip the validation the change must trigger (a shape mismatch, a
negative-bit or aliased output). The tests run on both backends and with both guards (torch's C++ tensor guard
and the portable Python one).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fp16kit.kernels import copy_, l2norm, lamb_update, unscale_and_check
from fp16kit.kernels.engine import plan as _plan
from fp16kit.kernels.engine import table as _table

pytestmark = pytest.mark.usefixtures("plan_guard")  # every test with both guards (conftest.py)


def _twice(op, *args, **kwargs) -> None:
    """Call ``op`` twice: the second call arms the plan's guard, so the next call is a cache hit unless the guard
    (or the address key) tells the change apart."""
    op(*args, **kwargs)
    op(*args, **kwargs)


def _counts() -> tuple[int, int]:
    return _plan.stats["plans"], _table.stats["builds"]


def test_repeated_calls_plan_nothing(backend):
    grads = [torch.randn(300), torch.randn(7).half(), torch.randn(5, 3).t()]  # kernel groups and a fallback group
    masters = [torch.zeros(300), torch.zeros(7), torch.zeros(3, 5)]
    found = torch.zeros(1)
    for _ in range(2):  # the first round plans and builds; the second plans again and arms the guards
        unscale_and_check(grads, 1.0, found)
        unscale_and_check(grads, 0.5, found, out=masters)
        copy_(masters, grads)
        l2norm(grads, per_tensor=True)
    plans, builds = _counts()
    hits = _plan.stats["hits"]
    unscale_and_check(grads, 1.0, found)
    unscale_and_check(grads, 0.5, found, out=masters)
    copy_(masters, grads)
    l2norm(grads, per_tensor=True)
    assert _counts() == (plans, builds)
    assert _plan.stats["hits"] == hits + 4
    assert all(torch.equal(m, g.float()) for m, g in zip(masters, grads))


def test_repeated_optimizer_update_plans_nothing(backend):
    params = [torch.randn(64), torch.randn(10).double()]
    grads = [torch.randn(64), torch.randn(10).double()]
    ms = [torch.zeros(64), torch.zeros(10, dtype=torch.float64)]
    vs = [torch.zeros(64), torch.zeros(10, dtype=torch.float64)]
    hp = torch.tensor([1e-3, 0.9, 0.999, 0.1, 1e-3, 1e-6, 0.01, 0.1, 1e-3, 1.0, 1.0], dtype=torch.float64)
    kw = {"weight_decay": 0.01, "adam_w_mode": True, "use_nvlamb": False}
    lamb_update(params, grads, ms, vs, [None, None], hp, torch.zeros(1), **kw)  # plans
    lamb_update(params, grads, ms, vs, [None, None], hp, torch.zeros(1), **kw)  # plans again, arms the guard
    plans, builds = _counts()
    lamb_update(params, grads, ms, vs, [None, None], hp, torch.zeros(1), **kw)
    assert _counts() == (plans, builds)


def test_a_list_seen_once_builds_no_guard(backend, monkeypatch):
    """Grads at new addresses every step never repeat: they pay validation only, not the guard."""
    built = []
    make = _plan.make_guard
    monkeypatch.setattr(_plan, "make_guard", lambda flat: built.append(len(flat)) or make(flat))
    grads = [torch.ones(8), torch.ones(8)]
    l2norm(grads)
    assert built == []
    l2norm(grads)
    assert built == [2]


def test_data_assignment_moves_the_write(backend):
    """``p.data = other``: the second call must write the new storage, not the old one."""
    src = [torch.arange(64.0)]
    dst = [torch.zeros(64)]
    _twice(copy_, dst, src)
    old = dst[0].data
    dst[0].data = torch.full((64,), -1.0)
    src[0].add_(1)
    copy_(dst, src)
    assert torch.equal(dst[0], src[0])
    assert torch.equal(old, torch.arange(64.0))  # the old storage is left alone


def test_resize_shrinks_what_is_written(backend):
    """``resize_`` keeps the address; a stale table would still write all 64 elements of the storage."""
    dst, src = torch.zeros(64), torch.arange(64.0)
    whole = dst.view(64)  # another view of the same storage, not resized
    _twice(copy_, [dst], [src])
    whole.fill_(-1)
    dst.resize_(16)
    src.resize_(16)
    copy_([dst], [src])
    assert torch.equal(dst, torch.arange(16.0))
    assert torch.equal(whole[16:], torch.full((48,), -1.0))


def test_resize_mismatch_is_still_an_error(backend):
    dst, src = torch.zeros(8), torch.ones(8)
    _twice(copy_, [dst], [src])
    dst.resize_(4)
    with pytest.raises(ValueError, match=r"dst\[0\] has shape \(4,\) but src\[0\] has shape \(8,\)"):
        copy_([dst], [src])


def test_as_strided_changes_the_elements_written(backend):
    dst, src = torch.zeros(16), torch.arange(1.0, 9.0)
    copy_([dst[:8]], [src])  # warm a plan for a contiguous 8-element destination at this address
    view = dst[:8]
    copy_([view], [src])
    dst.zero_()
    view.as_strided_((8,), (2,))  # same object, same address: now every other element
    copy_([view], [src])
    assert torch.equal(dst[0::2], src)
    assert torch.equal(dst[1::2], torch.zeros(8))


def test_dtype_change_through_data(backend):
    """One of two fp16 destinations re-viewed as bf16 (same object, address and shape): it leaves the fp16 group,
    and its cast must round to bf16 (a stale plan would launch it with the group's fp16)."""
    src = [torch.randn(40) * 3, torch.randn(40) * 3]
    dst = [torch.zeros(40, dtype=torch.float16), torch.zeros(40, dtype=torch.float16)]
    _twice(copy_, dst, src)
    dst[1].data = dst[1].data.view(torch.bfloat16)
    copy_(dst, src)
    assert dst[1].dtype == torch.bfloat16
    assert torch.equal(dst[0], src[0].half())
    assert torch.equal(dst[1], src[1].to(torch.bfloat16))


def test_same_address_other_dtype_and_shape(backend):
    """What a reused id and address of a freed tensor look like: another tensor at the same address with another
    dtype and size must never get the first one's plan (its table covers 32 elements, this one has 64)."""
    base = torch.ones(32)
    as_fp16 = base.view(torch.float16)  # 64 elements at the same address
    assert base.data_ptr() == as_fp16.data_ptr()
    _twice(unscale_and_check, [base], 1.0, torch.zeros(1))
    as_fp16.fill_(1.0)
    unscale_and_check([as_fp16], 2.0, torch.zeros(1))
    assert torch.equal(as_fp16, torch.full((64,), 2.0, dtype=torch.float16))


def test_negative_bit_output_is_rejected_after_a_hit(backend):
    """Same address, shape, strides and dtype; only the negative bit differs (a dispatch key)."""
    dst, src = torch.zeros(8), torch.ones(8)
    _twice(copy_, [dst], [src])
    with pytest.raises(ValueError, match="negative-bit"):
        copy_([torch._neg_view(dst)], [src])


def test_alias_introduced_through_data_is_rejected(backend):
    a, b = torch.zeros(8), torch.zeros(8)
    grads = [a, b]
    _twice(unscale_and_check, grads, 1.0, torch.zeros(1))
    b.data = a.data  # the list now holds the same memory twice: two programs would race on it
    with pytest.raises(ValueError, match=r"tensors\[0\] is the same memory as tensors\[1\]"):
        unscale_and_check(grads, 1.0, torch.zeros(1))


def test_optimizer_update_follows_a_moved_param(backend):
    """``p.data = other`` between two optimizer updates: the second updates the new storage."""
    p, g = torch.ones(32), torch.full((32,), 0.5)
    m, v = torch.zeros(32), torch.zeros(32)
    hp = torch.tensor([0.1, 0.9, 0.999, 0.1, 1e-3, 1e-6, 0.0, 0.1, 1e-3, 1.0, 1.0], dtype=torch.float64)
    kw = {"weight_decay": 0.0, "adam_w_mode": True, "use_nvlamb": False}
    _twice(lamb_update, [p], [g], [m], [v], [None], hp, torch.zeros(1), **kw)
    old = p.data
    frozen = old.clone()
    p.data = torch.ones(32)
    lamb_update([p], [g], [m], [v], [None], hp, torch.zeros(1), **kw)
    assert torch.equal(old, frozen)
    assert not torch.equal(p, torch.ones(32))


def test_entries_keep_no_tensor_alive(backend):
    grads = [torch.randn(16), torch.randn(16)]
    out = [torch.zeros(16), torch.zeros(16)]
    unscale_and_check(grads, 1.0, torch.zeros(1), out=out)
    refs = [weakref.ref(t) for t in grads + out]
    del grads, out
    gc.collect()
    assert all(r() is None for r in refs)


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_plan, "CACHE_SIZE", 4)
    lists = [[torch.zeros(3)] for _ in range(10)]
    for x in lists:
        l2norm(x)
    assert len(_plan._cache) == 4


def test_optimizer_rows_are_checked_for_overlap_on_every_backend(backend):
    """The planner checks the optimizer's written rows on both backends (before, only a Triton table build did, so
    the torch fallback updated a repeated param twice)."""
    p = torch.ones(8)
    g = torch.ones(8)
    m, v = [torch.zeros(8), torch.zeros(8)], [torch.zeros(8), torch.zeros(8)]
    hp = torch.tensor([0.1, 0.9, 0.999, 0.1, 1e-3, 1e-6, 0.0, 0.1, 1e-3, 1.0, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"lamb_update \(written rows params, exp_avgs, exp_avg_sqs.*same memory"):
        lamb_update([p, p], [g, g], m, v, [None, None], hp, torch.zeros(1), weight_decay=0.0, adam_w_mode=True,
                    use_nvlamb=False)
    assert torch.equal(p, torch.ones(8))
