"""``unscale_and_check``'s flag, scale and norm accumulator on a cached plan (fp16kit/kernels/engine/plan.py, ``aux``):
they are checked with the lists on a miss only, and the hit's guard pins their dtype, shape and device. So after
the plan is cached and armed, a flag or scale of another kind must still get the same error as on a first call;
and the torch backend's direct path (torch's fused unscale, nothing else per tensor) must give the bits, flags
and version bumps of the general fallback.
"""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import unscale_and_check
from fp16kit.kernels.engine import plan as _plan
from fp16kit.kernels.fallback import unscale as fb_unscale


@pytest.fixture(autouse=True)
def _clean():
    _plan.clear()
    yield
    _plan.clear()


def _armed(grads, inv, found, **kw):
    for _ in range(2):  # the second call arms the guard: from now on a call with the same kinds is a hit
        unscale_and_check(grads, inv, found, **kw)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.zeros(2), "one-element float32"),
        (torch.zeros(1, dtype=torch.float64), "one-element float32"),
        (torch.zeros(1, dtype=torch.float16), "one-element float32"),
        ("meta", "is on meta but the tensors are on cpu"),
    ],
)
def test_a_bad_flag_after_hits_gets_the_first_call_error(bad, match):
    grads = [torch.ones(4), torch.ones(4)]
    inv = torch.full((1,), 0.5)
    _armed(grads, inv, torch.zeros(1))
    hits = _plan.stats["hits"]
    unscale_and_check(grads, inv, torch.zeros(1))
    assert _plan.stats["hits"] == hits + 1
    flag = torch.zeros(1, device="meta") if bad == "meta" else bad
    with pytest.raises(ValueError, match=match):
        unscale_and_check(grads, inv, flag)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.ones(2), "one-element floating tensor"),
        (torch.ones(1, dtype=torch.int32), "one-element floating tensor"),
        (torch.ones(1, device="meta"), "inv_scale is on meta"),
    ],
)
def test_a_bad_scale_after_hits_gets_the_first_call_error(bad, match):
    grads = [torch.ones(4), torch.ones(4)]
    _armed(grads, torch.full((1,), 0.5), torch.zeros(1))
    with pytest.raises(ValueError, match=match):
        unscale_and_check(grads, bad, torch.zeros(1))


def test_a_bad_norm_accumulator_after_hits_gets_the_first_call_error():
    grads = [torch.ones(4), torch.ones(4)]
    _armed(grads, 0.5, torch.zeros(1), sq_norm=torch.zeros(1))
    with pytest.raises(ValueError, match="sq_norm must be a one-element float32 or float64"):
        unscale_and_check(grads, 0.5, torch.zeros(1), sq_norm=torch.zeros(1, dtype=torch.float16))


def test_scale_and_norm_kinds_alternate_on_one_list():
    """A float scale, a tensor scale, with and without ``sq_norm``: each kind has its own entry, each gives the
    plain math."""
    grads = [torch.full((4,), 2.0), torch.full((3,), 2.0)]
    for _ in range(3):
        for inv in (0.5, torch.full((1,), 2.0)):
            for sq in (None, torch.zeros(1, dtype=torch.float64)):
                unscale_and_check(grads, inv, torch.zeros(1), sq_norm=sq)
                if sq is not None:
                    assert sq.item() == pytest.approx(7 * grads[0][0].item() ** 2)
    assert all(torch.equal(g, torch.full_like(g, 2.0)) for g in grads)  # (x0.5 then x2) three times


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("inv", [2.0**-3, 4.0])
def test_direct_path_matches_the_fallback(dtype, out_dtype, inv):
    """Bits, flag and versions of the direct path (cached plan, one fallback group) against ``fb_unscale.unscale``,
    with a scale above 1 that overflows a finite value (only a check of the written values catches it)."""
    big = torch.finfo(dtype).max
    x = torch.tensor([1.0, -3.5, 1e-3, big / 2], dtype=dtype)
    grads = [x.clone() for _ in range(3)]
    ref_in = [x.clone() for _ in range(3)]
    outs = None if out_dtype is None else [torch.empty(4, dtype=out_dtype) for _ in range(3)]
    ref_out = ref_in if out_dtype is None else [torch.empty(4, dtype=out_dtype) for _ in range(3)]
    for _ in range(3):  # plans, arms, hits
        found = torch.zeros(1)
        dst = grads if outs is None else outs
        versions = [t._version for t in [found, *dst]]
        unscale_and_check(grads, inv, found, out=outs)
        assert all(t._version > v for t, v in zip([found, *dst], versions))
        ref_found = torch.zeros(1)
        fb_unscale.unscale(ref_in, ref_out, torch.full((1,), inv, dtype=torch.float64), ref_found, False)
        assert torch.equal(found, ref_found)
        assert found.item() == float(not all(bool(t.isfinite().all()) for t in ref_out))  # flagged iff written inf
        for got, want in zip(dst, ref_out):
            assert torch.equal(got, want)


@pytest.mark.parametrize("guard", ["torch", "python"])
def test_a_norm_accumulator_that_is_not_a_tensor_after_hits(monkeypatch, guard):
    if guard == "python":
        monkeypatch.setattr(_plan, "make_guard", _plan._PyGuard)
    grads = [torch.ones(4), torch.ones(4)]
    _armed(grads, 0.5, torch.zeros(1), sq_norm=torch.zeros(1))
    with pytest.raises(TypeError, match="sq_norm must be a one-element"):
        unscale_and_check(grads, 0.5, torch.zeros(1), sq_norm=1.0)
