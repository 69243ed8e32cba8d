"""amp O2 with fp16kit's fused optimizers: the masters live in ``optimizer.state[p]["master"]`` and the optimizer
reads the scaled fp16 grads itself (``fp16kit/amp/_frontend/masters.py``, ``FusedMasterStash``).

Every comparison runs the same script twice: on the fused path, and on the stash path (masters swapped into
the param groups, unscaled into fp32 master grads at ``scale_loss`` exit, copied into the model after the
step), which ``keeps_own_masters`` returning False forces for the same optimizer. Why the two agree bit for
bit: the dynamic loss scale is a power of two, so ``fp32(g) * (1/S)`` is exact whether the stash path's
unscale pass or the optimizer's own pass forms it (no fp16 grad times 2**-16 reaches fp32's subnormals); the
optimizer then does the same fp32 arithmetic on the same values, and the fused model write rounds the same
fp32 master to nearest even as the copy pass does. LAMB's global norm is a sum of squares of ``g`` instead of
``g / S``: scaling each term by ``S**-2`` (exact) leaves every partial sum scaled by ``S**-2`` exactly, so
the norm and the clip factor agree bit for bit too. Hence the budget is 0 ulp for power-of-two scales (every
dynamic scale). For a static scale that is not a power of two Adam still forms the same single fp32 product on
both paths (0 ulp, tested); LAMB's norm may then differ by one fp32 rounding, so its budget there would be
1 ulp of the clip factor per step (not asserted).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from frontend_helpers import batch, bits, make_model, roundtrip
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from fp16kit import amp
from fp16kit.amp._frontend import masters
from fp16kit.amp._frontend.masters import MASTERS_KEY, FusedMasterStash, OptimizerStash
from fp16kit.numerics import strategies as fst
from fp16kit.optim import FusedAdam, FusedLAMB

LOW_AND_FP32 = (torch.float16, torch.bfloat16, torch.float32)

OPTIMIZERS = {
    "adam": lambda params: FusedAdam(params, lr=1e-2, weight_decay=0.01),
    "lamb": lambda params: FusedLAMB(params, lr=1e-2, max_grad_norm=1.0),
}


def _setup(kind, *, stash_path=False, monkeypatch=None, seed=0, **kwargs):
    model = make_model(seed)
    opt = OPTIMIZERS[kind](model.parameters())
    if stash_path:
        monkeypatch.setattr(masters, "keeps_own_masters", lambda optimizer: False)
    try:
        model, opt = amp.initialize(model, opt, **{"opt_level": "O2", "verbosity": 0, **kwargs})
    finally:
        if stash_path:
            monkeypatch.undo()
    assert isinstance(opt._amp_stash, OptimizerStash if stash_path else FusedMasterStash)
    return model, opt


def _loss(model, step, inf=False):
    x, y = batch(step)
    loss = F.cross_entropy(model(x), y)
    return loss * float("inf") if inf else loss


def _train(model, opt, steps, *, overflow=(), micro=1, delay=True, clip=None, two_losses=False, closure=False,
           repeat=0, no_zero_grad=False):
    for step in steps:
        if closure:  # the backward runs inside optimizer.step

            def again(step=step):
                opt.zero_grad()
                loss = _loss(model, step, step in overflow)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                return loss

            opt.step(again)
            continue
        if not no_zero_grad:  # else the grads of all steps add up (the fp32 params' ones are kept by scale_loss)
            opt.zero_grad()
        for k in range(micro):
            last = k == micro - 1
            with amp.scale_loss(_loss(model, 10 * step + k, step in overflow), opt,
                                delay_unscale=delay and not last) as scaled:
                scaled.backward()
        if two_losses:
            with amp.scale_loss(_loss(model, 1000 + step), opt, loss_id=1) as scaled:
                scaled.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), clip)
        opt.step()
        for _ in range(repeat):  # a step without a new backward: only the fp32 params move (their grads again)
            opt.step()


def _everything(model, opt):
    out = [bits(p) for p in model.parameters()] + [bits(m) for m in amp.master_params(opt)]
    for p in (q for g in opt.param_groups for q in g["params"]):
        state = opt.state[p]
        out += [bits(state[k]) for k in ("exp_avg", "exp_avg_sq")]
    return [*out, torch.tensor([float(g.get("step", 0)) for g in opt.param_groups])]


def _count_calls(monkeypatch, name):
    """Record the calls of ``masters.<name>`` (a pass over gradients or masters) until monkeypatch.undo(): the
    dtypes of the tensors of its first argument, per call."""
    calls = []
    real = getattr(masters, name)

    def counted(*args, **kwargs):
        calls.append({t.dtype for t in args[0]})
        return real(*args, **kwargs)

    monkeypatch.setattr(masters, name, counted)
    return calls


def _same(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs"


# (training loop, whether the fused path stays fused: several scale_loss exits per step or fp32 master grads
# asked for by amp.master_params run the stash path's plumbing for that step)
SCENARIOS = {
    "plain+overflow": ({"steps": range(3), "overflow": {1}}, True),
    "delay_unscale": ({"steps": range(3), "micro": 3}, True),
    "accumulate": ({"steps": range(3), "micro": 2, "delay": False, "overflow": {1}}, False),
    "clip_master_params": ({"steps": range(3), "clip": 0.05}, False),
    "two_losses": ({"steps": range(3), "two_losses": True}, False),
    "closure": ({"steps": range(3), "closure": True}, False),
    "bf16": ({"steps": range(3), "overflow": {1}}, True),  # low_precision_dtype=torch.bfloat16
    "step_twice": ({"steps": range(3), "repeat": 1}, True),
    "no_zero_grad": ({"steps": range(3), "no_zero_grad": True}, False),
    "O3+master_weights": ({"steps": range(3)}, True),  # every param fp16 and mastered, static scale 1
}
INIT = {
    "two_losses": {"num_losses": 2},
    "bf16": {"low_precision_dtype": torch.bfloat16},
    "O3+master_weights": {"opt_level": "O3", "master_weights": True},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_fused_path_matches_stash_path_bit_for_bit(kind, scenario, monkeypatch):
    kw, stays_fused = SCENARIOS[scenario]
    extra = INIT.get(scenario, {})
    results = []
    for stash_path in (True, False):
        model, opt = _setup(kind, stash_path=stash_path, monkeypatch=monkeypatch, **extra)
        passes = _count_calls(monkeypatch, "unscale_and_check")
        _train(model, opt, **kw)
        monkeypatch.undo()
        if not stash_path:  # fused: only the fp32 params' grads are unscaled (after the step), never fp16 ones
            fp16_unscaled = [dtypes for dtypes in passes if dtypes - {torch.float32}]
            assert (not fp16_unscaled) == stays_fused
        results.append((_everything(model, opt), amp.state_dict()))
    _same(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]  # the same scales, overflows and skip counts


def test_masters_live_in_state_and_no_fp32_master_grad_or_copy_pass(monkeypatch):
    model, opt = _setup("adam")
    low = [p for p in model.parameters() if p.dtype == torch.float16]
    # the groups keep the model params; every fp16 param's master is in its state, from the fp32 initial weights
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert [id(opt.state[p]["master"]) for p in low] == [id(m) for m in opt._amp_stash.masters]
    reference = make_model(0)
    fp32_init = [r.detach() for p, r in zip(model.parameters(), reference.parameters()) if p.dtype == torch.float16]
    assert any(not torch.equal(r, r.half().float()) for r in fp32_init)  # the fp16 rounding would differ
    for p, r in zip(low, fp32_init):
        assert torch.equal(opt.state[p]["master"], r)
    assert [id(m) for m in amp.master_params(opt)][:2] == [id(opt.state[p]["master"]) for p in low[:2]]
    unscales, copies = _count_calls(monkeypatch, "unscale_and_check"), _count_calls(monkeypatch, "copy_")
    before = [bits(p) for p in low]
    for step in range(2):
        opt.zero_grad()
        with amp.scale_loss(_loss(model, step), opt) as scaled:
            scaled.backward()
        assert all(opt.state[p]["master"].grad is None for p in low)  # no fp32 master grad buffer
        assert all(p.grad.dtype == torch.float16 for p in low)  # the scaled fp16 grads wait for the step
        opt.step()
    assert copies == []  # no separate masters -> model pass
    assert all(dtypes == {torch.float32} for dtypes in unscales)  # only the fp32 batchnorm grads, after the step
    assert all(not torch.equal(b, bits(p)) for b, p in zip(before, low))
    for p in low:  # the model param is the rounded master, written by the optimizer's own pass
        assert torch.equal(bits(p), bits(opt.state[p]["master"].half()))


def test_overflow_skips_the_step_and_lowers_the_scale():
    model, opt = _setup("lamb")
    _train(model, opt, steps=range(1))
    before = _everything(model, opt)
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    _train(model, opt, steps=[1], overflow={1})
    _same(_everything(model, opt), before)  # params, masters, moments and the step counter
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scale / 2
    assert opt._amp_stash.session.steps_skipped() == 1


def test_checkpoint_round_trip_uses_the_optimizer_state_and_resumes_bit_identically():
    model, opt = _setup("adam")
    _train(model, opt, steps=range(3))
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    assert MASTERS_KEY not in ckpt["opt"]  # one format: the optimizer's own state
    assert all(entry["master"].dtype == torch.float32 for i, entry in ckpt["opt"]["state"].items() if i in (0, 1, 4, 5))
    _train(model, opt, steps=range(3, 5))
    expected = _everything(model, opt)

    model2, opt2 = _setup("adam", seed=9)
    opt2.load_state_dict(ckpt["opt"])  # optimizer first: the masters are written into the model
    model2.load_state_dict(ckpt["model"])
    amp.load_state_dict(ckpt["amp"])
    _train(model2, opt2, steps=range(3, 5))
    _same(_everything(model2, opt2), expected)


def _old_format_checkpoint(monkeypatch, kind="adam", steps=3):
    """What today's stash path writes for O2 + FusedAdam: state keyed by the masters, masters under the key."""
    model, opt = _setup(kind, stash_path=True, monkeypatch=monkeypatch)
    _train(model, opt, steps=range(steps))
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    assert MASTERS_KEY in ckpt["opt"]
    _train(model, opt, steps=range(steps, steps + 2))
    return ckpt, _everything(model, opt)


@pytest.mark.parametrize("model_first", [True, False])
def test_old_format_checkpoint_loads_into_the_fused_path(monkeypatch, model_first):
    ckpt, expected = _old_format_checkpoint(monkeypatch)
    model, opt = _setup("adam", seed=5)
    if model_first:
        model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    if not model_first:
        model.load_state_dict(ckpt["model"])
    amp.load_state_dict(ckpt["amp"])
    low = [p for p in model.parameters() if p.dtype == torch.float16]
    for pos, p in zip((0, 1, 4, 5), low):
        assert torch.equal(opt.state[p]["master"], ckpt["opt"][MASTERS_KEY][pos])
    _train(model, opt, steps=range(3, 5))
    _same(_everything(model, opt), expected)


def test_old_format_masters_of_params_without_state_are_kept():
    # a torch.optim checkpoint where one fp16 param never had a grad: its master has no moments to sit beside
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    frozen = model[3].bias
    for step in range(2):
        opt.zero_grad()
        with amp.scale_loss(_loss(model, step), opt) as scaled:
            scaled.backward()
        frozen.grad = None
        opt.step()
    sd = roundtrip(opt.state_dict())
    sd["param_groups"][0]["lr"] = 1e-2
    saved = sd[MASTERS_KEY]
    model2, opt2 = _setup("adam", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every master comes from the checkpoint: nothing is rebuilt
        opt2.load_state_dict(sd)
    low = [p for p in model2.parameters() if p.dtype == torch.float16]
    for pos, p in zip((0, 1, 4, 5), low):
        assert torch.equal(opt2.state[p]["master"], saved[pos])
        assert torch.equal(bits(p), bits(saved[pos].half()))  # and written into the model


@pytest.mark.parametrize(
    ("corrupt", "needle"),
    [
        (lambda m: m.__setitem__(0, torch.full_like(m[0], float("nan"))), r"\[0\].*inf/NaN"),
        (lambda m: m.__setitem__(4, m[4][:-1]), r"\[4\].*group 0, index 4.*shape"),
        (lambda m: m.pop(1), r"\[1\].*missing"),
    ],
    ids=["nan", "shape", "missing"],
)
def test_corrupt_old_format_masters_are_rejected_naming_the_key(monkeypatch, corrupt, needle):
    ckpt, _ = _old_format_checkpoint(monkeypatch, steps=2)
    corrupt(ckpt["opt"][MASTERS_KEY])
    model, opt = _setup("adam")
    _train(model, opt, steps=range(1))
    before = _everything(model, opt)
    with pytest.raises((ValueError, RuntimeError), match=MASTERS_KEY + ".*" + needle):
        opt.load_state_dict(ckpt["opt"])
    _same(_everything(model, opt), before)


def test_add_param_group_after_initialize(monkeypatch):
    results = []
    for stash_path in (True, False):
        model = make_model(0)
        opt = FusedAdam(model[0].parameters(), lr=1e-2)
        if stash_path:
            monkeypatch.setattr(masters, "keeps_own_masters", lambda optimizer: False)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        monkeypatch.undo()
        opt.add_param_group({"params": list(model[1].parameters()) + list(model[3].parameters()), "lr": 5e-3})
        if not stash_path:
            assert all("master" in opt.state[p] for p in model[3].parameters())
            assert all("master" not in opt.state[p] for p in model[1].parameters())  # fp32 batchnorm
        _train(model, opt, steps=range(3))
        results.append(_everything(model, opt))
    _same(*results)


def test_backward_outside_scale_loss_warns_once_and_changes_nothing():
    model, opt = _setup("adam")
    before = _everything(model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            _loss(model, step).backward()
            opt.step()
            model.zero_grad()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "amp.scale_loss" in messages[0]
    _same(_everything(model, opt), before)


def test_apex_alias_leaves_the_model_grads_scaled():
    from fp16kit import compat

    compat.install_apex(force=True)
    try:
        from apex.optimizers import FusedAdam as ApexFusedAdam
    finally:
        compat.uninstall_apex()
    model = make_model(0)
    opt = ApexFusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert isinstance(opt._amp_stash, FusedMasterStash)
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    # apex's O2: the fp16 grads as scale_loss left them (scaled), the fp32 (batchnorm) grads unscaled
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    expected = [g if g.dtype == torch.float16 else g / scale for g in grads]
    _same([p.grad for p in model.parameters()], expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_triton_kernels_fused_path_matches_stash_path(kind, monkeypatch):
    # the Triton Adam/LAMB kernels (interpreter) read the fp16 grads with the handed-over scale and write the
    # model copy in their own pass; the stash path runs the same kernels on fp32 master grads plus the copy kernel
    results = []
    for stash_path in (True, False):
        model, opt = _setup(kind, stash_path=stash_path, monkeypatch=monkeypatch)
        _train(model, opt, steps=range(2), overflow={1})
        results.append(_everything(model, opt))
    _same(*results)


@pytest.mark.parametrize("backend", [pytest.param("auto", marks=pytest.mark.interpreter), "torch"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_exit_check_flags_exactly_what_the_unscale_pass_flags(backend, data):
    """The read-only check at ``scale_loss`` exit raises the flag exactly when some ``fp32(g) * inv_scale`` is
    inf/NaN (the stash path's unscale into fp32 master grads): edge values, and values that overflow only
    after the scale (``inv_scale`` up to 2**100), against the float64 reference (the product of two fp32
    values is exact in float64, so rounding it to fp32 is the fp32 product)."""
    from fp16kit.kernels import use_backend

    inv = torch.tensor([data.draw(fst.scales(min_exp=-24, max_exp=100))], dtype=torch.float32)
    grads = [
        data.draw(fst.float_tensors(dtype, edges=fst.EDGE_CLASSES, scale=float(inv), cast_to=torch.float32))
        for dtype in data.draw(st.lists(st.sampled_from(LOW_AND_FP32), min_size=1, max_size=4))
    ]
    expected = any(bool((~torch.isfinite((g.double() * float(inv)).float())).any()) for g in grads)
    flag = torch.zeros(1)
    with use_backend(backend):
        masters._flag_nonfinite(grads, inv, flag)
    assert float(flag) == float(expected)


@pytest.mark.parametrize("reduced", [None, torch.float16], ids=["no-masters-of-its-own", "fp16"])
def test_mixed_precision_lamb_keeps_the_masters_too(reduced, monkeypatch):
    # a FusedLAMB subclass with tensor lr and step; amp switches its masters on whatever it was built with
    from fp16kit.optim import FusedMixedPrecisionLamb

    OPTIMIZERS["mixed"] = lambda p: FusedMixedPrecisionLamb(p, lr=1e-2, reduced_precision_dtype=reduced)
    results = []
    try:
        for stash_path in (True, False):
            model, opt = _setup("mixed", stash_path=stash_path, monkeypatch=monkeypatch)
            _train(model, opt, steps=range(3), overflow={1})
            results.append(_everything(model, opt))
    finally:
        del OPTIMIZERS["mixed"]
    _same(*results)


def test_static_loss_scale_that_is_not_a_power_of_two_adam(monkeypatch):
    # both paths form the same fp32 product fp32(g) * fp32(1/S) once (the inverse rounded once from float64 in
    # both), so Adam agrees bit for bit for any scale. (LAMB's global norm is taken of g and then scaled on the
    # fused path, so for such a scale its clip factor may differ by one fp32 rounding; dynamic scales are powers
    # of two, where it cannot.)
    results = []
    for stash_path in (True, False):
        model, opt = _setup("adam", stash_path=stash_path, monkeypatch=monkeypatch, loss_scale=3.3)
        _train(model, opt, steps=range(3))
        results.append(_everything(model, opt))
    _same(*results)
