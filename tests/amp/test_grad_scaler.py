"""fp16kit.amp.GradScaler against torch.amp.GradScaler: same trajectories, same errors, and the extras.

Parity runs train the same model twice from the same seed, once with each scaler, inject inf/NaN into
the gradients at chosen steps, and compare the scale after every update, which steps were skipped, and
the final parameters bit for bit.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from _host_reads import count_host_reads
from torch import nn

import fp16kit.amp.grad_scaler as gs_module
from fp16kit.amp import GradScaler
from fp16kit.numerics.assertions import assert_bitwise_equal


def ours(**kw):
    kw.setdefault("max_scale", None)  # torch has no cap
    return GradScaler("cpu", **kw)


def theirs(**kw):
    return torch.amp.GradScaler("cpu", **kw)


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}

INJECT = {2: float("inf"), 5: float("nan"), 6: float("-inf"), 11: float("inf")}


def make_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)


def train(
    make_scaler, opt_name, *, dtype=torch.float32, inject=INJECT, clip=False, steps=14, loss_mult=1.0, **scaler_kw
):
    model = make_model(dtype)
    params = list(model.parameters())
    opt = OPTIMIZERS[opt_name](params)
    scaler = make_scaler(**scaler_kw)
    gen = torch.Generator().manual_seed(1)
    scales, stepped = [], []
    for i in range(steps):
        x = torch.randn(5, 6, generator=gen).to(dtype)
        opt.zero_grad(set_to_none=True)
        before = [p.detach().clone() for p in params]
        loss = model(x).float().pow(2).mean() * loss_mult
        scaler.scale(loss).backward()
        if i in inject:
            params[i % len(params)].grad.view(-1)[0] = inject[i]
        if clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(params, 0.05)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, params)))
    return scales, stepped, [p.detach() for p in params]


def assert_same_run(a, b):
    assert a[0] == b[0], "scale trajectories differ"
    assert a[1] == b[1], "skipped steps differ"
    for i, (x, y) in enumerate(zip(a[2], b[2])):
        assert_bitwise_equal(x, y, what=f"param {i}")


# ----------------------------------------------------------------------------- parity with torch
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_training_matches_torch_with_injected_overflows(opt_name):
    kw = dict(init_scale=2.0**12, growth_interval=3)
    mine, ref = train(ours, opt_name, **kw), train(theirs, opt_name, **kw)
    assert_same_run(mine, ref)
    assert [i for i, s in enumerate(mine[1]) if not s] == sorted(INJECT)  # exactly the injected steps skipped
    assert len(set(mine[0])) > 2  # the scale both grew and backed off


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adam_fused"])
def test_training_with_unscale_and_clipping_matches_torch(opt_name):
    kw = dict(init_scale=2.0**10, growth_interval=2)
    assert_same_run(train(ours, opt_name, clip=True, **kw), train(theirs, opt_name, clip=True, **kw))


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_bf16_params_with_natural_overflow_match_torch(opt_name):
    # a scale of 2**127 overflows these bf16 gradients by itself: backoffs in a row, then training with
    # regrowth and renewed overflow, all decided by the values (nothing injected)
    kw = dict(init_scale=2.0**127, growth_interval=4, loss_mult=16.0)
    mine = train(ours, opt_name, dtype=torch.bfloat16, inject={}, **kw)
    assert_same_run(mine, train(theirs, opt_name, dtype=torch.bfloat16, inject={}, **kw))
    assert mine[1][:4] == [False] * 4 and sum(mine[1]) >= 6


def test_two_optimizers_match_torch():
    def run(make):
        model = make_model()
        p1, p2 = list(model[0].parameters()), list(model[2].parameters()) + list(model[4].parameters())
        o1, o2 = torch.optim.SGD(p1, lr=0.1, momentum=0.5), torch.optim.Adam(p2, lr=1e-2)
        scaler = make(init_scale=256.0, growth_interval=2)
        gen = torch.Generator().manual_seed(3)
        scales = []
        for i in range(8):
            o1.zero_grad()
            o2.zero_grad()
            scaler.scale(model(torch.randn(4, 6, generator=gen)).pow(2).mean()).backward()
            if i in (1, 4):
                p1[0].grad[0, 0] = float("inf")  # only the first optimizer overflows: it alone skips
            scaler.step(o1)
            scaler.step(o2)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [True], [p.detach() for p in model.parameters()]

    assert_same_run(run(ours), run(theirs))


def test_set_options_and_new_scale_match_torch():
    def run(make):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make(init_scale=64.0, growth_interval=2)
        scales = []
        for i in range(9):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 6)).sum()).backward()
            scaler.step(opt)
            if i == 2:
                scaler.set_growth_factor(4.0)
                scaler.set_backoff_factor(0.25)
                scaler.set_growth_interval(3)
            if i == 5:
                scaler.update(1024.0)
            elif i == 7:
                scaler.update(torch.tensor(8.0))
            else:
                scaler.update()
            scales.append(scaler.get_scale())
        getters = (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval())
        return scales, getters, [p.detach() for p in model.parameters()]

    assert_same_run(run(ours), run(theirs))


# ----------------------------------------------------------------------------- errors as torch
def outcome(fn):
    try:
        fn()
    except Exception as e:  # the point: same type and message as torch
        return type(e), str(e)
    return None


def misuse(name):
    def run(make):
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make()
        if name == "step_before_scale":
            return outcome(lambda: scaler.step(opt))
        if name == "update_before_scale":
            return outcome(lambda: scaler.update())
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        if name == "unscale_twice":
            scaler.unscale_(opt)
            return outcome(lambda: scaler.unscale_(opt))
        if name == "unscale_after_step":
            scaler.step(opt)
            return outcome(lambda: scaler.unscale_(opt))
        if name == "step_twice":
            scaler.step(opt)
            return outcome(lambda: scaler.step(opt))
        if name == "closure":
            return outcome(lambda: scaler.step(opt, closure=lambda: 0.0))
        if name == "update_without_step":
            return outcome(lambda: scaler.update())
        if name == "new_scale_two_elements":
            scaler.step(opt)
            return outcome(lambda: scaler.update(torch.ones(2)))
        if name == "new_scale_requires_grad":
            scaler.step(opt)
            return outcome(lambda: scaler.update(torch.ones(1, requires_grad=True)))
        if name == "fused_without_grads":  # step is fine (nothing to do); update has no flags
            fused = torch.optim.Adam([nn.Parameter(torch.ones(2))], lr=0.1, fused=True)
            scaler.step(fused)
            return outcome(lambda: scaler.update())
        if name == "load_empty":
            return outcome(lambda: scaler.load_state_dict({}))
        if name == "scale_non_tensor":
            return outcome(lambda: scaler.scale([torch.ones(1), 3]))
        if name == "bad_growth_factor":
            return outcome(lambda: make(growth_factor=1.0))
        if name == "bad_backoff_factor":
            return outcome(lambda: make(backoff_factor=1.5))
        raise AssertionError(name)

    return run


@pytest.mark.parametrize(
    "name",
    [
        "step_before_scale",
        "update_before_scale",
        "unscale_twice",
        "unscale_after_step",
        "step_twice",
        "closure",
        "update_without_step",
        "new_scale_two_elements",
        "new_scale_requires_grad",
        "fused_without_grads",
        "load_empty",
        "scale_non_tensor",
        "bad_growth_factor",
        "bad_backoff_factor",
    ],
)
def test_errors_match_torch(name):
    expected = misuse(name)(theirs)
    assert expected is not None
    assert misuse(name)(ours) == expected


def test_unscale_twice_message_text():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ours()
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last"):
        scaler.unscale_(opt)


# ----------------------------------------------------------------------------- scale()
def test_scale_nested_containers_and_dtypes_as_torch():
    outputs = [torch.tensor(3.0, dtype=torch.float16), (torch.ones(3, dtype=torch.float16), [torch.ones(2)])]
    mine, ref = ours(init_scale=8.0).scale(outputs), theirs(init_scale=8.0).scale(outputs)
    assert isinstance(mine, list) and isinstance(mine[1], tuple) and isinstance(mine[1][1], list)
    flat_m = [mine[0], mine[1][0], mine[1][1][0]]
    flat_r = [ref[0], ref[1][0], ref[1][1][0]]
    for m, r in zip(flat_m, flat_r):
        assert m.dtype == r.dtype and m.shape == r.shape
        assert_bitwise_equal(m, r)
    assert flat_m[0].dtype == torch.float32 and flat_m[1].dtype == torch.float16  # torch's promotion rules
    gen = ours(init_scale=2.0).scale(t for t in [torch.ones(1), torch.ones(2)])
    assert [t.tolist() for t in gen] == [[2.0], [2.0, 2.0]]
    single = ours(init_scale=4.0).scale(torch.tensor(1.5))
    assert single.shape == () and single.item() == 6.0


def test_disabled_scaler_is_a_pass_through():
    scaler = GradScaler(enabled=False)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(1, 3)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    model.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    assert scaler.step(opt) is None  # optimizer.step() ran (an inf grad is not checked)
    assert torch.isinf(model.weight[0, 0])
    scaler.update()
    assert (scaler.get_scale(), scaler.is_enabled(), scaler.state_dict()) == (1.0, False, {})
    scaler.load_state_dict({"scale": 3.0})
    scaler.set_growth_factor(3.0)
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor(), scaler.get_growth_interval()) == (3.0, 0.5, 2000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_warns_once_and_disables(monkeypatch):
    """As torch's GradScaler, disabled; the warning says so once per process, with what it means for fp16 on CPU
    and the scaler to create instead."""
    monkeypatch.setattr(gs_module, "_WARNED_NO_DEVICE", [])
    with pytest.warns(gs_module.GradScalerDisabledWarning,
                      match=r"CUDA is not available, so this scaler is disabled.*underflow.*amp\.GradScaler\(\)"):
        scaler = GradScaler("cuda")
    assert not scaler.is_enabled()
    assert torch.equal(scaler.scale(torch.tensor(3.0)), torch.tensor(3.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not GradScaler("cuda").is_enabled()  # said once


def test_getters_before_first_scale_and_device_following_the_loss():
    scaler = GradScaler(init_scale=32.0, hysteresis=2, min_scale=1.0)
    assert scaler.get_scale() == 32.0 and scaler.loss_scaler is None
    assert (scaler.get_hysteresis(), scaler.get_min_scale(), scaler.get_max_scale()) == (2, 1.0, None)
    scaler.set_max_scale(2.0**10)
    scaler.scale(torch.ones(1))
    assert scaler.loss_scaler.device == torch.device("cpu") and scaler.get_max_scale() == 2.0**10
    with pytest.raises(ValueError, match=r"growth_factor must be > 1\.0"):
        scaler.set_growth_factor(0.5)
    assert scaler.get_growth_factor() == 2.0  # a rejected value changes nothing
    with pytest.raises(ValueError, match=r"min_scale=4096\.0 is larger than max_scale=1024\.0"):
        scaler.set_min_scale(4096.0)
    fresh = GradScaler()
    with pytest.raises(ValueError, match="hysteresis must be an integer >= 1"):
        fresh.set_hysteresis(0)
    fresh.set_hysteresis(3)
    assert fresh.get_hysteresis() == 3 and fresh.state_dict()["_hysteresis_tracker"] == 3
    fresh.set_max_scale(1024.0)  # below the current scale 2**16: a cap limits growth, it never moves a scale
    fresh.scale(torch.ones(1))
    assert fresh.get_scale() == 2.0**16
    later = GradScaler()  # a checkpoint whose bounds exclude this scaler's init_scale
    later.load_state_dict({**fresh.state_dict(), "min_scale": 1.0})
    later.scale(torch.ones(1))
    assert later.state_dict() == {**fresh.state_dict(), "min_scale": 1.0}


# ----------------------------------------------------------------------------- checkpoints
def run_steps(scaler, model, opt, flags):
    for bad in flags:
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 6)).pow(2).sum()).backward()
        if bad:
            next(model.parameters()).grad[0, 0] = float("nan")
        scaler.step(opt)
        scaler.update()
    return scaler.get_scale(), [p.detach().clone() for p in model.parameters()]


def test_state_dict_round_trip_with_hysteresis():
    flags_a, flags_b = [0, 1, 0, 0, 1], [1, 1, 0, 0, 0, 1, 0]
    kw = dict(init_scale=512.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    model, ref_model = make_model(), make_model()
    ref_model.load_state_dict(model.state_dict())
    a = ours(**kw)
    run_steps(a, model, torch.optim.SGD(model.parameters(), lr=0.1), flags_a)
    sd = a.state_dict()
    assert sd["_hysteresis_tracker"] == 1 and sd["_consecutive_skips"] == 1 and sd["hysteresis"] == 2
    b = GradScaler()  # different options: all come from the state dict
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    model_b = make_model()
    model_b.load_state_dict(model.state_dict())
    ra = run_steps(a, model, torch.optim.SGD(model.parameters(), lr=0.1), flags_b)
    rb = run_steps(b, model_b, torch.optim.SGD(model_b.parameters(), lr=0.1), flags_b)
    assert ra[0] == rb[0] and all(torch.equal(x, y) for x, y in zip(ra[1], rb[1]))
    c = pickle.loads(pickle.dumps(a))
    assert c.state_dict() == a.state_dict()


def test_loads_a_torch_state_dict_and_torch_loads_ours():
    model = make_model()
    t = theirs(init_scale=1024.0, growth_interval=3)
    run_steps(t, model, torch.optim.SGD(model.parameters(), lr=0.1), [0, 0, 1, 0])
    mine = ours()
    mine.load_state_dict(t.state_dict())
    assert {k: v for k, v in mine.state_dict().items() if k in t.state_dict()} == t.state_dict()
    assert mine.state_dict()["_hysteresis_tracker"] == 1
    flags = [0, 0, 0, 1, 0, 0]
    m1, m2 = make_model(), make_model()
    r1 = run_steps(t, m1, torch.optim.SGD(m1.parameters(), lr=0.1), flags)
    r2 = run_steps(mine, m2, torch.optim.SGD(m2.parameters(), lr=0.1), flags)
    assert r1[0] == r2[0]
    back = theirs()
    back.load_state_dict(mine.state_dict())
    assert back.state_dict() == {k: mine.state_dict()[k] for k in back.state_dict()}


# ----------------------------------------------------------------------------- fp16 gradients
def test_fp16_grads_unscaled_in_fp32_rounded_once_warning_once():
    model = make_model(torch.float16)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(ValueError, match=r"Attempting to unscale FP16 gradients\."):  # what torch does
        t = theirs()
        t.scale(model(torch.ones(2, 6, dtype=torch.float16)).float().sum()).backward()
        t.unscale_(opt)
    scaler = ours(init_scale=2.0**4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for step in range(2):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 6, dtype=torch.float16)).float().sum()).backward()
            params[0].grad.view(-1)[:2] = torch.tensor([2.0**-22, 3 * 2.0**-24])  # unscale to 2**-26, 3*2**-28
            scaled = [p.grad.clone() for p in params]
            scaler.unscale_(opt)
            for p, g in zip(params, scaled):
                assert_bitwise_equal(p.grad, (g.float() * 2.0**-4).half(), what=f"step {step}")
            assert params[0].grad.view(-1)[:2].tolist() == [0.0, 0.0]  # below 2**-24: flushed, as warned
            scaler.step(opt)
            scaler.update()
    fp16_warnings = [w for w in rec if "float16 gradients" in str(w.message)]
    assert len(fp16_warnings) == 1 and "flush to zero" in str(fp16_warnings[0].message)


def test_fp16_overflow_is_skipped():
    model = make_model(torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ours(init_scale=2.0**20)  # scaled fp16 grads overflow
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 6, dtype=torch.float16)).float().sum()).backward()
    with pytest.warns(UserWarning, match="float16 gradients"):
        scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**19
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ----------------------------------------------------------------------------- sparse gradients
def test_sparse_grads_are_coalesced_and_match_torch_with_unique_indices():
    def run(make):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        scaler = make(init_scale=2.0**8)
        for idx in ([1, 4, 7], [0, 2, 9], [3, 5, 8]):
            opt.zero_grad()
            scaler.scale(emb(torch.tensor(idx)).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
        return [scaler.get_scale()], [True], [emb.weight.detach()]

    assert_same_run(run(ours), run(theirs))


def test_sparse_duplicates_coalesced_before_the_check():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    scaler = ours(init_scale=2.0**8)
    scaler.scale(emb(torch.tensor([2, 2, 5])).sum() * 3.0).backward()
    raw = emb.weight.grad
    assert not raw.is_coalesced()
    expected = raw.coalesce().values() * 2.0**-8
    scaler.unscale_(opt)
    assert emb.weight.grad.is_coalesced()
    assert_bitwise_equal(emb.weight.grad.values(), expected)
    assert emb.weight.grad.values().tolist() == [[6.0] * 3, [3.0] * 3]
    # fp16: two finite duplicate values whose sum overflows only once coalesced
    p = nn.Parameter(torch.zeros(4, 2, dtype=torch.float16))
    p.grad = torch.sparse_coo_tensor(
        [[1, 1]], torch.full((2, 2), 40000.0, dtype=torch.float16), (4, 2), check_invariants=True
    )
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = ours(init_scale=2.0)
    scaler.scale(torch.ones(1))
    with pytest.warns(UserWarning, match="float16 gradients"):
        scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0 and torch.equal(p.detach(), torch.zeros(4, 2, dtype=torch.float16))


# ----------------------------------------------------------------------------- one fused pass per device
@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "general-path"])
def test_one_unscale_and_check_call_per_device_for_mixed_dtypes(monkeypatch, fast):
    # The fast path (CPU, torch fallback) calls torch's op itself; the general path calls unscale_and_check.
    calls = []
    name = "_amp_foreach_non_finite_check_and_unscale_" if fast else "unscale_and_check"
    owner = torch if fast else gs_module
    real = getattr(owner, name)

    def spy(tensors, *args, **kw):
        calls.append(sorted({t.dtype for t in tensors}, key=str))
        return real(tensors, *args, **kw)

    monkeypatch.setattr(owner, name, spy)
    if not fast:
        monkeypatch.setattr(gs_module, "_fast_path_grads", lambda grads, pset: False)
    model = make_model()
    model[2].to(torch.bfloat16)
    model[4].to(torch.float16)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    scaler = ours()
    scaler.scale(torch.ones(1))
    with pytest.warns(UserWarning, match="float16 gradients"):
        scaler.unscale_(torch.optim.SGD(params, lr=0.1))
    assert calls == [[torch.bfloat16, torch.float16, torch.float32]]


# ----------------------------------------------------------------------------- fused optimizers
class RecordingAdam(torch.optim.Adam):
    def step(self, closure=None):
        self.handed = (getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return super().step(closure)


def test_torch_fused_adam_hand_over():
    model = make_model()
    opt = RecordingAdam(model.parameters(), lr=1e-2, fused=True)
    scaler = ours(init_scale=64.0)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    scaler.step(opt)
    grad_scale, found_inf = opt.handed
    assert grad_scale.shape == () and grad_scale.item() == 64.0  # 0-dim, as torch hands them over
    assert found_inf.shape == () and found_inf.item() == 0.0
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    scaler.update()
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    assert opt.handed[0] is None and opt.handed[1].item() == 0.0  # unscaled already: no grad_scale


class FakeFusedSGD(torch.optim.Optimizer):
    """A minimal optimizer speaking fp16kit's protocol: it unscales, checks and skips on the device."""

    _step_supports_amp_scaling = True
    _fp16kit_checks_inf = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.handed = []

    @torch.no_grad()
    def step(self, closure=None):
        grad_scale, found_inf = self.grad_scale, self.found_inf
        self.handed.append((grad_scale, found_inf, found_inf.clone()))
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        inv = grad_scale.double().reciprocal().float() if grad_scale is not None else torch.ones(1)
        grads = [p.grad.float() * inv for p in params]
        bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
        torch.maximum(found_inf, bad, out=found_inf)  # raise the flag handed over
        skip = found_inf > 0
        for p, g in zip(params, grads):
            p.add_(torch.where(skip, torch.zeros_like(g), g), alpha=-self.param_groups[0]["lr"])


def test_fp16kit_protocol_no_check_pass_and_flag_recorded(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("GradScaler ran a check pass for an optimizer that checks inf itself")

    def run(make, fake):
        model = make_model()
        opt = FakeFusedSGD(model.parameters(), lr=0.1) if fake else torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = make(init_scale=2.0**10, growth_interval=2)
        gen = torch.Generator().manual_seed(5)
        scales = []
        for i in range(8):
            opt.zero_grad()
            scaler.scale(model(torch.randn(3, 6, generator=gen)).pow(2).sum()).backward()
            if i in (1, 4, 5):
                model[0].weight.grad[1, 1] = float("nan")
            if fake:
                with monkeypatch.context() as m:
                    m.setattr(gs_module, "unscale_and_check", forbidden)
                    scaler.step(opt)
                grad_scale, _, at_entry = opt.handed[-1]
                assert grad_scale is scaler.loss_scaler.scale  # the scale tensor itself, shape [1]
                assert at_entry.shape == (1,) and at_entry.dtype == torch.float32 and at_entry.item() == 0.0
                assert not hasattr(opt, "found_inf")
            else:
                scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [True], [p.detach() for p in model.parameters()]

    mine = run(ours, fake=True)
    assert_same_run(mine, run(theirs, fake=False))  # the optimizer's own flag drove the backoffs
    assert mine[0][1] == 2.0**9


def test_fp16kit_protocol_after_unscale_gets_the_unscale_flag():
    model = make_model()
    opt = FakeFusedSGD(model.parameters(), lr=0.1)
    scaler = ours(init_scale=8.0)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    model[0].weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    grad_scale, _, at_entry = opt.handed[-1]
    assert grad_scale is None and at_entry.item() == 1.0
    scaler.update()
    assert scaler.get_scale() == 4.0


@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB"])
def test_fp16kit_fused_optimizers_under_grad_scaler(name):
    """The real protocol partner: with a power-of-two scale the scaled grads unscale exactly, so a run under
    the scaler (NaN injected at steps 2 and 5) must equal, bit for bit, an unscaled run that simply leaves
    those steps out, with the scale trajectory and skips of torch's scaler."""
    optim = pytest.importorskip("fp16kit.optim")
    opt_cls = getattr(optim, name)

    def run(scaler):
        model = make_model()
        params = list(model.parameters())
        opt = opt_cls(params, lr=1e-2)
        assert opt._step_supports_amp_scaling and opt._fp16kit_checks_inf
        gen = torch.Generator().manual_seed(1)
        scales = []
        for i in range(8):
            opt.zero_grad()
            loss = model(torch.randn(4, 6, generator=gen)).pow(2).mean()
            if scaler is None:
                loss.backward()
                if i not in (2, 5):
                    opt.step()
                continue
            scaler.scale(loss).backward()
            if i in (2, 5):
                params[0].grad[0, 0] = float("nan")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [p.detach() for p in params]

    scales, mine = run(ours(init_scale=2.0**10, growth_interval=2))
    _, reference = run(None)
    for i, (a, b) in enumerate(zip(mine, reference)):
        assert_bitwise_equal(a, b, what=f"{name} param {i}")
    assert scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 1024.0, 1024.0, 2048.0]


def test_flags_are_combined_with_max_not_sum():
    # torch's CPU fused Adam skips only when found_inf == 1.0: two raised flags must combine to 1, not 2
    flags = [torch.ones(1), torch.zeros(1), torch.ones(1)]
    from fp16kit.kernels import merge_found_inf  # the one helper GradScaler combines its flags with

    assert merge_found_inf(flags, torch.device("cpu")).tolist() == [1.0]
    assert merge_found_inf([], torch.device("cpu")).tolist() == [0.0]


def test_deprecated_grad_scaler_keyword_contract():
    class Old(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.got = grad_scaler

    model = nn.Linear(2, 1)
    opt = Old(model.parameters(), lr=0.1)
    scaler = ours()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    with pytest.warns(FutureWarning, match="stop passing itself"):
        scaler.step(opt)
    assert opt.got is scaler


# ----------------------------------------------------------------------------- host syncs
@pytest.mark.parametrize("kind", ["torch_fused_adam", "fp16kit_protocol"])
def test_fused_paths_never_read_back(kind):
    model = make_model()
    if kind == "fp16kit_protocol":
        opt = FakeFusedSGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler(warn_after_skips=None, hysteresis=2, min_scale=1.0)
    for i in range(4):
        opt.zero_grad()
        scaled = scaler.scale(model(torch.ones(2, 6)).pow(2).sum())
        scaled.backward()
        if i == 2:
            model[0].weight.grad[0, 0] = float("inf")
        with count_host_reads(forbid=True):
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 2.0**16  # one tolerated overflow (hysteresis 2): no backoff


def test_plain_optimizer_step_reads_back_exactly_once():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(warn_after_skips=None)
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    with count_host_reads(forbid=False) as calls:
        scaler.step(opt)  # python must know whether to call optimizer.step()
        scaler.update()
    assert calls == ["item"]


def test_skip_warning_through_grad_scaler():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(warn_after_skips=3, min_scale=2.0**10)
    with pytest.warns(RuntimeWarning, match="3 optimizer steps in a row were skipped"):
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(2, 6)).sum() * float("nan")).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 2.0**13


# ----------------------------------------------------------------------------- real kernels
@pytest.mark.interpreter
def test_end_to_end_with_triton_kernels_in_the_interpreter():
    def run(make):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        model[2].to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = make(init_scale=2.0**8, growth_interval=2)
        scales = []
        for i in range(4):
            opt.zero_grad()
            out = model[2](model[1](model[0](torch.ones(3, 4))).bfloat16())
            scaler.scale(out.float().pow(2).sum()).backward()
            if i == 1:
                model[2].weight.grad[0, 0] = float("nan")
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [True], [p.detach() for p in model.parameters()]

    from fp16kit.kernels.backend import Backend, select_backend

    assert select_backend(torch.device("cpu")).backend is Backend.INTERPRETER
    assert_same_run(run(ours), run(theirs))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_cuda_training_matches_torch(opt_name):
    def run(make):
        model = make_model().cuda()
        params = list(model.parameters())
        opt = OPTIMIZERS[opt_name](params)
        scaler = make(init_scale=2.0**12, growth_interval=3)
        gen = torch.Generator().manual_seed(1)
        scales = []
        for i in range(10):
            opt.zero_grad()
            scaler.scale(model(torch.randn(5, 6, generator=gen).cuda()).pow(2).mean()).backward()
            if i in (2, 5):
                params[0].grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales, [True], [p.detach().cpu() for p in params]

    mine = run(lambda **kw: GradScaler("cuda", max_scale=None, **kw))
    ref = run(lambda **kw: torch.amp.GradScaler("cuda", **kw))
    assert mine[0] == ref[0]
    for a, b in zip(mine[2], ref[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_fused_adam_step_and_update_never_sync():
    model = make_model().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cuda", warn_after_skips=4)
    for i in range(10):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 6, device="cuda")).pow(2).sum()).backward()
        torch.cuda.synchronize()
        # the first iteration builds the kernels' cached address tables (a host-to-device copy)
        torch.cuda.set_sync_debug_mode("error" if i > 0 else 0)
        try:
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert scaler.get_scale() == 2.0**16
