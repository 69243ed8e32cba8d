"""The optimizers' global gradient norm over the whole fp32 range (issue 9, item 3), on every backend.

``fp16kit.optim.functional.check_and_norm`` feeds LAMB's clip. Issue 9 found it inf (without ``found_inf``) for
finite grads whose norm exceeds ~1.8e19 on the torch backend, and 0 for grads around 1e-37: LAMB then clipped
with a wrong norm. Budget: the fp32 per-tensor norms are sums of n squares, so the result is within
``gamma(n)`` (relative, fp32; ``fp16kit.numerics.formats.gamma``) of the float64 reference
(``fp16kit.numerics.reference.l2norm``), plus the final rounding (relative, or absolute for a subnormal result).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels import use_backend
from fp16kit.numerics import reference
from fp16kit.numerics.formats import gamma
from fp16kit.optim import FusedLAMB
from fp16kit.optim import functional as F

BACKENDS = [pytest.param("auto", marks=pytest.mark.interpreter, id="interpreter"), pytest.param("torch", id="torch")]
ONE64 = torch.ones(1, dtype=torch.float64)


def check_norm(grads: list[torch.Tensor]) -> float:
    found = torch.zeros(1)
    norm = float(F.check_and_norm(grads, ONE64, found))
    want, _, want_found = reference.l2norm(grads, 1.0)
    n = max(g.numel() for g in grads) + len(grads)
    budget = gamma(n, torch.float32) + 2 * 2.0**-24
    assert not bool(found) and not want_found
    assert math.isfinite(norm) == math.isfinite(want)
    # a subnormal fp32 result carries an absolute rounding error of up to half its spacing, 2**-150
    assert abs(norm - want) <= budget * want + 2.0**-150, f"norm {norm!r}, float64 reference {want!r}"
    return norm


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("magnitude", [1e20, 1e30, 1e-20, 1e-30, 1e-37, 1e-44])
def test_global_norm_of_huge_and_tiny_grads(backend, magnitude):
    grads = [torch.full((300,), magnitude) * torch.linspace(0.5, 1.0, 300), torch.full((3,), magnitude)]
    with use_backend(backend):
        assert check_norm(grads) > 0


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(
    exponent=st.integers(-140, 120),
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=4),
    seed=st.integers(0, 99),
)
def test_global_norm_anywhere_in_range(backend, exponent, sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=gen, dtype=torch.float64) * 2.0**exponent).float() for n in sizes]
    if all(float(g.abs().max()) == 0 for g in grads):
        return
    with use_backend(backend):
        check_norm(grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lamb_clip_of_huge_grads_equals_clip_of_their_direction(backend):
    """Clipping makes the step depend on the grads' direction only: grads 1e20*v and v (both above the clip
    norm) give the same LAMB step. Before the fix the torch backend saw an inf norm and clipped to zero."""
    results = []
    for scale in (1e20, 1.0):
        gen = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(64, generator=gen)), torch.nn.Parameter(torch.zeros(8))]
        direction = [torch.randn(64, generator=gen) * 10, torch.randn(8, generator=gen) * 10]
        for p, d in zip(params, direction):
            p.grad = d * scale
        with use_backend(backend):
            FusedLAMB(params, lr=0.1, max_grad_norm=1.0).step()
        results.append([p.detach().clone() for p in params])
    for huge, plain in zip(*results):
        assert torch.isfinite(huge).all()
        torch.testing.assert_close(huge, plain, rtol=1e-5, atol=1e-7)


def test_native_cpu_norm_redoes_a_step_whose_fp32_chunk_sums_overflowed(monkeypatch):
    """The opt-in native CPU kernel (``FP16KIT_CPU_NATIVE=1``) sums squares in fp32 per chunk: for grads of 1e20
    its sum is inf with no inf/NaN element. That step's norm is redone by the torch fallback (stand-in kernel
    here, so the test needs no compiler)."""
    from fp16kit.kernels.fallback import lamb_native as _cpu_native

    class Overflowing:
        @staticmethod
        def check_norm_fp32(grads, inv_scale):
            return torch.tensor([math.inf, 0.0], dtype=torch.float64)

    monkeypatch.setattr(_cpu_native, "_load", lambda: Overflowing)
    grads = [torch.full((300,), 1e20)]
    found = torch.zeros(1)
    norm = float(_cpu_native.check_and_norm(grads, ONE64, found))
    assert not bool(found) and norm == pytest.approx(1e20 * math.sqrt(300), rel=1e-6)
