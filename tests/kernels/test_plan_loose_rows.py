"""Loose rows (fp16kit/kernels/engine/plan.py, ``Spec.loose``): an optimizer's
grads are not part of the plan cache's key,
so a step with new grad tensors (``zero_grad(set_to_none=True)`` + backward) reuses the validated plan, and a hit
re-checks the one address-dependent fact of the validation: no grad overlaps a written tensor (params, moments,
model copies). These tests put a grad *into* a param's memory, give it another shape or dtype after the plan is
cached and armed, and check that the full validation (its error message, nothing written) still runs, on both
backends, with both guards, and on both forms of the overlap test (Python loop, torch ops above
``_plan._VECTOR_MIN`` tensors).
"""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import adam_update, lamb_update
from fp16kit.kernels.engine import plan as _plan

pytestmark = pytest.mark.usefixtures("plan_guard")  # every test with both guards (conftest.py)

HP = torch.tensor([0.1, 0.9, 0.999, 0.1, 1e-3, 1e-6, 0.0, 0.1, 1e-3, 1.0, 1.0], dtype=torch.float64)
KW = {"weight_decay": 0.0, "adam_w_mode": True, "use_nvlamb": False}


def _small_under_interpreter(backend: str, n: int) -> None:
    if backend == "interpreter" and n > _plan._VECTOR_MIN:
        pytest.skip("the vectorized overlap test is backend-independent; the interpreter is slow on many tensors")


def _rows(n: int, size: int = 4):
    """``n`` params as disjoint views of one buffer (so a grad can be put across two of them), fp32 moments."""
    buf = torch.ones(n * size)
    params = [buf[i * size : (i + 1) * size] for i in range(n)]
    ms = [torch.zeros(size) for _ in range(n)]
    vs = [torch.zeros(size) for _ in range(n)]
    return buf, params, ms, vs


def _fresh(n: int, size: int = 4) -> list[torch.Tensor]:
    return [torch.full((size,), 0.5) for _ in range(n)]


@pytest.mark.parametrize("n", [3, _plan._VECTOR_MIN + 6])
def test_new_grads_hit_the_plan_and_match_a_fresh_plan(backend, n):
    """Steps with re-allocated grads plan nothing after the guard is armed, and give the bits a planner that
    validates from scratch gives (the Triton path records new address tables for the new grads)."""
    _small_under_interpreter(backend, n)
    _, params, ms, vs = _rows(n)
    _, ref_p, ref_m, ref_v = _rows(n)
    for step in range(4):
        grads = [g * (step + 1) for g in _fresh(n)]
        plans = _plan.stats["plans"]
        lamb_update(params, grads, ms, vs, [None] * n, HP, torch.zeros(1), **KW)
        if step >= 2:  # step 0 plans, step 1 plans again and arms the guard
            assert _plan.stats["plans"] == plans
        cached = _plan._cache.copy()
        _plan.clear()
        lamb_update(ref_p, [g.clone() for g in grads], ref_m, ref_v, [None] * n, HP, torch.zeros(1), **KW)
        _plan._cache.clear()
        _plan._cache.update(cached)
    for got, want in zip(params + ms + vs, ref_p + ref_m + ref_v):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n", [3, _plan._VECTOR_MIN + 6])
@pytest.mark.parametrize("where", ["exact", "partial", "moment"])
def test_a_grad_moved_into_written_memory_is_rejected_after_hits(backend, n, where):
    """After cached hits with fresh grads, a grad that shares memory with another param (exactly or across two of
    them) or with a moment is a ValueError from the full check, and nothing is written."""
    _small_under_interpreter(backend, n)
    buf, params, ms, vs = _rows(n)
    for _ in range(3):
        adam_update(params, _fresh(n), ms, vs, [None] * n, HP, torch.zeros(1), weight_decay=0.0, adam_w_mode=True)
    grads = _fresh(n)
    grads[-1] = {"exact": params[0], "partial": buf[2:6], "moment": vs[0]}[where]
    before = [t.clone() for t in params + ms + vs]
    with pytest.raises(ValueError, match=r"adam_update .*overlaps|adam_update .*is .*in memory"):
        adam_update(params, grads, ms, vs, [None] * n, HP, torch.zeros(1), weight_decay=0.0, adam_w_mode=True)
    assert all(torch.equal(a, b) for a, b in zip(params + ms + vs, before))


def test_a_grad_of_another_shape_after_hits_gets_the_full_check(backend):
    _, params, ms, vs = _rows(3)
    for _ in range(3):
        lamb_update(params, _fresh(3), ms, vs, [None] * 3, HP, torch.zeros(1), **KW)
    grads = _fresh(3)
    grads[1] = torch.full((2, 2), 0.5)
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(2, 2\)"):
        lamb_update(params, grads, ms, vs, [None] * 3, HP, torch.zeros(1), **KW)


def test_grads_that_are_their_own_params_stay_correct(backend):
    """A grad that is the exact view of its own param is allowed by the full check (the in-place rule) but not by
    the span test: every such call validates in full, and still computes what a fresh plan computes."""
    _, params, ms, vs = _rows(2)
    _, ref_p, ref_m, ref_v = _rows(2)
    for _ in range(3):
        lamb_update(params, list(params), ms, vs, [None] * 2, HP, torch.zeros(1), **KW)
        _plan.clear()
        lamb_update(ref_p, list(ref_p), ref_m, ref_v, [None] * 2, HP, torch.zeros(1), **KW)
        _plan.clear()
    for got, want in zip(params + ms + vs, ref_p + ref_m + ref_v):
        assert torch.equal(got, want)


def test_a_grad_that_is_not_a_tensor_after_hits_gets_the_full_check(backend):
    """The loose row is not read for addresses before the guard: a non-tensor there (the portable guard raises on
    it) still gets the validation's TypeError."""
    _, params, ms, vs = _rows(3)
    for _ in range(3):
        lamb_update(params, _fresh(3), ms, vs, [None] * 3, HP, torch.zeros(1), **KW)
    grads = _fresh(3)
    grads[2] = 0.5
    with pytest.raises(TypeError, match=r"grads\[2\] is a float, not a torch.Tensor"):
        lamb_update(params, grads, ms, vs, [None] * 3, HP, torch.zeros(1), **KW)
