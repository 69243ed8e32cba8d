"""Issue 9's optimizer examples as regression tests: hyper-parameters changed after construction, checkpoint
validation and import, rejected param groups, version counters, and the LAMB mutation gaps (item 8).

Every test here failed on the code before the fix (checked by running them against it): the values went into
the weights as NaN, or were silently accepted, or the backends disagreed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from optim_helpers import (
    assert_same_bits,
    bits,
    clone_params,
    deep_state,
    lamb_step_and_check,
    make_params,
    set_grads,
)

from fp16kit.kernels.fallback import lamb as fb_lamb
from fp16kit.numerics.reference import lamb_step
from fp16kit.optim import FusedAdam, FusedLAMB, adam_step_, lamb_step_

OPTIMIZERS = [FusedLAMB, FusedAdam]


def _two_groups(cls, dtype=torch.float32, **kw):
    a, b = make_params([(6,), (2, 3)], dtype, 1), make_params([(5,)], dtype, 2)
    opt = cls([{"params": a}, {"params": b, "lr": 0.02}], lr=0.01, **kw)
    opt.step()
    return a + b, opt


def _all_finite(opt, params):
    return all(bool(torch.isfinite(t).all()) for t in bits(opt, params))


# ------------------------------------------------------------------------- host hyper-parameters at step


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("lr", float("nan"), r"learning rate param_groups\[1\]\['lr'\]=nan"),
        ("lr", float("inf"), r"learning rate param_groups\[1\]\['lr'\]=inf"),
        ("lr", -5.0, r"learning rate param_groups\[1\]\['lr'\]=-5"),
        ("betas", (1.0, 0.999), r"beta1=1.0 in param_groups\[1\]\['betas'\]"),
        ("betas", (0.9, float("nan")), r"beta2=nan in param_groups\[1\]\['betas'\]"),
        ("eps", 0.0, r"param_groups\[1\]\['eps'\]=0.0"),
        ("eps", float("nan"), r"param_groups\[1\]\['eps'\]=nan"),
        ("weight_decay", -0.1, r"param_groups\[1\]\['weight_decay'\]=-0.1"),
    ],
)
def test_invalid_host_hyperparameter_set_after_construction_raises_at_step(cls, key, value, match):
    params, opt = _two_groups(cls)
    opt.param_groups[1][key] = value
    before = bits(opt, params)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert_same_bits(bits(opt, params), before)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_nan_lr_from_a_scheduler_raises_naming_the_group(cls):
    params, opt = _two_groups(cls)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: float("nan") if epoch >= 1 else 1.0)
    sched.step()
    before = bits(opt, params)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]=nan"):
        opt.step()
    assert_same_bits(bits(opt, params), before)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_eps_zero_rejected_at_construction(cls):
    """eps = 0 with a zero grad was 0/0 = NaN in every weight of that param."""
    with pytest.raises(ValueError, match="eps"):
        cls(make_params([(3,)], torch.float32, 0), eps=0.0)
    with pytest.raises(ValueError, match="eps"):
        cls(make_params([(3,)], torch.float32, 0), eps=1e-45)  # 0 in fp32 math


@pytest.mark.parametrize("fn", [lamb_step_, adam_step_])
def test_functional_eps_zero_rejected(fn):
    p, g = [torch.ones(4)], [torch.zeros(4)]
    with pytest.raises(ValueError, match="eps"):
        fn(p, g, [torch.zeros(4)], [torch.zeros(4)], step=torch.zeros(1), eps=0.0)


def test_max_grad_norm_in_group_checked_at_step():
    _params, opt = _two_groups(FusedLAMB)
    opt.param_groups[0]["max_grad_norm"] = float("nan")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['max_grad_norm'\]"):
        opt.step()


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("value", [float("nan"), -1.0, float("inf")])
def test_invalid_step_counter_set_by_hand_raises(cls, value):
    _params, opt = _two_groups(cls)
    opt.param_groups[1]["step"] = torch.tensor([value])
    with pytest.raises(ValueError, match=r"step counter param_groups\[1\]\['step'\]"):
        opt.step()


# ------------------------------------------------------------------------ device hyper-parameters at step


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.01])
def test_bad_tensor_lr_skips_on_the_device(cls, bad):
    params = make_params([(6,), (2, 3)], torch.float32, 3)
    lr = torch.tensor([0.01])
    opt = cls([{"params": params[:1]}, {"params": params[1:], "lr": lr}], lr=0.01)
    opt.step()
    before = bits(opt, params)
    lr.fill_(bad)
    with pytest.warns(RuntimeWarning, match="tensor learning rate"):
        opt.step()
    assert_same_bits(bits(opt, params), before)  # params, state, both groups' step counters
    assert int(opt.hparam_skips) == 1
    lr.fill_(0.01)
    opt.step()
    assert int(opt.hparam_skips) == 1
    assert [int(g["step"]) for g in opt.param_groups] == [2, 2]
    assert _all_finite(opt, params)


def test_bad_tensor_lr_policies():
    params = make_params([(6,)], torch.float32, 4)
    opt = FusedLAMB(params, lr=torch.tensor([float("nan")]), on_nonfinite="raise")
    with pytest.raises(RuntimeError, match="tensor learning rate"):
        opt.step()
    assert not opt.state[params[0]]["exp_avg"].any()
    opt.on_nonfinite = "skip"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert int(opt.hparam_skips) == 2


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_bad_tensor_lr_under_grad_scaler_does_not_back_off_the_scale(cls):
    from fp16kit.amp import GradScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    lr = torch.tensor([0.01])
    opt = cls(model.parameters(), lr=lr)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(5, 4)
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    before = bits(opt, list(model.parameters()))
    lr.fill_(float("nan"))
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    with pytest.warns(RuntimeWarning, match="tensor learning rate"):
        scaler.step(opt)
    scaler.update()
    assert_same_bits(bits(opt, list(model.parameters())), before)
    assert scaler.get_scale() == 2.0**8  # not an overflow: the scale stays


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_bad_tensor_lr_skips_in_the_triton_kernels(cls):
    params = make_params([(300,), (4100,)], torch.float16, 5)
    opt = cls(params, lr=torch.tensor([0.01]), master_weights=True)
    opt.step()
    before = bits(opt, params)
    opt.param_groups[0]["lr"].fill_(float("nan"))
    with pytest.warns(RuntimeWarning, match="tensor learning rate"):
        opt.step()
    assert_same_bits(bits(opt, params), before)


@pytest.mark.parametrize("fn", [lamb_step_, adam_step_])
def test_functional_bad_tensor_lr_skips(fn):
    p = [torch.ones(5)]
    g = [torch.full((5,), 0.5)]
    m, v, step = [torch.zeros(5)], [torch.zeros(5)], torch.zeros(1)
    flag = fn(p, g, m, v, step=step, lr=torch.tensor(float("nan")))
    assert float(flag) == 1.0  # our own flag reports the skip
    assert torch.equal(p[0], torch.ones(5)) and not m[0].any() and float(step) == 0.0
    scaler_flag = torch.zeros(1)
    fn(p, g, m, v, step=step, lr=torch.tensor(-1.0), found_inf=scaler_flag)
    assert float(scaler_flag) == 0.0  # a caller's (loss scaler's) flag is not raised
    assert torch.equal(p[0], torch.ones(5)) and float(step) == 0.0


# ---------------------------------------------------------------------------------------- add_param_group


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_rejected_add_param_group_leaves_optimizer_unchanged(cls):
    params, opt = _two_groups(cls)
    extra = make_params([(4,)], torch.float32, 9)
    groups_before = [dict(g) for g in opt.param_groups]
    state_before = deep_state(opt)
    with pytest.raises(ValueError, match=r"param_groups\[2\]\['lr'\]=-5"):
        opt.add_param_group({"params": extra, "lr": -5})
    assert len(opt.param_groups) == 2
    assert [g["params"] for g in opt.param_groups] == [g["params"] for g in groups_before]
    assert set(opt.state) == set(params)
    assert deep_state(opt)["param_groups"] == state_before["param_groups"]
    before_extra = extra[0].detach().clone()
    opt.step()
    assert torch.equal(extra[0].detach(), before_extra)
    opt.add_param_group({"params": extra, "lr": 0.5})  # a valid group is still accepted
    opt.step()
    assert not torch.equal(extra[0].detach(), before_extra)


# ------------------------------------------------------------------------------------------- checkpoints


def _checkpoint(cls, **kw):
    params = make_params([(6,), (2, 3)], torch.float16 if kw.get("master_weights") else torch.float32, 7)
    opt = cls(params, lr=0.01, **kw)
    for k in range(2):
        opt.step()
        set_grads(params, k)
    return params, opt, deep_state(opt)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda sd: sd["state"][1]["exp_avg"].view(-1).__setitem__(3, float("nan")), r"'exp_avg'.*inf or NaN"),
        (lambda sd: sd["state"][0]["exp_avg"].fill_(float("inf")), r"'exp_avg'.*inf or NaN"),
        (lambda sd: sd["state"][1]["exp_avg_sq"].view(-1).__setitem__(0, float("inf")), r"'exp_avg_sq'.*inf or NaN"),
        (lambda sd: sd["state"][1]["exp_avg_sq"].view(-1).__setitem__(2, -1e-3), r"'exp_avg_sq'.*negative"),
        (lambda sd: sd["param_groups"][0].__setitem__("step", torch.tensor([float("nan")])), r"step counter"),
        (lambda sd: sd["param_groups"][0].__setitem__("step", torch.tensor([-3.0])), r"step counter"),
        (lambda sd: sd["param_groups"][0].__setitem__("lr", float("nan")), r"param_groups\[0\]\['lr'\]"),
        (lambda sd: sd["state"][0].__setitem__("momentum_buffer", torch.zeros(6)), r"'momentum_buffer'"),
        (lambda sd: sd["state"][0].pop("exp_avg_sq"), r"lacks \['exp_avg_sq'\]"),
    ],
)
def test_corrupt_checkpoint_rejected_at_load_and_optimizer_unchanged(cls, corrupt, match):
    params, _opt, saved = _checkpoint(cls)
    corrupt(saved)
    fresh = clone_params(params)
    opt2 = cls(fresh, lr=0.01)
    opt2.step()
    before, groups_before = bits(opt2, fresh), deep_state(opt2)["param_groups"]
    with pytest.raises(ValueError, match=match):
        opt2.load_state_dict(saved)
    assert_same_bits(bits(opt2, fresh), before)
    assert deep_state(opt2)["param_groups"] == groups_before


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_nan_master_in_checkpoint_rejected(cls):
    params, _opt, saved = _checkpoint(cls, master_weights=True)
    saved["state"][0]["master"][1] = float("nan")
    opt2 = cls(clone_params(params), lr=0.01, master_weights=True)
    with pytest.raises(ValueError, match=r"'master'.*inf or NaN"):
        opt2.load_state_dict(saved)
    assert not opt2.state


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_missing_masters_rebuilt_from_params_with_a_warning(cls):
    params, _opt, saved = _checkpoint(cls, master_weights=True)
    for entry in saved["state"].values():
        del entry["master"]
    resumed = clone_params(params)
    opt2 = cls(resumed, lr=0.01, master_weights=True)
    with pytest.warns(RuntimeWarning, match="rebuilt them from the params"):
        opt2.load_state_dict(saved)
    for p in resumed:
        assert torch.equal(opt2.state[p]["master"], p.detach().float())
    opt2.step()  # steps the (rebuilt) masters and writes the rounded copies
    for p in resumed:
        assert torch.equal(p.detach(), opt2.state[p]["master"].to(p.dtype))


def test_masters_dropped_with_a_warning_when_the_optimizer_keeps_none():
    params, _opt, saved = _checkpoint(FusedAdam, master_weights=True)
    opt2 = FusedAdam(clone_params(params), lr=0.01)
    with pytest.warns(RuntimeWarning, match="master_weights=True"):
        opt2.load_state_dict(saved)
    assert all("master" not in s for s in opt2.state.values())


@pytest.mark.parametrize("torch_cls", [torch.optim.AdamW, torch.optim.Adam])
def test_torch_adam_state_loads_into_fused_adam(torch_cls):
    """Used to be accepted, then fail with KeyError: 'bias_correction' at the first step."""
    theirs = make_params([(7,), (3, 4)], torch.float32, 11)
    ref = torch_cls(theirs, lr=0.01, weight_decay=0.01)
    for k in range(3):
        ref.step()
        set_grads(theirs, k)
    sd = deep_state(ref)
    ours = clone_params(theirs)
    opt = FusedAdam(ours, lr=0.5, adam_w_mode=torch_cls is torch.optim.AdamW)
    opt.load_state_dict(sd)
    group = opt.param_groups[0]
    assert group["bias_correction"] is True and group["lr"] == 0.01 and int(group["step"]) == 3
    assert "amsgrad" not in group and "fused" not in group
    for p, q in zip(ours, theirs):
        assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        assert "step" not in opt.state[p]
    # both continue from the same state: within the budget of two fp32 Adam chains (each <= 8 roundings of
    # |p| + |update| per step, tests/optim/optim_helpers.py), accumulated over the steps
    for k in range(1, 4):
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            budget = k * 2 * 8 * 2.0**-24 * (q.detach().abs() + 0.01)
            assert bool(((p.detach() - q.detach()).abs() <= budget).all()), f"step {k}: {p} vs {q}"
        set_grads(ours, 100 + k)
        for p, q in zip(ours, theirs):
            q.grad = p.grad.clone()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.Adam(ps, amsgrad=True), "amsgrad=True"),
        (lambda ps: torch.optim.Adam(ps, maximize=True), "maximize=True"),
        (lambda ps: torch.optim.AdamW(ps, weight_decay=0.1), "adam_w_mode=True"),
    ],
)
def test_torch_adam_state_that_cannot_be_continued_fails_at_load(make, match):
    params = make_params([(5,)], torch.float32, 12)
    ref = make(params)
    ref.step()
    opt = FusedAdam(clone_params(params), adam_w_mode=False)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(deep_state(ref))
    assert not opt.state and "amsgrad" not in opt.param_groups[0]


def test_torch_state_with_different_steps_per_param_fails_at_load():
    params = make_params([(5,), (3,)], torch.float32, 13)
    ref = torch.optim.AdamW(params)
    ref.step()
    params[1].grad = None
    ref.step()
    with pytest.raises(ValueError, match="different numbers of steps"):
        FusedAdam(clone_params(params)).load_state_dict(deep_state(ref))


# ---------------------------------------------------------------------------------------- version counters


def _versions_bumped(cls, dtype, master):
    params = make_params([(300,), (4100,), (3, 7)], dtype, 14)
    opt = cls(params, lr=0.01, master_weights=master)
    opt.step()  # creates the state
    tensors = [*params] + [t for p in params for t in opt.state[p].values()]
    before = [t._version for t in tensors]
    opt.step()
    stale = [i for i, (t, v) in enumerate(zip(tensors, before)) if t._version <= v]
    assert not stale, f"tensors {stale} were written without a version bump"


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize(("dtype", "master"), [(torch.float32, False), (torch.bfloat16, True)])
def test_every_write_bumps_the_version_torch_backend(cls, dtype, master):
    _versions_bumped(cls, dtype, master)


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize(("dtype", "master"), [(torch.float32, False), (torch.bfloat16, True)])
def test_every_write_bumps_the_version_triton(cls, dtype, master):
    _versions_bumped(cls, dtype, master)


@pytest.mark.interpreter
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_autograd_sees_the_step_modify_a_saved_tensor(cls):
    w = torch.nn.Parameter(torch.randn(64))
    loss = (w * w).sum()  # saves w for backward
    w.grad = torch.randn(64)
    cls([w], lr=0.1).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# ------------------------------------------------------------------------- LAMB mutation gaps (item 8)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the interpreter evaluates both where() arms
@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_lamb_kernel_zero_initialised_bias(use_nvlamb):
    """An all-zero param (a zero-initialised bias: |p| = 0) gets ratio = lr, not lr * 0 / |u|; and an all-zero
    update (zero grad, no decay, |u| = 0) keeps its param instead of dividing by 0. Kills ``|`` for ``&``
    in the trust-ratio condition of triton/lamb.py."""
    params = make_params([(300,), (64,), (40,)], torch.float32, 15, zero_params=(1,), zero_grads=(2,))
    opt = FusedLAMB(params, lr=0.01, weight_decay=0.0 if use_nvlamb else 0.01, use_nvlamb=use_nvlamb)
    for k in range(2):
        lamb_step_and_check(opt)
        set_grads(params, 60 + k)
        params[2].grad.zero_()
    assert params[1].detach().abs().min() > 0  # the zero bias moved


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lamb_kernel_without_grad_averaging(dtype):
    """grad_averaging=False: m = b1 m + 1 * g. Kills ``(1 - b1) * g`` for ``beta3 * g`` in stage 1."""
    params = make_params([(300,), (4100,)], dtype, 16)
    opt = FusedLAMB(params, lr=0.01, grad_averaging=False, max_grad_norm=0.0)
    for k in range(2):
        lamb_step_and_check(opt)
        set_grads(params, 70 + k)


@pytest.mark.parametrize("host_branch", [True, False])
def test_lamb_fallback_unscale_and_clip_together(host_branch):
    """inv_scale != 1 and clip != 1 on both fallback paths (the masked one runs off-CPU): g = g * inv / clip.
    Kills the masked path multiplying by the clip factor instead of dividing."""
    params = make_params([(9,), (2, 3)], torch.float32, 17)
    inv_scale, clip = 2.0**-7, 3.5
    grads = [p.grad * 2.0**7 for p in params]
    ms = [torch.full_like(p, 0.01) for p in params]
    vs = [torch.full_like(p, 1e-4) for p in params]
    ps = [p.detach().clone() for p in params]
    b1, b2, lr, wd = 0.9, 0.999, 0.01, 0.01
    bc1, bc2 = 1 - b1**3, 1 - b2**3
    hp = torch.tensor([lr, b1, b2, 1 - b1, 1 - b2, 1e-6, wd, bc1, bc2, inv_scale, clip], dtype=torch.float64)
    fb_lamb.lamb_(
        ps, grads, ms, vs, [None, None], hp.float(), torch.zeros(1),
        l2_mode=False, decoupled=True, trust=True, host_branch=host_branch,
    )  # fmt: skip
    ref_p, ref_m, _ = lamb_step(
        [p.detach() for p in params], [p.grad for p in params], [torch.full_like(p, 0.01) for p in params],
        [torch.full_like(p, 1e-4) for p in params], step=3, lr=lr, weight_decay=wd, max_grad_norm=1.0,
        global_norm=clip,
    )  # fmt: skip
    for got, want in zip(ps + ms, ref_p + ref_m):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------- found by the differential


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_zero_size_param_torch_backend(cls):
    """A 0-size param with a grad crashed the torch backend's check pass (``_foreach_norm`` has no inf-norm of
    an empty tensor) while the Triton path skipped it: found by tests/differential/test_optim_differential.py."""
    empty = torch.nn.Parameter(torch.zeros(0))
    empty.grad = torch.zeros(0)
    params = [empty, *make_params([(3,)], torch.float32, 20)]
    opt = cls(params, lr=0.01)
    opt.step()
    assert int(opt.param_groups[0]["step"]) == 1
    assert cls([empty]).step() is None


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_deepcopy_keeps_the_configuration(cls):
    """torch.optim.Optimizer.__getstate__ keeps only defaults, state and groups: a copied FusedLAMB lost its
    modes (adam_w_mode, master_weights, on_nonfinite, ...) and failed at its first step."""
    import copy

    params = make_params([(6,)], torch.float16, 21)
    opt = cls(params, lr=0.01, adam_w_mode=False, master_weights=True, on_nonfinite="raise")
    opt.step()
    twin = copy.deepcopy(opt)
    assert (twin.adam_w_mode, twin.master_weights, twin.on_nonfinite) == (False, True, "raise")
    twin_params = list(twin.param_groups[0]["params"])
    for q, p in zip(twin_params, params):
        q.grad = p.grad.clone()  # a deep-copied Parameter has no grad
    twin.step()
    opt.step()
    assert_same_bits(bits(twin, twin_params), bits(opt, params))


@pytest.mark.gpu
@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_gpu_bad_tensor_lr_skips_without_a_sync(cls):
    """On CUDA the tensor-lr check and the skip stay on the device; the "warn" report comes one step later."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params([(1000,), (5000,)], torch.float32, 22)]
    for p in params:
        p.grad = torch.randn_like(p)
    lr = torch.full((1,), 0.01, device="cuda")
    opt = cls(params, lr=lr)
    opt.step()
    before = bits(opt, params)
    lr.fill_(float("nan"))
    flag = torch.zeros(1, device="cuda")
    opt.grad_scale, opt.found_inf = torch.ones(1, device="cuda"), flag
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    del opt.grad_scale, opt.found_inf
    assert_same_bits(bits(opt, params), before)
    assert int(opt.hparam_skips) == 1 and float(flag) == 0.0  # the scaler's flag is not raised
    lr.fill_(0.01)
    torch.cuda.synchronize()
    with pytest.warns(RuntimeWarning, match="tensor learning rate"):
        opt.step()  # the pending report of the skipped step
