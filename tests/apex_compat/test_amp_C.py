"""fp16kit.amp_C and multi_tensor_applier: apex's conventions, against float64 references.

Budgets: ``multi_tensor_scale`` is exact (one fp32 product, one rounding to the destination: bit-identical to
the reference). Norms: fp32 sums of ``n`` squares have relative error <= gamma(n) (Higham), the square root
halves it, plus one rounding; squares that underflow fp32 add at most ``n * 2^-149`` to the sum absolutely.
``axpby``: two fp32 products and one fp32 sum (at most one fp32 ulp of each product and of the result) plus one
rounding to the destination. LAMB and Adam: the per-element budgets of
tests/optim/optim_helpers.py (module docstring there), with ``1/c`` instead of a division by ``c`` costing one
more fp32 rounding of the clip factor (covered by its ``delta_clip``).

The ``interpreter`` variants run the same cases through the Triton kernels and compare them with the torch
fallback on the same inputs.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit import amp_C
from fp16kit.kernels import use_backend
from fp16kit.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
from fp16kit.numerics import gamma, ulp
from fp16kit.numerics.reference import adam_step, lamb_step
from fp16kit.numerics.reference import kernels as ref
from fp16kit.numerics.strategies import float_tensors, tensor_lists, unscale_cases

sys.path.insert(0, str(Path(__file__).parents[1] / "optim"))
from optim_helpers import adam_budget, assert_within, lamb_budgets

F64 = torch.float64
U32 = 2.0**-24
FEW = settings(max_examples=15, deadline=None)
FEWER = settings(max_examples=4, deadline=None)


def noop() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int)


# ------------------------------------------------------------------------------------------------ scale


def _check_scale(case) -> list[torch.Tensor]:
    tensors, inv_scale, out_dtypes = case
    ins = [t.clone() for t in tensors]
    outs = ins if out_dtypes is None else [torch.empty(t.shape, dtype=d) for t, d in zip(tensors, out_dtypes)]
    flag = noop()
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ins, outs], inv_scale)
    want = ref.unscale_and_check(tensors, inv_scale, out_dtypes)
    for i, (o, w) in enumerate(zip(outs, want.outputs)):
        assert o.dtype == w.dtype
        assert torch.equal(o.view(-1).isnan(), w.view(-1).isnan()), f"NaN positions differ in output {i}"
        assert torch.equal(torch.nan_to_num(o), torch.nan_to_num(w)), f"output {i} differs from the reference"
    assert flag.dtype == torch.int32 and int(flag) == int(want.found_inf)
    return outs


@FEW
@given(unscale_cases())
def test_scale_matches_reference_and_flags_nonfinite_outputs(case) -> None:
    _check_scale(case)


@pytest.mark.interpreter
@FEWER
@given(unscale_cases(max_numel=32))
def test_scale_triton_matches_fallback(case) -> None:
    got = _check_scale(case)
    with use_backend("torch"):
        again = _check_scale(case)
    for a, b in zip(got, again):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def test_scale_never_clears_the_flag_and_checks_written_values() -> None:
    flag = torch.ones(1, dtype=torch.int)
    x = [torch.ones(3)]
    amp_C.multi_tensor_scale(2048 * 32, flag, [x, [torch.empty(3)]], 0.5)
    assert int(flag) == 1  # apex: only ever set, never cleared
    flag.zero_()
    out = [torch.empty(2, dtype=torch.float16)]
    amp_C.multi_tensor_scale(2048 * 32, flag, [[torch.tensor([60000.0, 1.0])], out], 2.0)
    assert int(flag) == 1 and math.isinf(float(out[0][0]))  # overflow of a finite value after scaling + cast


# ------------------------------------------------------------------------------------------------ norms


def _check_norms(tensors: list[torch.Tensor], pre_scale: float | None, per_tensor: bool) -> tuple:
    before = [t.clone() for t in tensors]
    flag = noop()
    if pre_scale is None:
        total, each = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [tensors], per_tensor)
        want_total, want_each, found = ref.l2norm(tensors)
    else:
        inv = torch.tensor([pre_scale], dtype=torch.float32)
        total, each = multi_tensor_applier(amp_C.multi_tensor_unscale_l2norm, flag, [tensors], inv, per_tensor)
        want_total, want_each, found = ref.l2norm(tensors, pre_scale)
    assert total.shape == (1,) and total.dtype == torch.float32
    assert each.shape == ((len(tensors),) if per_tensor else (0,))
    for t, b in zip(tensors, before):
        assert torch.equal(t.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), "inputs must not change"
    n = max(1, sum(t.numel() for t in tensors))
    rel = gamma(n, torch.float32) / 2 + 2 * U32
    wt = torch.tensor(want_total, dtype=F64)
    nonfinite = found or not math.isfinite(want_total) or not math.isfinite(float(total))
    assert int(flag) == int(nonfinite)
    # squares below fp32's subnormal range are lost: at most 2^-149 per element in the sum of squares
    underflow = math.sqrt(n * 2.0**-149)
    if not nonfinite:
        assert abs(float(total) - want_total) <= rel * float(wt) + underflow
        if per_tensor:
            want = torch.tensor(want_each, dtype=F64)
            assert_within(each, want, rel * want + underflow, "per-tensor norms")
    return total, each


@FEW
@given(tensor_lists(), st.booleans(), st.sampled_from([None, 2.0**-10, 0.3, 2.0**8]))
def test_l2norm_and_unscale_l2norm_match_reference(tensors, per_tensor, pre_scale) -> None:
    _check_norms(tensors, pre_scale, per_tensor)


@pytest.mark.interpreter
@FEWER
@given(tensor_lists(max_numel=32), st.sampled_from([None, 2.0**-10, 0.3]))
def test_l2norm_triton_matches_fallback(tensors, pre_scale) -> None:
    got = _check_norms(tensors, pre_scale, True)
    with use_backend("torch"):
        again = _check_norms(tensors, pre_scale, True)
    n = max(1, sum(t.numel() for t in tensors))
    for a, b in zip(got, again):
        torch.testing.assert_close(a, b, rtol=gamma(n, torch.float32), atol=0, equal_nan=True)


def test_l2norm_flags_a_norm_that_overflows_but_not_a_large_finite_one() -> None:
    """apex squares in fp32, so 1e30s gave an inf norm and a raised flag; fp16kit's norm does not overflow
    (float64 squares, docs/kernels.md "Norm range"): the right 2e30, no flag. A norm beyond fp32 is still inf,
    and flagged as apex flags it."""
    flag = noop()
    total, _ = amp_C.multi_tensor_l2norm(1, flag, [[torch.full((4,), 1e30)]])
    assert int(flag) == 0 and float(total) == pytest.approx(2e30, rel=1e-6)
    total, _ = amp_C.multi_tensor_l2norm(1, flag, [[torch.full((4,), torch.finfo(torch.float32).max)]])
    assert int(flag) == 1 and math.isinf(float(total))


# ------------------------------------------------------------------------------------------------ axpby


@st.composite
def axpby_case(draw):
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    n = draw(st.integers(1, 3))
    shapes = [draw(st.sampled_from([(0,), (1,), (5,), (2, 3), (17,)])) for _ in range(n)]
    edges = ("zero", "neg_zero", "subnormal", "inf", "nan")
    xs = [draw(float_tensors(draw(st.sampled_from(dtypes)), s, edges=edges)) for s in shapes]
    ys = [draw(float_tensors(draw(st.sampled_from(dtypes)), s, edges=edges)) for s in shapes]
    out_dtypes = [draw(st.sampled_from(dtypes)) for _ in shapes]
    a = draw(st.sampled_from([1.0, -1.0, 0.5, 0.1, 3.0]))
    b = draw(st.sampled_from([1.0, 0.0, -2.0, 0.7]))
    return xs, ys, out_dtypes, a, b, draw(st.sampled_from([-1, 0, 1]))


@FEW
@given(axpby_case())
def test_axpby_matches_reference(case) -> None:
    xs, ys, out_dtypes, a, b, arg = case
    outs = [torch.empty(x.shape, dtype=d) for x, d in zip(xs, out_dtypes)]
    flag = noop()
    multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], a, b, arg)
    a32, b32 = float(torch.tensor(a, dtype=torch.float32)), float(torch.tensor(b, dtype=torch.float32))
    for o, x, y in zip(outs, xs, ys):
        ax, by = a32 * x.to(F64), b32 * y.to(F64)
        want = ax + by
        finite = torch.isfinite(want)
        o64 = o.to(F64)
        assert torch.equal(torch.isnan(o64), torch.isnan(want)), "NaN positions differ"
        assert torch.equal(o64[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)]), "infinities differ"
        f32 = torch.float32
        budget = ulp(want, o.dtype) + ulp(want, f32) + ulp(ax.abs(), f32) + ulp(by.abs(), f32)
        assert_within(o64[finite], want[finite], budget[finite], "axpby")
    checked = {-1: xs + ys, 0: xs, 1: ys}[arg]
    assert int(flag) == int(any(not bool(torch.isfinite(t).all()) for t in checked))


# ------------------------------------------------------------------------------------------------ LAMB, Adam


def _state(seed: int, shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    gs = [torch.randn(s, generator=g).to(dtype) * 0.1 for s in shapes]
    ms = [torch.randn(s, generator=g) * 0.01 for s in shapes]
    vs = [torch.rand(s, generator=g) * 1e-3 for s in shapes]
    return ps, gs, ms, vs


@FEW
@given(st.integers(0, 2**16), st.integers(1, 5), st.sampled_from([0, 1]), st.sampled_from([0.0, 0.01]),
       st.booleans(), st.floats(0.1, 4.0), st.booleans())
def test_lamb_matches_reference(seed, step, mode, wd, nvlamb, gnorm, grad_averaging) -> None:
    ps, gs, ms, vs = _state(seed, [(7,), (3, 4)])
    p0, g0, m0, v0 = ([t.to(F64) for t in ts] for ts in (ps, gs, ms, vs))
    hp = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": wd, "bias_correction": True,
          "grad_averaging": grad_averaging, "step": step}
    flag = noop()
    multi_tensor_applier(amp_C.multi_tensor_lamb, flag, [gs, ps, ms, vs], hp["lr"], 0.9, 0.999, 1e-6, step, 1, wd,
                         int(grad_averaging), mode, torch.tensor([gnorm]), 1.0, nvlamb)
    assert int(flag) == 0
    assert all(torch.equal(g.to(F64), g_) for g, g_ in zip(gs, g0)), "fp16kit leaves the grads untouched"
    want_p, want_m, want_v = lamb_step(p0, g0, m0, v0, step=step, lr=hp["lr"], eps=1e-6, weight_decay=wd,
                                       grad_averaging=grad_averaging, adam_w_mode=mode == 1, use_nvlamb=nvlamb,
                                       max_grad_norm=1.0, global_norm=gnorm)
    clip = gnorm if gnorm > 1.0 else 1.0
    for i in range(len(ps)):
        err_p, err_m, err_v = lamb_budgets(p0[i], g0[i], m0[i], v0[i], want_m[i], want_v[i], hp=hp, clip=clip,
                                           delta_clip=4 * U32, adam_w_mode=mode == 1, use_nvlamb=nvlamb)
        assert_within(ps[i], want_p[i], err_p + U32 * want_p[i].abs(), f"param {i}")
        assert_within(ms[i], want_m[i], err_m, f"exp_avg {i}")
        assert_within(vs[i], want_v[i], err_v, f"exp_avg_sq {i}")


@FEW
@given(st.integers(0, 2**16), st.integers(1, 5), st.sampled_from([0, 1]), st.sampled_from([0.0, 0.01]))
def test_adam_matches_reference(seed, step, mode, wd) -> None:
    ps, gs, ms, vs = _state(seed, [(7,), (3, 4)])
    p0, g0, m0, v0 = ([t.to(F64) for t in ts] for ts in (ps, gs, ms, vs))
    hp = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd, "step": step}
    flag = noop()
    multi_tensor_applier(amp_C.multi_tensor_adam, flag, [gs, ps, ms, vs], 0.01, 0.9, 0.999, 1e-8, step, mode, 1, wd)
    assert int(flag) == 0
    want_p, want_m, want_v = adam_step(p0, g0, m0, v0, adam_w_mode=mode == 1, **hp)
    for i in range(len(ps)):
        budget = adam_budget(p0[i], want_m[i], want_v[i], g0[i], m0[i], hp)
        assert_within(ps[i], want_p[i], budget + U32 * want_p[i].abs(), f"param {i}")
        assert_within(ms[i], want_m[i], 8 * U32 * (0.9 * m0[i].abs() + 0.1 * (g0[i].abs() + wd * p0[i].abs())),
                      f"exp_avg {i}")


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["lamb", "adam"])
def test_optimizer_ops_triton_match_fallback(op) -> None:
    results = []
    for backend in ("auto", "torch"):
        ps, gs, ms, vs = _state(3, [(9,), (2, 5)])
        with use_backend(backend):
            if op == "lamb":
                amp_C.multi_tensor_lamb(1, noop(), [gs, ps, ms, vs], 0.01, 0.9, 0.999, 1e-6, 2, 1, 0.01, 1, 1,
                                        torch.tensor([2.0]), 1.0, False)
            else:
                amp_C.multi_tensor_adam(1, noop(), [gs, ps, ms, vs], 0.01, 0.9, 0.999, 1e-8, 2, 1, 1, 0.01)
        results.append(ps + ms + vs)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=16 * U32, atol=1e-12)


@pytest.mark.parametrize("op", ["lamb", "adam"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_optimizer_ops_skip_on_nonfinite_grads_and_raise_the_flag(op, bad) -> None:
    ps, gs, ms, vs = _state(1, [(4,), (3,)])
    gs[1][0] = bad
    before = [t.clone() for t in ps + ms + vs]
    flag = noop()
    if op == "lamb":
        amp_C.multi_tensor_lamb(1, flag, [gs, ps, ms, vs], 0.01, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1,
                                torch.tensor([1.0]), 1.0, False)
    else:
        amp_C.multi_tensor_adam(1, flag, [gs, ps, ms, vs], 0.01, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert int(flag) == 1
    assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs, before)), "a skipped step changes nothing"


# ------------------------------------------------------------------------------------------------ hysteresis


def _apex_rules(scale, growth, hyst, found, gf, bf, interval, hysteresis):
    """apex's update_scale_hysteresis.cu rules, in plain Python floats (float64 product, rounded to fp32)."""

    def f32(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32))

    if found > 0:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
    if found != 0 or math.isnan(found):
        scale, growth = f32(scale * bf), 0
        scale = 0.0 if scale < 2.0**-126 else scale  # flush to zero
    else:
        if growth + 1 == interval:
            grown = f32(scale * gf)
            scale = grown if math.isfinite(grown) else scale
            growth = 0
        else:
            growth += 1
    if found <= 0:
        hyst = hysteresis
    return scale, growth, hyst


@FEW
@given(st.lists(st.sampled_from([0.0, 1.0, 0.0, 0.0, float("nan"), -1.0, 2.0]), min_size=1, max_size=12),
       st.integers(1, 3), st.integers(1, 4), st.sampled_from([65536.0, 2.0**127, 1.0, 2.0**-124]))
def test_update_scale_hysteresis_follows_apex_rules(founds, hysteresis, interval, scale0) -> None:
    scale = torch.tensor([scale0])
    growth = torch.tensor([0], dtype=torch.int32)
    hyst = torch.tensor([hysteresis], dtype=torch.int32)
    want = (scale0, 0, hysteresis)
    for found in founds:
        out = amp_C.update_scale_hysteresis(scale, growth, hyst, torch.tensor([found]), 2.0, 0.5, interval, hysteresis)
        assert out is scale
        want = _apex_rules(*want, found, 2.0, 0.5, interval, hysteresis)
        assert (float(scale), int(growth), int(hyst)) == want


# ------------------------------------------------------------------------------------------------ conventions


def test_applier_passes_chunk_size_and_checks_it() -> None:
    seen = []
    MultiTensorApply(123)(lambda chunk, flag, lists, *args: seen.append((chunk, args)), noop(), [[]], 1, 2)
    assert seen == [(123, (1, 2))] and MultiTensorApply.available
    with pytest.raises(ValueError, match="chunk_size"):
        MultiTensorApply(0)


def test_bad_arguments_name_the_problem() -> None:
    x = [torch.ones(2)]
    with pytest.raises(TypeError, match="noop_flag must be a one-element integer tensor"):
        amp_C.multi_tensor_scale(1, torch.zeros(1), [x, x], 1.0)
    with pytest.raises(ValueError, match="list of 2 lists"):
        amp_C.multi_tensor_scale(1, noop(), [x], 1.0)
    with pytest.raises(ValueError, match="mode must be 0"):
        amp_C.multi_tensor_adam(1, noop(), [x, x, x, x], 0.1, 0.9, 0.99, 1e-8, 1, 2, 1, 0.0)
    with pytest.raises(ValueError, match="step must be"):
        amp_C.multi_tensor_adam(1, noop(), [x, x, x, x], 0.1, 0.9, 0.99, 1e-8, 0, 1, 1, 0.0)
    with pytest.raises(TypeError, match="current_scale"):
        amp_C.update_scale_hysteresis(torch.ones(1, dtype=F64), torch.zeros(1, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 10, 1)
