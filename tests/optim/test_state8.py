"""8-bit moments (``state_bits=8``, docs/optim.md "8-bit moments"): Triton (interpreter) vs the torch implementation
(moments, codes and absmax bit for bit), the step against the fp32 rule on dequantized state with the float64
spec's quantizer, the resolution bound against fp32 state, the overflow skip, the launch budget, checkpoints and
errors."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_device_step import BUDGET, counting

from fp16kit.amp import GradScaler
from fp16kit.kernels import (
    adam_update,
    from_state8,
    lamb_stage1,
    lamb_stage2,
    lamb_update,
    state8_absmax,
    to_state8,
    use_backend,
    uses_state8,
)
from fp16kit.kernels.fallback.step import masked_commits
from fp16kit.kernels.state8 import rule as s8
from fp16kit.numerics.reference import state8 as ref
from fp16kit.optim import FusedAdam, FusedLAMB
from fp16kit.optim import functional as F

CPU = torch.device("cpu")
ONE = torch.ones((), dtype=torch.float64)
#: Ragged sizes: an 8-bit tensor with a partial last block and a partial last chunk, one exactly at the threshold,
#: small fp32-state tensors.
SHAPES = [(70, 61), (33,), (s8.SMALL_NUMEL,), (s8.SMALL_NUMEL + 300,), (5,)]


def _state(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    gs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    ms, vs = [], []
    for p in ps:
        m = torch.randn(p.shape, generator=g) * 0.1
        v = torch.rand(p.shape, generator=g) * 0.01
        if uses_state8(p):
            m, v = to_state8(m, True), to_state8(v, False)
        ms.append(m)
        vs.append(v)
    return ps, gs, ms, vs


def _clone(xs):
    out = []
    for x in xs:
        if x.dtype == torch.uint8:
            c = to_state8(torch.zeros(x.shape), True)
            c.copy_(x)
            state8_absmax(c).copy_(state8_absmax(x))
            out.append(c)
        else:
            out.append(x.clone())
    return out


def _hp(kind):
    step = torch.tensor([3.0])
    if kind == "adam":
        return F.adam_hparams(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bias_correction=True,
                              step=step, inv_scale64=ONE, device=CPU)
    return F.lamb_hparams(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                          grad_averaging=True, step=step, inv_scale64=ONE, clip64=ONE, device=CPU)


def _update(kind, ps, gs, ms, vs, found_inf, state_bits=8, models=None):
    models = models or [None] * len(ps)
    if kind == "adam":
        adam_update(ps, gs, ms, vs, models, _hp(kind), found_inf, weight_decay=0.01, adam_w_mode=True,
                    state_bits=state_bits)
    else:
        lamb_update(ps, gs, ms, vs, models, _hp(kind), found_inf, weight_decay=0.01, adam_w_mode=True,
                    use_nvlamb=False, state_bits=state_bits)


def _moments(xs, signed):
    return [from_state8(x, signed) if x.dtype == torch.uint8 else x for x in xs]


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_bit_for_bit(kind, dtype):
    ps, gs, ms, vs = _state(SHAPES, dtype=dtype)
    out = {}
    for backend in ("torch", "auto"):
        p, m, v = _clone(ps), _clone(ms), _clone(vs)
        with use_backend(backend):
            _update(kind, p, gs, m, v, torch.zeros(1))
        out[backend] = (p, m, v)
    (tp, tm, tv), (kp, km, kv) = out["torch"], out["auto"]
    for i in range(len(ps)):
        assert torch.equal(tm[i], km[i]) and torch.equal(tv[i], kv[i]), i
        if tm[i].dtype == torch.uint8:
            assert torch.equal(state8_absmax(tm[i]), state8_absmax(km[i])), i
        # the params agree within the fp32 backends' own budget (tests/differential/test_optim_differential.py: the
        # kernels and the torch sequence round a few operations differently; LAMB's norms are summed in chunk order)
        torch.testing.assert_close(tp[i].float(), kp[i].float(), rtol=2**-18, atol=2**-30)


@pytest.mark.interpreter
@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(["adam", "lamb"]), seed=st.integers(0, 2**16),
       sizes=st.lists(st.sampled_from([1, 255, 257, s8.SMALL_NUMEL - 1, s8.SMALL_NUMEL, s8.SMALL_NUMEL + 1, 8192 + 7]),
                      min_size=1, max_size=4),
       zero_block=st.booleans(), tiny=st.booleans())
def test_triton_matches_torch_on_hypothesis_states(kind, seed, sizes, zero_block, tiny):
    """Sizes around the threshold and the block/chunk edges, an all-zero block, moments near the code floor: the
    kernels' moments, codes and absmax equal the torch implementation's."""
    ps, gs, ms, vs = _state([(n,) for n in sizes], seed=seed)
    for m, v in zip(ms, vs):
        if m.dtype == torch.uint8 and zero_block:
            m[:256] = s8.ZERO_CODE[True]
            state8_absmax(m)[0] = 0.0
        if m.dtype == torch.uint8 and tiny:
            state8_absmax(v).mul_(2.0**-100)
    if zero_block:
        gs[0][:300] = 0.0
    out = {}
    for backend in ("torch", "auto"):
        p, m, v = _clone(ps), _clone(ms), _clone(vs)
        with use_backend(backend):
            _update(kind, p, gs, m, v, torch.zeros(1))
        out[backend] = (m, v)
    for a, b in zip(out["torch"][0] + out["torch"][1], out["auto"][0] + out["auto"][1]):
        assert torch.equal(a, b)
        if a.dtype == torch.uint8:
            assert torch.equal(state8_absmax(a), state8_absmax(b))


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_step_is_the_fp32_rule_on_dequantized_state_then_the_spec_quantizer(kind):
    """One 8-bit step == the fp32 step from the dequantized moments, its new moments quantized by the float64 spec
    (exact codes and absmax); Adam's params come from the fp32 moments, LAMB's from the stored ones."""
    ps, gs, ms, vs = _state(SHAPES, seed=1)
    p8, m8, v8 = _clone(ps), _clone(ms), _clone(vs)
    _update(kind, p8, gs, m8, v8, torch.zeros(1))
    p32, m32, v32 = _clone(ps), _moments(ms, True), _moments(vs, False)
    m32, v32 = [m.clone() for m in m32], [v.clone() for v in v32]
    with masked_commits():  # the kernels' rounding sequence (the CPU host path rounds lerp/addcmul its own way)
        _update(kind, p32, gs, m32, v32, torch.zeros(1), state_bits=32)
    for i, p in enumerate(ps):
        if not uses_state8(p):
            assert torch.equal(m8[i], m32[i]) and torch.equal(v8[i], v32[i])
            continue
        for got, want, signed in ((m8[i], m32[i], True), (v8[i], v32[i], False)):
            codes, absmax = ref.quantize(want, signed)
            assert torch.equal(got, codes) and torch.equal(state8_absmax(got), absmax)
        if kind == "adam":
            assert torch.equal(p8[i], p32[i])


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_moments_within_the_resolution_of_fp32_state(kind):
    """Stored moments are within the code's resolution (``ref.resolution``) of the fp32-state step's moments."""
    ps, gs, ms, vs = _state([(8192,)], seed=2)
    p8, m8, v8 = _clone(ps), _clone(ms), _clone(vs)
    _update(kind, p8, gs, m8, v8, torch.zeros(1))
    m32, v32 = [m.clone() for m in _moments(ms, True)], [v.clone() for v in _moments(vs, False)]
    with masked_commits():
        _update(kind, _clone(ps), gs, m32, v32, torch.zeros(1), state_bits=32)
    for got, want, signed in ((m8[0], m32[0], True), (v8[0], v32[0], False)):
        rel, cmin = ref.resolution(signed)
        scale = state8_absmax(got).double().repeat_interleave(s8.QBLOCK)[: want.numel()]
        err = (from_state8(got, signed).double() - want.double()).abs()
        assert (err <= rel * want.double().abs() + (cmin / 2 + 2.0**-24) * scale).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_skip_writes_nothing(kind, backend):
    ps, gs, ms, vs = _state(SHAPES, seed=3)
    p, m, v = _clone(ps), _clone(ms), _clone(vs)
    with use_backend(backend):
        _update(kind, p, gs, m, v, torch.ones(1))
    for i in range(len(ps)):
        assert torch.equal(p[i], ps[i]) and torch.equal(m[i], ms[i]) and torch.equal(v[i], vs[i])
        if m[i].dtype == torch.uint8:
            assert torch.equal(state8_absmax(m[i]), state8_absmax(ms[i]))
            assert torch.equal(state8_absmax(v[i]), state8_absmax(vs[i]))


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_staged_lamb_matches_lamb_update(backend, found):
    """The two public stages (the sharded step's path: ZeRO-1 runs them around its all-reduce) with 8-bit state
    write the same moments, codes and absmax as ``lamb_update``, and params within the norms' rounding."""
    ps, gs, ms, vs = _state(SHAPES, seed=4)
    flag = torch.full((1,), found)
    with use_backend(backend):
        p1, m1, v1 = _clone(ps), _clone(ms), _clone(vs)
        _update("lamb", p1, gs, m1, v1, flag)
        p2, m2, v2 = _clone(ps), _clone(ms), _clone(vs)
        staged = lamb_stage1(p2, gs, m2, v2, [None] * len(ps), _hp("lamb"), flag, l2_mode=False, decoupled=True,
                             state_bits=8)
        lamb_stage2(staged, flag, decoupled=True, trust=True)
    for i in range(len(ps)):
        assert torch.equal(m1[i], m2[i]) and torch.equal(v1[i], v2[i])
        if m1[i].dtype == torch.uint8:
            assert torch.equal(state8_absmax(m1[i]), state8_absmax(m2[i]))
        torch.testing.assert_close(p1[i], p2[i], rtol=2**-18, atol=2**-30)
        if found:
            assert torch.equal(p2[i], ps[i]) and torch.equal(m2[i], ms[i])


MAKERS = {
    "adam": lambda ps, **k: FusedAdam(ps, lr=1e-3, weight_decay=0.01, state_bits=8, **k),
    "lamb": lambda ps, **k: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, state_bits=8, **k),
}


def _params(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [s8.SMALL_NUMEL + 64 * i if i % 3 == 0 else 8 for i in range(n)]
    ps = [torch.randn(s, generator=g).requires_grad_() for s in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return ps


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_launch_budget_and_no_host_traffic(kind):
    """The fp32 step's launch budget; a step's torch ops do not grow with the tensors and include no host value,
    copy or read-back (``test_device_step.py``'s checks, with 8-bit state)."""
    counts = {}
    for n in (6, 12):
        opt = MAKERS[kind](_params(n), on_nonfinite="skip")
        opt.step()
        opt.step()
        with counting() as (launches, ops):
            opt.step()
        counts[n] = (sum(launches.values()), dict(ops.counts))
    assert counts[6][0] == counts[12][0] == BUDGET[kind], counts
    assert sum(counts[6][1].values()) == sum(counts[12][1].values()), counts
    host = {"aten.lift_fresh", "aten.scalar_tensor", "aten.full", "aten._to_copy", "aten.copy_",
            "aten._local_scalar_dense", "aten.ones", "aten.zeros", "aten.empty"}
    assert not ({name.rsplit(".", 1)[0] for name in counts[12][1]} & host), counts


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_device_step_matches_the_torch_step(kind):
    """The optimizers' device-resident step (hyper-parameters derived in the kernels, LAMB's sums finished in stage
    1) against the torch step, three steps with a scaler: the same codes, absmax and fp32 moments."""
    runs = {}
    for backend in ("torch", "auto"):
        ps = _params(5, seed=7)
        with use_backend(backend):
            opt = MAKERS[kind](ps, on_nonfinite="skip")
            scaler = GradScaler("cpu", init_scale=256.0)
            for _ in range(3):
                scaler.scale(torch.ones(()))
                scaler.step(opt)
                scaler.update()
        runs[backend] = (ps, opt)
    (tp, topt), (kp, kopt) = runs["torch"], runs["auto"]
    for a, b in zip(tp, kp):
        for key, value in topt.state[a].items():
            assert torch.equal(value, kopt.state[b][key]), key
        torch.testing.assert_close(a, b, rtol=2**-16, atol=2**-30)


@pytest.mark.interpreter
def test_scaler_overflow_skips_on_the_device():
    ps = _params(4)
    opt = MAKERS["adam"](ps, on_nonfinite="skip")
    scaler = GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in ps]
    ps[0].grad[7] = float("inf")
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    after = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(params, ps))
    for idx, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(after["state"][idx][key], value), (idx, key)


@pytest.mark.parametrize("Opt", [FusedAdam, FusedLAMB])
def test_checkpoints_round_trip_and_convert(Opt):
    g = torch.Generator().manual_seed(5)
    ps = [torch.randn(5000, generator=g).requires_grad_(), torch.randn(10, generator=g).requires_grad_()]
    opt = Opt(ps, lr=1e-2, state_bits=8)
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["exp_avg"].dtype == torch.uint8 and saved["state"][1]["exp_avg"].dtype == torch.float32
    twins = [p.detach().clone().requires_grad_() for p in ps]
    again = Opt(twins, lr=1e-2, state_bits=8)
    again.load_state_dict(saved)  # exact
    for key, value in opt.state[ps[0]].items():
        assert torch.equal(again.state[twins[0]][key], value), key
    plain = Opt(twins, lr=1e-2)
    plain.load_state_dict(saved)  # dequantized
    assert torch.equal(plain.state[twins[0]]["exp_avg"], from_state8(opt.state[ps[0]]["exp_avg"], True))
    assert torch.equal(plain.state[twins[0]]["exp_avg_sq"], from_state8(opt.state[ps[0]]["exp_avg_sq"], False))
    back = Opt(twins, lr=1e-2, state_bits=8)
    back.load_state_dict(plain.state_dict())  # quantized: dequantized values quantize to the same codes here
    assert torch.equal(back.state[twins[0]]["exp_avg"], opt.state[ps[0]]["exp_avg"])
    fresh = Opt(twins, lr=1e-2, state_bits=8)
    fp32 = {"state": {0: {"exp_avg": torch.randn(5000), "exp_avg_sq": torch.rand(5000)}},
            "param_groups": saved["param_groups"]}
    fresh.load_state_dict(fp32)
    codes, absmax = ref.quantize(fp32["state"][0]["exp_avg"], True)
    assert torch.equal(fresh.state[twins[0]]["exp_avg"], codes)
    assert torch.equal(fresh.state[twins[0]]["exp_avg_absmax"], absmax)


def test_bad_checkpoints_and_arguments_are_named():
    p = torch.randn(5000, requires_grad=True)
    p.grad = torch.randn(5000)
    opt = FusedAdam([p], state_bits=8)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg_absmax"] = bad["state"][0]["exp_avg_absmax"][:3]
    with pytest.raises(ValueError, match="exp_avg_absmax of 20 entries"):
        FusedAdam([p], state_bits=8).load_state_dict(bad)
    bad = copy.deepcopy(saved)
    del bad["state"][0]["exp_avg_sq_absmax"]
    with pytest.raises(ValueError, match="exp_avg_sq_absmax"):
        FusedAdam([p], state_bits=8).load_state_dict(bad)
    with pytest.raises(ValueError, match="state_bits=4"):
        FusedLAMB([p], state_bits=4)
    with pytest.raises(ValueError, match=r"needs torch\.uint8 moments"):
        adam_update([p.detach()], [p.grad], [torch.zeros(5000)], [torch.zeros(5000)], [None], _hp("adam"),
                    torch.zeros(1), weight_decay=0.0, adam_w_mode=True, state_bits=8)
    with pytest.raises(ValueError, match="room for the absmax"):
        adam_update([p.detach()], [p.grad], [torch.zeros(5000, dtype=torch.uint8)],
                    [torch.zeros(5000, dtype=torch.uint8)], [None], _hp("adam"), torch.zeros(1), weight_decay=0.0,
                    adam_w_mode=True, state_bits=8)


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
def test_master_weights_with_8bit_moments(backend):
    """bf16 params with fp32 masters and 8-bit moments: the model copy is the rounded master, and the masters
    and moments equal the fp32-params run's (the same update from the same fp32 values)."""
    g = torch.Generator().manual_seed(6)
    init = [torch.randn(s, generator=g) for s in ((70, 61), (33,))]
    grads = [[torch.randn(t.shape, generator=g).bfloat16() for t in init] for _ in range(2)]
    low = [t.bfloat16().requires_grad_() for t in init]
    ref = [t.bfloat16().float().requires_grad_() for t in init]
    with use_backend(backend):
        o_low = FusedAdam(low, lr=1e-2, master_weights=True, state_bits=8)
        o_ref = FusedAdam(ref, lr=1e-2, state_bits=8)
        for gs in grads:
            for p, q, gr in zip(low, ref, gs):
                p.grad, q.grad = gr.clone(), gr.float()
            o_low.step()
            o_ref.step()
    for p, q in zip(low, ref):
        assert torch.equal(o_low.state[p]["master"], q.detach())
        assert torch.equal(p.detach(), q.detach().bfloat16())
        assert torch.equal(o_low.state[p]["exp_avg"], o_ref.state[q]["exp_avg"])
    assert o_low.state[low[0]]["exp_avg"].dtype == torch.uint8


def test_doctor_watches_a_run_with_8bit_moments():
    """The doctor reads grads (and activations), never optimizer state: its report is the same for both modes."""
    from fp16kit import doctor

    reports = []
    for bits in (32, 8):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 1))
        opt = FusedAdam(model.parameters(), lr=1e-2, state_bits=bits)
        x = torch.randn(32, 64)
        with doctor.watch(model, every=1) as w:
            for _ in range(3):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        reports.append(w.report(torch.float16).to_dict())
    assert reports[0].keys() == reports[1].keys()


def test_compiled_8bit_step_is_refused_with_the_reason(monkeypatch):
    p = torch.randn(5000, requires_grad=True)
    p.grad = torch.randn(5000)
    opt = FusedAdam([p], state_bits=8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # what Dynamo's trace of opt.step sees
    with pytest.raises(NotImplementedError, match=r"torch\.compile of a state_bits=8 step"):
        opt._state_kw()


def test_bytes_per_param():
    """8-bit moments of a large tensor: 1 byte of code + 4/256 of absmax each (+ <= 15 bytes of padding)."""
    p = torch.randn(1 << 16, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = FusedAdam([p], state_bits=8)
    opt.step()
    nbytes = sum(t.untyped_storage().nbytes() for t in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
    assert nbytes == 2 * ((1 << 16) + 4 * (1 << 8))
    assert nbytes / p.numel() == 2.03125  # vs 8 bytes of fp32 moments


def _clipped_lamb_run(backend, dtype, layout, device_step):
    """Three FusedLAMB steps with 8-bit moments under a GradScaler, the middle one with gradients LAMB clips (a
    global norm ~1e3 against ``max_grad_norm=1``): the optimizer's codes, absmax and params."""
    g = torch.Generator().manual_seed(11)
    shapes = ((80, 64), (64, 80), (7,))  # an 8-bit param (transposed in that layout), another, a small fp32-state one
    init = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    grads = [[torch.randn(t.shape, generator=g) * size for t in init] for size in (0.01, 30.0, 0.02)]
    params = [t.to(dtype, copy=True).requires_grad_() for t in init]
    if layout == "transposed":
        params[0] = init[0].t().contiguous().to(dtype).t().requires_grad_()
    with use_backend(backend):
        opt = FusedLAMB(params, lr=1e-2, weight_decay=0.01, state_bits=8, master_weights=dtype != torch.float32)
        if not device_step:
            opt._on_device = lambda device: False  # the host-vector step on the Triton backend too
        scaler = GradScaler("cpu", init_scale=1024.0)
        for gs in grads:
            scaler.scale(torch.ones(()))
            for p, gr in zip(params, gs):
                p.grad = (gr * 1024.0).to(dtype) if layout != "transposed" or p is not params[0] \
                    else (gr * 1024.0).t().contiguous().to(dtype).t()
            scaler.step(opt)
            scaler.update()
    eight = [(k, v.clone()) for p in params for k, v in opt.state[p].items() if v.dtype == torch.uint8 or "absmax" in k]
    return eight, [p.detach().clone() for p in params]


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_clipped_lamb_codes_agree_between_backends(dtype, layout, path):
    """After a step LAMB clips, the 8-bit codes and absmax of the torch backend equal the kernels' bit for bit: the
    torch backend's global norm follows the kernels' arithmetic under ``state_bits=8`` (float64 sums of the fp32
    scaled grads; its fast fp32 sums put the clip divisor, hence every moment, some ulps apart)."""
    runs = {b: _clipped_lamb_run(b, dtype, layout, device_step=path == "device") for b in ("torch", "auto")}
    (t8, tp), (k8, kp) = runs["torch"], runs["auto"]
    assert [k for k, _ in t8] == [k for k, _ in k8] and t8
    for (key, a), (_, b) in zip(t8, k8):
        assert torch.equal(a, b), key
    for a, b in zip(tp, kp):
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-16, atol=2**-30)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       log_scale=st.integers(-40, 40), strided=st.booleans())
def test_exact_check_and_norm_is_the_float64_norm_of_the_scaled_grads(seed, sizes, dtype, log_scale, strided):
    """``check_and_norm(exact=True)`` on the torch backend: ``fp32(sqrt(sum float64(fp32(g) * inv)^2))`` within one
    fp32 ulp of the float64 reference (the summation order is its only freedom), with no flag for finite values
    (float64 grads too); an inf or NaN raises the flag. (Beside the interpreter, on the differential scenarios:
    tests/differential/test_kernels_differential.py::test_exact_check_and_norm.)"""
    from fp16kit.kernels import check_and_norm
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for n in sizes:
        t = torch.randn(2 * n if strided else n, generator=gen, dtype=torch.float64).to(dtype)
        grads.append(t[::2] if strided else t)
    inv = torch.tensor([2.0**log_scale], dtype=torch.float64)
    flag = torch.zeros(1)
    with use_backend("torch"):
        norm = check_and_norm(grads, inv, flag, exact=True)
    math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    ys = [(g.to(math_dtype) * inv.to(math_dtype)).double() for g in grads]
    finite = all(bool(torch.isfinite(y).all()) for y in ys)
    assert flag.item() == (0 if finite else 1)  # fp32 products of a large scale may overflow: that is the flag
    if finite:
        want = torch.stack([(y * y).sum() for y in ys]).sum().sqrt().float()
        # one fp32 rounding of a float64 value the summation order moves by ~1e-16: at most one ulp apart
        assert abs(norm.double() - want.double()) <= float(torch.finfo(torch.float32).eps) * float(want), (norm, want)
    grads.append(torch.tensor([float("nan")], dtype=dtype))
    with use_backend("torch"):
        check_and_norm(grads, inv, flag, exact=True)
    assert flag.item() == 1
