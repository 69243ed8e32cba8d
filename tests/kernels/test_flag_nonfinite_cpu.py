"""The CPU read-only inf/NaN check of ``flag_nonfinite`` (fp16kit/kernels/found_inf.py): a finite fp32 sum proves
a grad finite; sums that are not finite (an inf/NaN element, or finite values whose sum overflows) and scales above
1 fall back to the exact largest-magnitude check. Compared with the float64 reference of the flag (``fp32(g) * inv``
computed exactly, then rounded to fp32) and with the Triton interpreter's check on the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp16kit.kernels.found_inf as found_inf_mod
from fp16kit.kernels import flag_nonfinite, new_found_inf

_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# sizes: empty, pooled (concatenated), summed alone (>= found_inf._SUM_ALONE)
_SIZES = [0, 1, 7, 300, 20000]
_INVS = [1.0, 0.5, 2.0**-16, 2.0**-149, 0.0, -1.0, 1.5, 2.0**100, float("inf"), float("nan")]


# set in a grad of any dtype (rounded to it: fp16 turns 3e38 into inf), so the sums see max finite values, infs, NaNs
_BIG32 = torch.finfo(torch.float32).max
_EDGES = [0.0, -0.0, 2.0**-140, 1.0, -_BIG32, _BIG32, 3.0e38, 65504.0, float("inf"), float("-inf"), float("nan")]


def reference_flag(grads: list[torch.Tensor], inv: float) -> bool:
    """Some ``fp32(g) * inv`` inf/NaN: the exact product of two fp32 numbers (<= 48 significant bits) in float64,
    rounded once to fp32."""
    inv32 = torch.tensor(inv, dtype=torch.float32).double()
    return any(bool((~torch.isfinite((g.float().double() * inv32).float())).any()) for g in grads if g.numel())


def _grads(draw_spec, gen: torch.Generator) -> list[torch.Tensor]:
    grads = []
    for dtype, n, fill, places, value in draw_spec:
        if fill is None:
            g = (torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3).to(dtype)
        else:  # every element a large finite value: sums that overflow although no element does
            g = torch.full((n,), fill, dtype=torch.float64).to(dtype)
        for where in places:
            if n:
                g[where % n] = value
        grads.append(g)
    return grads


_tensor = st.tuples(
    st.sampled_from(_DTYPES),
    st.sampled_from(_SIZES),
    st.sampled_from([None, None, 1.0e38, -1.0e38, 3.0e38]),
    st.lists(st.integers(0, 10**6), max_size=2),
    st.sampled_from(_EDGES),
)


@settings(max_examples=120, deadline=None)
@given(spec=st.lists(_tensor, min_size=1, max_size=5), inv=st.sampled_from(_INVS), seed=st.integers(0, 2**16))
def test_flag_matches_the_float64_reference(spec, inv, seed):
    grads = _grads(spec, torch.Generator().manual_seed(seed))
    before = [g.clone() for g in grads]
    versions = [g._version for g in grads]
    flag = new_found_inf("cpu")
    flag_nonfinite(grads, torch.tensor([inv], dtype=torch.float32), flag)
    assert float(flag) == float(reference_flag(grads, inv))
    # read-only: values (bits) and version counters untouched
    for g, b, v in zip(grads, before, versions):
        assert torch.equal(g.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        assert g._version == v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 20000])
def test_a_sum_that_overflows_with_finite_elements_does_not_raise(dtype, n):
    """Finite elements whose fp32 sum is inf (and +inf/-inf partial sums giving NaN) are not an overflow."""
    big = torch.finfo(dtype).max
    g = torch.full((n,), big, dtype=dtype)
    g[1::2] = -big if n > 7 else big
    grads = [g, torch.full((n,), big, dtype=dtype)]
    assert not torch.isfinite(grads[1].sum(dtype=torch.float32))
    flag = new_found_inf("cpu")
    flag_nonfinite(grads, torch.ones(1), flag)
    assert float(flag) == 0.0


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("n", [3, 20000])
def test_one_bad_element_raises_wherever_it_is(value, n):
    for where in (0, n // 2, n - 1):
        grads = [torch.randn(n), torch.randn(5).half()]
        grads[0][where] = value
        flag = new_found_inf("cpu")
        flag_nonfinite(grads, torch.full((1,), 2.0**-16), flag)
        assert float(flag) == 1.0


def test_a_raised_flag_is_never_lowered():
    flag = torch.ones(1)
    flag_nonfinite([torch.randn(20000)], torch.ones(1), flag)
    assert float(flag) == 1.0


def test_finite_grads_at_a_scale_up_to_one_need_no_largest_magnitude(monkeypatch):
    """The point of the sums: with every grad finite and ``|inv| <= 1`` no tensor goes through the exact
    (``aminmax``) check; with a scale above 1, or a tensor holding an inf, exactly the unproven ones do."""
    seen: list[list[torch.Tensor]] = []
    real = found_inf_mod._largest_magnitudes

    def spy(grads):
        seen.append(list(grads))
        return real(grads)

    monkeypatch.setattr(found_inf_mod, "_largest_magnitudes", spy)
    grads = [torch.randn(70000), torch.randn(20000).bfloat16(), torch.randn(300), torch.randn(7).half()]
    flag_nonfinite(grads, torch.full((1,), 2.0**-16), new_found_inf("cpu"))
    assert seen == [[]]
    grads[1][5] = float("inf")
    flag = new_found_inf("cpu")
    flag_nonfinite(grads, torch.ones(1), flag)
    assert float(flag) == 1.0 and len(seen[-1]) == 1 and seen[-1][0] is grads[1]
    flag_nonfinite(grads[:1], torch.full((1,), 2.0), new_found_inf("cpu"))
    assert len(seen[-1]) == 1 and seen[-1][0] is grads[0]


def test_non_contiguous_and_expanded_grads():
    base = torch.randn(300, 200)
    grads = [base.t(), base[:, ::2], torch.randn(1).expand(30000), torch.randn(64, 8)[::2]]
    flag = new_found_inf("cpu")
    flag_nonfinite(grads, torch.ones(1), flag)
    assert float(flag) == 0.0
    base[17, 3] = float("nan")
    flag_nonfinite(grads, torch.ones(1), flag)
    assert float(flag) == 1.0


@pytest.mark.interpreter
@settings(max_examples=15, deadline=None)
@given(spec=st.lists(_tensor, min_size=1, max_size=3), inv=st.sampled_from(_INVS[:7]), seed=st.integers(0, 99))
def test_the_torch_check_agrees_with_the_triton_interpreter(spec, inv, seed):
    from fp16kit.kernels import use_backend

    spec = [(d, min(n, 300), f, p, v) for d, n, f, p, v in spec if d is not torch.float64]  # the kernel's dtypes
    if not spec:
        return
    grads = _grads(spec, torch.Generator().manual_seed(seed))
    flags = []
    for backend in ("torch", "triton"):
        flag = new_found_inf("cpu")
        with use_backend(backend):
            flag_nonfinite(grads, torch.tensor([inv], dtype=torch.float32), flag)
        flags.append(float(flag))
    assert flags[0] == flags[1] == float(reference_flag(grads, inv))


@pytest.mark.parametrize("partner", [0.0, 1.0, -2.0, float("inf"), float("nan")])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1.0e30])
def test_grads_checked_in_pairs(value, partner):
    """Equal-sized fp32 grads are checked two at a time (one ``dot``): an inf/NaN in either raises the flag whatever
    the other holds at that place (``inf * 0`` is NaN), a product that overflows with finite factors does not."""
    n = 20000
    a, b, c = torch.randn(n), torch.randn(n), torch.randn(n)  # a, b paired; c alone
    for where in (0, 4321, n - 1):
        x, y = a.clone(), b.clone()
        x[where], y[where] = value, partner
        for grads in ([x, y, c], [y, x, c]):
            flag = new_found_inf("cpu")
            flag_nonfinite(grads, torch.ones(1), flag)
            assert float(flag) == float(reference_flag(grads, 1.0))
