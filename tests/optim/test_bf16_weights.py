"""bf16 weights without fp32 masters (docs/optim.md, "bf16 weights without fp32 masters"): the split ("16+16") and
stochastic-rounding write rules against their float64 references (Hypothesis, edge values), the Triton device
functions against their torch twins bit for bit, unbiasedness with a stated bound, and FusedAdam/FusedLAMB with
``master_weights="split"`` bit for bit equal to ``master_weights=True`` on both backends (reassembled masters,
moments, counters), the skip, the launch budget, checkpoints and validation."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import scaled_step
from test_device_step import BUDGET, counting

from fp16kit.amp import GradScaler
from fp16kit.kernels import join_halves, split_halves, stochastic_round, use_backend
from fp16kit.kernels.bf16_weights.modes import (
    _split_bits,
    _stochastic_bits,
    philox_uint32,
    round_with_bits,
    stochastic_round_list,
)
from fp16kit.kernels.fallback.step import masked_commits
from fp16kit.numerics.reference.bf16_weights import split_master, stochastic_round_bf16
from fp16kit.optim import FusedAdam, FusedLAMB, FusedSGD

# fp32 bit patterns at the edges: ±0, the smallest and largest subnormals, the smallest normal, 1 and its
# neighbours, ties (low half 0x8000) with even and odd high halves, just below and above ties, the largest finite
# value, the last values before bf16's top rounds to inf, ±inf
EDGE_BITS = [
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x00008000, 0x00018000, 0x00007FFF,
    0x3F800000, 0x3F7FFFFF, 0x3F800001, 0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F807FFF, 0x3F808001,
    0x3F7F8000, 0x3FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x7F7EFFFF, 0x7F800000, 0xFF800000,
    0x3F7FFFFF, 0x407FFFFF, 0x0001FFFF, 0x8000FFFF,
]


def _f32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.float32))


def _bits(t: torch.Tensor) -> list[int]:
    return [int(b) & 0xFFFFFFFF for b in t.view(torch.int32).tolist()]


fp32_bits = st.integers(0, 2**32 - 1).filter(lambda b: (b & 0x7FFFFFFF) <= 0x7F800000)  # every non-NaN pattern


# --------------------------------------------------------------------------------------------------- the rules


@settings(max_examples=300, deadline=None)
@given(st.lists(fp32_bits, min_size=1, max_size=40))
def test_split_is_exact_and_matches_the_float64_reference(extra):
    x = _f32(EDGE_BITS + extra)
    hi, lo = split_halves(x)
    assert _bits(join_halves(hi, lo)) == _bits(x)  # exact, bit for bit, every non-NaN value
    for xv, h, low in zip(x.tolist(), hi.float().tolist(), lo.tolist()):
        ref_hi, ref_lo = split_master(xv)
        assert (h == ref_hi and math.copysign(1, h) == math.copysign(1, ref_hi)) and low == ref_lo, (xv, h, low)
    # hi is x.to(bf16) (nearest even) except at ties, where both neighbours are equally near
    low_half = torch.tensor(_bits(x), dtype=torch.int64) & 0xFFFF
    rne = x.to(torch.bfloat16)
    differs = hi.view(torch.int16) != rne.view(torch.int16)
    assert bool((low_half[differs] == 0x8000).all())


def test_split_nan_is_written_as_the_canonical_nan():
    x = _f32([0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FFFFFFF])
    hi, lo = split_halves(x)
    assert hi.view(torch.int16).tolist() == [0x7FC0] * 4 and lo.tolist() == [0] * 4
    assert torch.isnan(join_halves(hi, lo)).all()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(fp32_bits, st.integers(0, 2**16 - 1)), min_size=1, max_size=40))
def test_stochastic_rule_matches_the_float64_reference(pairs):
    pairs = [(b, r) for b in EDGE_BITS for r in (0, 1, 0x7FFF, 0x8000, 0xFFFF)] + pairs
    x = _f32([b for b, _ in pairs])
    r16 = torch.tensor([r for _, r in pairs], dtype=torch.int64)
    out = round_with_bits(x, r16).float().tolist()
    for xv, r, o in zip(x.tolist(), r16.tolist(), out):
        ref = stochastic_round_bf16(xv, r)
        assert o == ref and math.copysign(1, o) == math.copysign(1, ref), (xv, r, o, ref)


def test_philox_is_philox4x32_10():
    """Known answers of Random123's Philox4x32-10 (first output word), and Triton's ``tl.philox`` below."""
    zero = philox_uint32(0, torch.tensor([0]), 0, 0, 0)[:, 0]
    ones = philox_uint32(2**64 - 1, torch.tensor([0xFFFFFFFF]), 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF)[:, 0]
    assert zero.tolist() == [0x6627E8D5] and ones.tolist() == [0x408F276D]


@triton.jit
def _rules_kernel(x_ptr, hi_ptr, lo_ptr, sr_ptr, n, seed, row, stream, step, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    hi, lo = _split_bits(x)
    tl.store(hi_ptr + offs, hi, mask=mask)
    tl.store(lo_ptr + offs, lo, mask=mask)
    tl.store(sr_ptr + offs, _stochastic_bits(x, seed, offs, row, stream, step.to(tl.uint32)), mask=mask)


@pytest.mark.interpreter
@settings(max_examples=25, deadline=None)
@given(st.lists(fp32_bits, min_size=1, max_size=300), st.integers(0, 2**63 - 1), st.integers(0, 1000),
       st.integers(0, 7), st.integers(0, 2**24))
def test_triton_device_functions_equal_the_torch_twins(bits, seed, row, stream, step):
    x = _f32(EDGE_BITS + bits + [0x7FC00000])
    n = x.numel()
    hi, lo, sr = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16), torch.empty(
        n, dtype=torch.bfloat16)
    _rules_kernel[(triton.cdiv(n, 128),)](x, hi, lo, sr, n, seed, row, stream, step, BLOCK=128)
    ref_hi, ref_lo = split_halves(x)
    assert torch.equal(hi.view(torch.int16), ref_hi.view(torch.int16)) and torch.equal(lo, ref_lo)
    ref_sr = stochastic_round(x, seed, row, stream, torch.tensor(float(step)))
    assert torch.equal(sr.view(torch.int16), ref_sr.view(torch.int16))


def test_stochastic_rounding_is_unbiased():
    """The mean of N draws equals x within 5 sigma, sigma = q sqrt(p (1 - p) / N) from the two neighbours (q apart,
    p the chance of rounding away): a false failure has probability < 6e-7 per value."""
    n = 200_000
    for xv in (1.0 + 3 * 2.0**-20, -(1.0 + 2.0**-9 + 2.0**-23), 3.0e-39, 1e4 + 0.3, 1.0 - 2.0**-24):
        x = torch.full((n,), xv, dtype=torch.float32)
        draws = stochastic_round(x, 1234, 0, 0, torch.tensor(7.0)).double()
        exact = float(x[0])
        down, up = sorted(set(draws.tolist()))[:2] if len(set(draws.tolist())) > 1 else (exact, exact)
        q = up - down
        p = abs(exact - down) / q if q else 0.0
        sigma = q * math.sqrt(p * (1 - p) / n)
        assert abs(float(draws.mean()) - exact) <= 5 * sigma + 1e-300, (xv, float(draws.mean()), exact, sigma)
        assert set(draws.tolist()) <= {down, up}


# ------------------------------------------------------------------------------------------------ optimizers

MAKERS = {
    "adam": lambda ps, **k: FusedAdam(ps, lr=1e-2, weight_decay=0.01, **k),
    "lamb": lambda ps, **k: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, **k),
}


def _params(seed: int = 3, sizes: tuple[int, ...] = (4096 + 37, 300, 5)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).bfloat16().requires_grad_() for n in sizes]


def _train(kind: str, mode, steps: int = 4, *, scaler: bool = False, inf_at: int | None = None, ps=None,
           opt=None, grad_seed: int = 7, **kw):
    ps = _params() if ps is None else ps
    opt = MAKERS[kind](ps, master_weights=mode, **kw) if opt is None else opt
    sc = GradScaler("cpu", init_scale=1024.0) if scaler else None
    g = torch.Generator().manual_seed(grad_seed)
    for i in range(steps):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * (1024.0 if scaler else 1.0) * 0.1).bfloat16()
        if inf_at == i:
            ps[1].grad[3] = float("inf")
        scaled_step(opt, sc)
    return ps, opt


def _masters(opt, ps) -> list[torch.Tensor]:
    if opt.bf16_weights == "split":
        return opt.split_masters()
    return [opt.state[p]["master"] for p in ps]


def _assert_same_state(a, b) -> None:
    (pa, oa), (pb, ob) = a, b
    for x, y in zip(_masters(oa, pa), _masters(ob, pb)):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    for key in ("exp_avg", "exp_avg_sq"):
        for x, y in zip(pa, pb):
            assert torch.equal(oa.state[x][key], ob.state[y][key]), key
    assert [float(g["step"]) for g in oa.param_groups] == [float(g["step"]) for g in ob.param_groups]


CASES = [dict(), dict(scaler=True, inf_at=1), dict(inf_at=2, on_nonfinite="skip")]
CASE_IDS = ["plain", "scaler-overflow", "inf-skip"]


@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("masked", [False, True], ids=["host", "masked"])
def test_split_equals_fp32_masters_bit_for_bit_torch_backend(kind, case, masked):
    with use_backend("torch"), masked_commits() if masked else _nothing():
        _assert_same_state(_train(kind, True, **case), _train(kind, "split", **case))


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("case", CASES[:2], ids=CASE_IDS[:2])
@pytest.mark.parametrize("device_step", [True, False], ids=["device-step", "host-vector"])
def test_split_equals_fp32_masters_bit_for_bit_triton(kind, case, device_step, monkeypatch):
    from fp16kit.optim._base import FusedOptimizer

    if not device_step:
        monkeypatch.setattr(FusedOptimizer, "_on_device", lambda self, device: False)
    with use_backend("triton"):
        _assert_same_state(_train(kind, True, **case), _train(kind, "split", **case))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("mode", ["split", "stochastic"])
def test_a_skipped_step_writes_nothing_and_draws_nothing(backend, kind, mode):
    """An overflowing step leaves params, low halves, moments and the step counter (stochastic rounding's counter)
    bit for bit: the run with the skipped step ends exactly where the run without it does."""
    with use_backend(backend):
        ps, opt = _train(kind, mode, steps=2, on_nonfinite="skip", rounding_seed=11 if mode == "stochastic" else None)
        before = [p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict()["state"])
        ps[0].grad[0] = float("nan")
        opt.step()
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(before[0], ps))
        after = opt.state_dict()["state"]
        assert all(torch.equal(before[1][i][k], after[i][k]) for i in after for k in after[i])
        assert float(opt.param_groups[0]["step"]) == 2.0
        _train(kind, mode, steps=2, ps=ps, opt=opt, grad_seed=9)
        ref_ps, _ = _train(kind, mode, steps=2, on_nonfinite="skip", rounding_seed=11 if mode == "stochastic" else None)
        _train(kind, mode, steps=2, ps=ref_ps, opt=_, grad_seed=9)
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(ps, ref_ps))


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("mode", ["split", "stochastic"])
def test_launch_budget_and_no_host_values(kind, mode):
    """The bf16 epilogues add no launch (Adam 2, LAMB 3 per step and dtype group) and the step still makes no
    tensor from host values, copies nothing and reads nothing back."""
    ps = _params(sizes=(64,) * 12)
    for p in ps:
        p.grad = torch.randn(p.shape).bfloat16()
    opt = MAKERS[kind](ps, master_weights=mode, on_nonfinite="skip")
    opt.step()
    opt.step()
    with counting() as (launches, ops):
        opt.step()
    assert sum(launches.values()) == BUDGET[kind], launches
    host = {"aten.lift_fresh", "aten.scalar_tensor", "aten.full", "aten._to_copy", "aten.copy_",
            "aten._local_scalar_dense", "aten.ones", "aten.zeros", "aten.empty"}
    seen = {name.rsplit(".", 1)[0] for name in ops.counts}
    assert not (seen & host), ops.counts


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_stochastic_step_is_unbiased_end_to_end(backend, kind):
    """Every element of one tensor takes the same fp32 update (equal params and grads): the stochastically rounded
    params average to the fp32-master result within 5 sigma (sigma from the two bf16 neighbours)."""
    n = 100_000
    with use_backend(backend):
        results = {}
        for mode in (True, "stochastic"):
            p = torch.full((n,), 1.0 + 2.0**-5, dtype=torch.bfloat16, requires_grad=True)
            opt = MAKERS[kind]([p], master_weights=mode, rounding_seed=5 if mode == "stochastic" else None)
            p.grad = torch.full((n,), 0.37, dtype=torch.bfloat16)
            opt.step()
            results[mode] = opt.state[p]["master"][0].item() if mode is True else p.detach().double()
    exact, draws = results[True], results["stochastic"]
    values = sorted(set(draws.tolist()))
    assert len(values) == 2
    q = values[1] - values[0]
    pr = (exact - values[0]) / q
    sigma = q * math.sqrt(pr * (1 - pr) / n)
    assert 0 < pr < 1 and abs(float(draws.mean()) - exact) <= 5 * sigma


# ------------------------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("mode", ["split", "stochastic"])
def test_checkpoint_resumes_bit_for_bit(kind, mode):
    seed = 3 if mode == "stochastic" else None
    ps, opt = _train(kind, mode, steps=3, rounding_seed=seed)
    saved = copy.deepcopy(opt.state_dict())
    saved_params = [p.detach().clone() for p in ps]
    _train(kind, mode, steps=2, ps=ps, opt=opt, grad_seed=9)
    qs = [p.clone().requires_grad_() for p in saved_params]
    fresh = MAKERS[kind](qs, master_weights=mode, rounding_seed=None if seed is None else 99)
    fresh.load_state_dict(saved)
    _train(kind, mode, steps=2, ps=qs, opt=fresh, grad_seed=9)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(ps, qs))
    if mode == "split":
        _assert_same_state((ps, opt), (qs, fresh))


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_checkpoints_convert_between_split_and_fp32_masters_losslessly(kind):
    # fp32 masters -> split: the params become the masters' high halves, the low halves the rest
    ps, opt = _train(kind, True, steps=3)
    saved, qs = copy.deepcopy(opt.state_dict()), [p.detach().clone().requires_grad_() for p in ps]
    split = MAKERS[kind](qs, master_weights="split")
    split.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(split.split_masters(), [opt.state[p]["master"] for p in ps]))
    _assert_same_state(_train(kind, True, steps=2, ps=ps, opt=opt, grad_seed=9),
                       _train(kind, "split", steps=2, ps=qs, opt=split, grad_seed=9))
    # split -> fp32 masters (the model's params of the same checkpoint loaded first)
    saved, rs = copy.deepcopy(split.state_dict()), [p.detach().clone().requires_grad_() for p in qs]
    master = MAKERS[kind](rs, master_weights=True)
    master.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(split.split_masters(), [master.state[p]["master"] for p in rs]))
    _assert_same_state(_train(kind, "split", steps=2, ps=qs, opt=split, grad_seed=11),
                       _train(kind, True, steps=2, ps=rs, opt=master, grad_seed=11))


# ------------------------------------------------------------------------------------------------ validation


def test_bad_modes_and_params_are_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"Cast the model to torch\.bfloat16"):
        FusedAdam([torch.zeros(3, dtype=torch.float16, requires_grad=True)], master_weights="split")
    with pytest.raises(ValueError, match="'split' or 'stochastic'"):
        FusedLAMB([torch.zeros(3, requires_grad=True)], master_weights="splitt")
    with pytest.raises(ValueError, match="True or False"):
        FusedSGD([torch.zeros(3, requires_grad=True)], lr=0.1, master_weights="split")
    with pytest.raises(ValueError, match="rounding_seed is for"):
        FusedAdam([torch.zeros(3, requires_grad=True)], master_weights=True, rounding_seed=1)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*63\)"):
        FusedAdam([torch.zeros(3, requires_grad=True)], master_weights="stochastic", rounding_seed=-1)
    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = FusedAdam([p], master_weights="split")
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    opt.state[p]["master_low"] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="master_low"):
        opt.step()


def test_fp32_params_beside_bf16_ones_are_updated_directly():
    ps = [torch.randn(50).bfloat16().requires_grad_(), torch.randn(20).requires_grad_()]
    ref = [p.detach().clone().requires_grad_() for p in ps]
    for mode, qs in (("split", ps), (True, ref)):
        opt = FusedAdam(qs, lr=1e-2, master_weights=mode)
        for q in qs:
            q.grad = torch.ones_like(q)
        opt.step()
    assert "master_low" not in opt.state[ref[1]] and torch.equal(ps[1], ref[1])


# ------------------------------------------------------------------------------------------------------- GPU


def _cuda_bf16_twins(kind: str, mode: str):
    g = torch.Generator(device="cuda").manual_seed(1)
    ps = [torch.randn(3000, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(20)]
    ref_ps = [p.detach().clone().requires_grad_() for p in ps]
    for p, r in zip(ps, ref_ps):
        p.grad = (torch.randn(3000, device="cuda", generator=g) * 1e-2).bfloat16()
        r.grad = p.grad.clone()
    lr = torch.tensor(1e-3, device="cuda")
    seed = {"rounding_seed": 5} if mode == "stochastic" else {}
    opt = MAKERS[kind](ps, master_weights=mode, capturable=True, **seed)
    ref = MAKERS[kind](ref_ps, master_weights=mode, capturable=True, **seed)
    for grp in opt.param_groups:
        grp["lr"] = lr
    for grp in ref.param_groups:
        grp["lr"] = lr.clone()
    return ps, opt, ref_ps, ref, lr


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("mode", ["split", "stochastic"])
def test_cuda_graph_capture_replays_equal_eager_bf16_modes(kind, mode):
    """A captured step draws its random bits from the device step counter, so replays equal eager steps bit for bit
    (params, low halves, moments, counters)."""
    from test_device_step import replay_against_eager

    ps, opt, ref_ps, ref, lr = _cuda_bf16_twins(kind, mode)
    replay_against_eager(opt, ref, lr, 4e-3)
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(ps, ref_ps):
        for key in opt.state[a]:
            assert torch.equal(opt.state[a][key], ref.state[b][key]), key
    assert torch.equal(opt.param_groups[0]["step"], ref.param_groups[0]["step"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_cuda_split_equals_fp32_masters_bit_for_bit(kind):
    with torch.device("cuda"):
        ps = [p.detach().cuda().requires_grad_() for p in _params()]
        qs = [p.detach().clone().requires_grad_() for p in ps]
        for mode, xs in ((True, ps), ("split", qs)):
            opt = MAKERS[kind](xs, master_weights=mode)
            g = torch.Generator(device="cuda").manual_seed(2)
            for _ in range(4):
                for x in xs:
                    x.grad = (torch.randn(x.shape, device="cuda", generator=g) * 0.1).bfloat16()
                opt.step()
            if mode is True:
                ref = [opt.state[x]["master"] for x in xs]
            else:
                got = opt.split_masters()
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ref, got))


def test_default_seed_follows_torch_manual_seed():
    seeds = []
    for _ in range(2):
        torch.manual_seed(123)
        seeds.append(FusedAdam([torch.zeros(2, dtype=torch.bfloat16, requires_grad=True)],
                               master_weights="stochastic").param_groups[0]["rounding_seed"])
    assert seeds[0] == seeds[1] and 0 <= seeds[0] < 2**63


def test_amp_master_weights_refuse_the_bf16_modes():
    from fp16kit import amp

    # a bf16 mode needs a bf16 param at construction (else refused there); amp wants the fp32 model back
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = FusedAdam(model.parameters(), master_weights="split")
    model.float()
    with pytest.raises(ValueError, match="without fp32 masters"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_checkpoints_between_the_bf16_modes(kind):
    """A stochastic (or plain bf16) run's checkpoint continues in split mode from its bf16 params exactly (low halves
    0); a split checkpoint loaded without split mode drops the low halves, with a warning naming them."""
    ps, opt = _train(kind, "stochastic", steps=2, rounding_seed=4)
    saved, qs = copy.deepcopy(opt.state_dict()), [p.detach().clone().requires_grad_() for p in ps]
    split = MAKERS[kind](qs, master_weights="split")
    split.load_state_dict(saved)
    assert all(torch.equal(a, b.float()) for a, b in zip(split.split_masters(), ps))
    assert all(int(split.state[q]["master_low"].abs().sum()) == 0 for q in qs)
    _train(kind, "split", steps=1, ps=qs, opt=split)
    saved = copy.deepcopy(split.state_dict())
    plain = MAKERS[kind]([q.detach().clone().requires_grad_() for q in qs], master_weights="stochastic")
    with pytest.warns(RuntimeWarning, match="ignored"):
        plain.load_state_dict(saved)
    assert all("master_low" not in st for st in plain.state.values())


def _hostile_params(seed: int) -> list[torch.Tensor]:
    """Contiguous, transposed (non-contiguous: the fallback's rows beside the kernels'), 0-size and one-element."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 5, generator=g).bfloat16().t().requires_grad_(), torch.randn(300, generator=g).bfloat16()
            .requires_grad_(), torch.zeros(0, dtype=torch.bfloat16, requires_grad=True),
            torch.randn(1, generator=g).bfloat16().requires_grad_()]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@settings(max_examples=12, deadline=None)
@given(kind=st.sampled_from(["adam", "lamb"]), lr=st.floats(1e-4, 1e-1), wd=st.sampled_from([0.0, 0.01, 0.3]),
       adam_w_mode=st.booleans(), b2=st.sampled_from([0.95, 0.999]), scale=st.sampled_from([None, 3.0, 2.0**16]),
       seed=st.integers(0, 1000))
def test_split_equals_fp32_masters_hypothesis(backend, kind, lr, wd, adam_w_mode, b2, scale, seed):
    """Random hyper-parameters, modes and loss scales (a non-power-of-two included), hostile layouts: split's
    reassembled masters, moments and counters are master mode's bit for bit."""
    cls = FusedAdam if kind == "adam" else FusedLAMB
    runs = []
    with use_backend(backend):
        for mode in (True, "split"):
            ps = _hostile_params(seed)
            opt = cls(ps, lr=lr, weight_decay=wd, adam_w_mode=adam_w_mode, betas=(0.9, b2), master_weights=mode)
            g = torch.Generator().manual_seed(seed + 1)
            for _ in range(3):
                for p in ps:
                    p.grad = (torch.randn(p.shape, generator=g) * (scale or 1.0)).bfloat16()
                if scale is not None:
                    opt.grad_scale = torch.full((1,), scale)
                    opt.found_inf = torch.zeros(1)
                opt.step()
            runs.append((ps, opt))
    _assert_same_state(*runs)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_stochastic_step_is_the_rule_applied_to_the_fp32_result(backend, kind):
    """First step from equal params: each stochastically rounded param is ``stochastic_round`` of the fp32-master
    run's master with its row (its position in the group) and the step number: the counters are the module
    docstring's on both backends, also when the rows form two kernel groups (bf16 and fp32 grads: the row table)."""
    g = torch.Generator().manual_seed(8)
    init = [torch.randn(n, generator=g).bfloat16() for n in (300, 41, 17, 1000)]
    grads = [torch.randn(t.shape, generator=g) for t in init]
    out = {}
    with use_backend(backend):
        for mode in (True, "stochastic"):
            ps = [t.clone().requires_grad_() for t in init]
            for i, (p, gr) in enumerate(zip(ps, grads)):
                if i % 2:
                    p.grad_dtype = torch.float32  # torch >= 2.10: fp32 grads of bf16 params need the opt-in
                p.grad = gr.bfloat16() if i % 2 == 0 else gr.clone()
            opt = MAKERS[kind](ps, master_weights=mode, rounding_seed=21 if mode == "stochastic" else None)
            opt.step()
            out[mode] = [opt.state[p]["master"] for p in ps] if mode is True else ps
    for i, (master, p) in enumerate(zip(out[True], out["stochastic"])):
        want = stochastic_round(master, 21, i, 0, torch.tensor(1.0))
        assert torch.equal(p.view(torch.int16), want.view(torch.int16)), i


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_split_with_8bit_moments_equals_fp32_masters_with_8bit_moments(backend, kind):
    """The two epilogues compose (``state_bits=8`` quantizes rows 2-3, the bf16 modes own rows 0 and 4): split with
    8-bit moments keeps 2 + 2 + 2 B/param and its masters are those of ``master_weights=True, state_bits=8`` bit for
    bit; stochastic rounding with 8-bit moments (4 B/param) runs and stays finite."""
    with use_backend(backend):
        a = _train(kind, True, steps=3, state_bits=8)
        b = _train(kind, "split", steps=3, state_bits=8)
        for x, y in zip(_masters(a[1], a[0]), _masters(b[1], b[0])):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32))
        ps, opt = _train(kind, "stochastic", steps=3, state_bits=8, rounding_seed=2)
        assert opt.state[ps[0]]["exp_avg"].dtype == torch.uint8
        assert all(bool(torch.isfinite(p).all()) for p in ps)


def test_stochastic_round_list_offsets_draw_the_whole_tensors_bits():
    """A range of a tensor rounded with its first element's index as offset gets the whole tensor's bits (any
    offset, not only multiples of the 8 elements of a Philox counter)."""
    x = torch.randn(1037, generator=torch.Generator().manual_seed(5))
    y = torch.randn(300, generator=torch.Generator().manual_seed(6))
    step = torch.tensor([3.0])
    whole = stochastic_round_list([x, y], 11, [0, 1], 2, step)
    for cut in (0, 5, 8, 517, 1037):
        parts = stochastic_round_list([x[:cut], y, x[cut:]], 11, [0, 1, 0], 2, step, [0, 0, cut])
        assert torch.equal(torch.cat([parts[0], parts[2]]).view(torch.int16), whole[0].view(torch.int16)), cut
        assert torch.equal(parts[1].view(torch.int16), whole[1].view(torch.int16))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_stochastic_update_of_shards_with_offsets_equals_the_whole_update(backend, kind):
    """``Bf16Weights.offsets`` (an FSDP2 shard's first element in its param): updating the two halves of each tensor
    in two calls, each with its rows' offsets, writes bit for bit the bf16 params of one call over the whole
    tensors (elementwise math: LAMB without a trust ratio or clipping). The cut is not a multiple of 8."""
    from fp16kit.kernels import Bf16Weights, adam_update, lamb_update
    from fp16kit.optim import functional as F

    gen = torch.Generator().manual_seed(8)
    sizes, cuts = (1037, 300), (517, 151)
    p0 = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    g0 = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    step = torch.tensor([2.0])
    common = {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, "bias_correction": True, "step": step,
              "inv_scale64": torch.ones((), dtype=torch.float64), "device": torch.device("cpu")}
    if kind == "adam":
        hp = F.adam_hparams(lr=1e-2, **common)
        kw = {"weight_decay": 0.0, "adam_w_mode": True}
        update = adam_update
    else:
        hp = F.lamb_hparams(lr=1e-2, grad_averaging=True, clip64=torch.ones((), dtype=torch.float64), **common)
        kw = {"weight_decay": 0.0, "adam_w_mode": True, "use_nvlamb": False}
        update = lamb_update

    def run(params, grads, offsets):
        ms = [torch.full(p.shape, 0.1) for p in params]
        vs = [torch.full(p.shape, 0.2) for p in params]
        w = Bf16Weights("stochastic", 77, 1, step, offsets)
        update(params, grads, ms, vs, [None] * len(params), hp, torch.zeros(1), weights=w, **kw)

    with use_backend("torch" if backend == "torch" else "auto"):
        whole = [p.clone() for p in p0]
        run(whole, g0, None)
        lo = [p[:c].clone() for p, c in zip(p0, cuts)]
        hi = [p[c:].clone() for p, c in zip(p0, cuts)]
        run(lo, [g[:c] for g, c in zip(g0, cuts)], None)
        run(hi, [g[c:].clone() for g, c in zip(g0, cuts)], tuple(cuts))
    for w, a, b in zip(whole, lo, hi):
        assert torch.equal(torch.cat([a, b]).view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize("backend, masked", [("torch", False), ("torch", True),
                                             pytest.param("triton", False, marks=pytest.mark.interpreter)],
                         ids=["torch-host", "torch-masked", "triton"])
@pytest.mark.parametrize("skip", [False, True], ids=["step", "skipped"])
def test_staged_lamb_with_the_bf16_epilogues(backend, masked, skip):
    """``lamb_stage1``/``lamb_stage2`` (the sharded LAMB's two stages; FSDP2 all-reduces the sums in between) with
    the bf16 epilogues, trust ratio on: split reassembles the masters (stage 1's ``sum p^2`` from them), updates and
    splits them bit for bit as the stages over fp32 masters do; stochastic rounds the fp32 values those stages compute
    with ``stochastic_round_list``'s bits for the rows' positions and offsets. An fp32 param among the bf16 ones (the
    kernel groups are then not the whole list). A set ``found_inf`` writes nothing."""
    from fp16kit.kernels import Bf16Weights, lamb_stage1, lamb_stage2
    from fp16kit.kernels.bf16_weights.modes import low_rows
    from fp16kit.optim import functional as F

    gen = torch.Generator().manual_seed(21)
    sizes, fp32_row = (300, 37, 5, 11), 2
    bf16 = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    lows = [torch.randint(-32768, 32768, (n,), generator=gen, dtype=torch.int32).to(torch.int16) for n in sizes]
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    masters = [join_halves(p, lo) for p, lo in zip(bf16, lows)]
    masters[fp32_row] = torch.randn(sizes[fp32_row], generator=gen)
    grads[fp32_row] = grads[fp32_row].float()
    step = torch.tensor([3.0])
    hp = F.lamb_hparams(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                        grad_averaging=True, step=step, inv_scale64=torch.ones((), dtype=torch.float64),
                        clip64=torch.full((), 1.5, dtype=torch.float64), device=torch.device("cpu"))

    def staged(params, models, weights):
        m = [torch.full(p.shape, 0.01) for p in params]
        v = [torch.full(p.shape, 0.02) for p in params]
        flag = torch.tensor([1.0 if skip else 0.0])
        with use_backend(backend), masked_commits() if masked else _nothing():
            done = lamb_stage1(params, grads, m, v, models, hp, flag, l2_mode=False, decoupled=True, weights=weights)
            lamb_stage2(done, flag, decoupled=True, trust=True)
        return m + v

    def bits(ts):
        return [t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32) for t in ts]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(bits(a), bits(b)))

    # split: bf16 params + low halves against fp32 masters with bf16 model copies
    ref = [t.clone() for t in masters]
    ref_state = staged(ref, [None if i == fp32_row else t.bfloat16() for i, t in enumerate(ref)], None)
    ps = [masters[i].clone() if i == fp32_row else p.clone() for i, p in enumerate(bf16)]
    lo = [t.clone() for t in lows]
    state = staged(ps, low_rows([None if i == fp32_row else t for i, t in enumerate(lo)]), Bf16Weights("split"))
    got = [p if i == fp32_row else join_halves(p, q) for i, (p, q) in enumerate(zip(ps, lo))]
    assert same(got, ref) and same(state, ref_state)
    assert same(got, masters) == skip

    # stochastic: bf16 params against the fp32 stages started from their widened values, rounded with the twin
    start = [masters[i] if i == fp32_row else p.float() for i, p in enumerate(bf16)]
    ref = [t.clone() for t in start]
    ref_state = staged(ref, [None] * len(ref), None)
    ps = [masters[i].clone() if i == fp32_row else p.clone() for i, p in enumerate(bf16)]
    offsets = (0, 13, 0, 1000)
    weights = Bf16Weights("stochastic", 99, 1, step, offsets)
    state = staged(ps, [None] * len(ps), weights)
    rows = [i for i in range(len(sizes)) if i != fp32_row]
    want = list(ref)
    for i, r in zip(rows, stochastic_round_list([ref[i] for i in rows], 99, rows, 1, step, [offsets[i] for i in rows])):
        want[i] = r
    if skip:
        want = [masters[i] if i == fp32_row else p for i, p in enumerate(bf16)]
    assert same(ps, want) and same(state, ref_state)


@pytest.mark.parametrize("backend, masked", [("torch", False), ("torch", True),
                                             pytest.param("triton", False, marks=pytest.mark.interpreter)],
                         ids=["torch-host", "torch-masked", "triton"])
def test_staged_lamb_split_with_8bit_moments(backend, masked):
    """The sharded LAMB's stages (FSDP2) in split mode with 8-bit moments: stage 1 reads the reassembled masters (its
    ``sum p^2`` and the update) before the 8-bit rule, stage 2 splits them; bit for bit the stages over fp32 masters
    with bf16 model copies and the same 8-bit moments (codes and absmax too). Tensors of 4096 elements and more are
    8-bit, a smaller one keeps fp32 moments."""
    from fp16kit.kernels import Bf16Weights, lamb_stage1, lamb_stage2
    from fp16kit.kernels.bf16_weights.modes import low_rows
    from fp16kit.kernels.state8.rule import to_state8, uses_state8
    from fp16kit.optim import functional as F

    gen = torch.Generator().manual_seed(5)
    sizes = (5000, 300, 4100)
    bf16 = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    lows = [torch.randint(-32768, 32768, (n,), generator=gen, dtype=torch.int32).to(torch.int16) for n in sizes]
    grads = [torch.randn(n, generator=gen).bfloat16() for n in sizes]
    masters = [join_halves(p, lo) for p, lo in zip(bf16, lows)]
    m0 = [torch.randn(n, generator=gen) * 1e-2 for n in sizes]
    v0 = [torch.rand(n, generator=gen) * 1e-3 for n in sizes]
    step = torch.tensor([4.0])
    hp = F.lamb_hparams(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                        grad_averaging=True, step=step, inv_scale64=torch.ones((), dtype=torch.float64),
                        clip64=torch.ones((), dtype=torch.float64), device=torch.device("cpu"))

    def staged(params, models, weights):
        m = [to_state8(x, True) if uses_state8(x) else x.clone() for x in m0]
        v = [to_state8(x, False) if uses_state8(x) else x.clone() for x in v0]
        flag = torch.zeros(1)
        with use_backend(backend), masked_commits() if masked else _nothing():
            done = lamb_stage1(params, grads, m, v, models, hp, flag, l2_mode=False, decoupled=True, weights=weights,
                               state_bits=8)
            lamb_stage2(done, flag, decoupled=True, trust=True)
        return m + v

    ref = [t.clone() for t in masters]
    ref_state = staged(ref, [t.bfloat16() for t in ref], None)
    ps, lo = [p.clone() for p in bf16], [t.clone() for t in lows]
    state = staged(ps, low_rows(lo), Bf16Weights("split"))
    got = [join_halves(p, q) for p, q in zip(ps, lo)]
    assert not all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, masters))  # a step
    for a, b in zip(got, ref):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(state, ref_state):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
