"""Trust, round 3 (issue 22): apex's other optimizers (FusedSGD, FusedAdagrad, FusedNovoGrad) keep the promises
of docs/guarantees.md (section 2.15-2.19). Each test failed on the code before the issue.

Every behaviour test runs on the three implementations of ``tests/differential/test_optim_differential.py``:
``torch`` (the fallback with its host-decided skip, as on CPU), ``masked`` (the fallback with the device-side
``torch.where`` commits it uses off-CPU) and ``auto`` (the Triton kernels under ``TRITON_INTERPRET=1``), and
must give the same verdict on each: the same skip, the same bits left behind, the same error.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fp16kit.amp import GradScaler
from fp16kit.kernels import copy_, unscale_and_check
from fp16kit.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "optim"))
from optim_helpers import assert_same_bits, bits, deep_state
from test_optim_differential import _backend as backend  # torch / masked / auto, as for LAMB and Adam

pytestmark = [pytest.mark.interpreter]

BACKENDS = ("torch", "masked", "auto")
F32_MAX = float(torch.finfo(torch.float32).max)


def _params(shapes=((8,), (2, 3)), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


def _scaler(init_scale, **kw):
    """A GradScaler past its first ``scale()`` (its tracker exists), as in a training loop."""
    scaler = GradScaler(init_scale=init_scale, **kw)
    scaler.scale(torch.ones(()))
    return scaler


def _step(opt, scaler):
    """``opt.step()``, or ``scaler.step(opt)`` and ``scaler.update()`` (a scaler from :func:`_scaler`)."""
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


# ----------------------------------------------------------------------------------------------- item 1


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("how", ["grad_scaler", "own_flag"])
def test_novograd_skipped_first_step_leaves_the_second_moment_to_the_first_step_taken(name, norm_type, how):
    """A first step skipped on the device (a GradScaler's overflow, or an inf grad without one) must not use up
    NovoGrad's one-time ``v = n``: the run continues exactly as a run whose first step is the real one (the bug:
    v blended from 0, the first update ~28x too large)."""
    with backend(name), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        params, ref = _params(), None
        ref = _clone(params)
        opt = FusedNovoGrad(params, lr=0.1, norm_type=norm_type)
        fresh = FusedNovoGrad(ref, lr=0.1, norm_type=norm_type)
        scaler = _scaler(2.0**16) if how == "grad_scaler" else None
        _grads(params, 1, scale=scaler.get_scale() if scaler else 1.0)
        params[0].grad[0] = float("inf")
        _step(opt, scaler)
        assert all(torch.signbit(opt.state[p]["exp_avg_sq"]).all() for p in params), "v marked 'not yet initialised'"
        for k in range(2):  # the first real step initialises v, the second blends it
            _grads(params, 2 + k, scale=scaler.get_scale() if scaler else 1.0)
            _grads(ref, 2 + k)
            _step(opt, scaler)
            fresh.step()
            assert_same_bits(bits(opt, params), bits(fresh, ref))
        assert float(opt.param_groups[0]["step"]) == float(fresh.param_groups[0]["step"]) == 2.0


def test_novograd_init_zero_and_checkpoint_keep_the_marker():
    """``init_zero=True`` starts from 0 whether or not the first step was skipped; the -0.0 marker survives a
    checkpoint (a resumed run still initialises v on its first step taken) and passes the load checks."""
    params = _params()
    opt = FusedNovoGrad(params, lr=0.1, on_nonfinite="skip")
    _grads(params, 1)
    params[1].grad[0, 0] = float("nan")
    opt.step()
    saved = deep_state(opt)
    resumed = _clone(params)
    opt2 = FusedNovoGrad(resumed, lr=0.1)
    opt2.load_state_dict(saved)
    ref = _clone(params)
    fresh = FusedNovoGrad(ref, lr=0.1)
    for ps, o in ((resumed, opt2), (ref, fresh)):
        _grads(ps, 5)
        o.step()
    assert_same_bits(bits(opt2, resumed), bits(fresh, ref))
    z, zr = _params(), None
    zr = _clone(z)
    a = FusedNovoGrad(z, lr=0.1, init_zero=True, on_nonfinite="skip")
    b = FusedNovoGrad(zr, lr=0.1, init_zero=True)
    _grads(z, 1)
    z[0].grad[0] = float("inf")
    a.step()
    _grads(z, 2)
    _grads(zr, 2)
    a.step()
    b.step()
    assert_same_bits(bits(a, z), bits(b, zr))


# ----------------------------------------------------------------------------------------------- item 2

# (make the optimizer, a grad value whose step is taken, then one whose update overflows: every grad finite)
OVERFLOWS = {
    # g * g > fp32 max in the sum of squares (|g| > 1.8e19)
    "adagrad g^2": (lambda ps: FusedAdagrad(ps, lr=0.1), 1.0, 3e19),
    # with L2 decay too
    "adagrad l2": (lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.5), 1.0, 2e19),
    # the param itself: lr * g beyond fp32
    "sgd lr*g": (lambda ps: FusedSGD(ps, lr=1e30), 1.0, 1e10),
    # the momentum buffer: m = 3e38 is finite, then 0.9 m + g is not
    "sgd momentum": (lambda ps: FusedSGD(ps, lr=1e-3, momentum=0.9), 3e38, 3e38),
    # Nesterov's g + momentum * m
    "sgd nesterov": (lambda ps: FusedSGD(ps, lr=1e-3, momentum=0.9, nesterov=True), 1.5e38, 1.5e38),
    # NovoGrad: a per-tensor norm beyond fp32 (v would be inf)
    "novograd norm": (lambda ps: FusedNovoGrad(ps, lr=0.1), 1.0, 3e38),
    # its first moment without grad averaging: m = 0.9 m + g
    "novograd moment": (
        lambda ps: FusedNovoGrad(ps, lr=0.1, norm_type=0, grad_averaging=False, bias_correction=False), 3e38, 3e38
    ),
}


def _fill_grads(params, g):
    for p in params:
        p.grad = torch.full_like(p, g)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", sorted(OVERFLOWS))
def test_finite_grads_that_overflow_the_update_skip_the_step_under_a_grad_scaler(name, case):
    """Finite grads whose update would be inf/NaN: the step is skipped on the device, nothing is written (not
    even the first group), the step counter stays, and the GradScaler backs off as for an inf grad."""
    make, g1, g2 = OVERFLOWS[case]
    with backend(name):
        params = _params()
        other = _params(shapes=((5,),), seed=3)
        opt = make(params)
        opt.add_param_group({"params": other})  # a group that alone would be fine, updated before or after
        for p in other:
            p.grad = torch.ones_like(p)
        scaler = _scaler(1.0, growth_interval=1000)
        _fill_grads(params, g1)  # a step that is taken (state exists, SGD's buffer is used)
        _step(opt, scaler)
        assert scaler.get_scale() == 1.0
        _fill_grads(params, g2)
        before, counters = bits(opt, params + other), [float(gr.get("step", 0)) for gr in opt.param_groups]
        _step(opt, scaler)
        assert_same_bits(bits(opt, params + other), before)
        assert [float(gr.get("step", 0)) for gr in opt.param_groups] == counters
        assert scaler.get_scale() == 0.5, "the scaler must back off as for an inf gradient"
        for t in bits(opt, params + other):
            assert torch.isfinite(t.float()).all()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("cls", [FusedSGD, FusedAdagrad, FusedNovoGrad])
def test_overflowing_update_without_a_scaler_is_reported_per_on_nonfinite(name, cls):
    with backend(name):
        params = _params()
        opt = cls(params, lr=1e-3, on_nonfinite="raise")
        _grads(params, 1)
        opt.step()
        opt.param_groups[0]["weight_decay"] = F32_MAX  # valid, but wd * p overflows for |p| > 1
        with torch.no_grad():
            params[0][0] = 4.0
        before = bits(opt, params)
        with pytest.raises(RuntimeError, match="skipped"):
            opt.step()
        assert_same_bits(bits(opt, params), before)
        opt.on_nonfinite = "warn"
        with pytest.warns(RuntimeWarning, match="skipped"):
            opt.step()
        assert int(opt.nonfinite_skips) == 2 and int(opt.result_skips) == 2
        assert_same_bits(bits(opt, params), before)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("scaler_kind", ["torch", "amp_o2"])
def test_overflowing_update_under_a_scaler_that_cannot_back_off_is_skipped_and_reported(name, scaler_kind):
    """``torch.amp.GradScaler`` hands the optimizer a copy of its flags and the amp frontend updates its scale
    before the step (as apex): neither can back off for an overflow found inside the step. The step is still
    skipped whole, ``result_skips`` counts it and ``on_nonfinite`` reports it."""
    from fp16kit import amp

    with backend(name), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = torch.nn.Linear(4, 3)
        opt = FusedAdagrad(model.parameters(), lr=0.1)
        if scaler_kind == "amp_o2":
            model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, max_loss_scale=1.0)
            params = list(amp.master_params(opt))
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
            params = list(model.parameters())
        for k in range(2):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(k))
            opt.zero_grad()
            loss = model(x.half() if scaler_kind == "amp_o2" else x).float().sum()
            if scaler_kind == "amp_o2":
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                scaler.scale(loss).backward()
            if k == 1:
                for p in params:
                    p.grad.fill_(3e19)  # finite: g * g overflows the sum
            before = bits(opt, list(params))
            expect = pytest.warns(RuntimeWarning, match="would have written inf/NaN")
            with expect if k == 1 else contextlib.nullcontext():
                if scaler_kind == "amp_o2":
                    opt.step()
                else:
                    scaler.step(opt)
                    scaler.update()
        assert_same_bits(bits(opt, list(params)), before)
        assert int(opt.result_skips) == 1
        for t in bits(opt, list(params)):
            assert torch.isfinite(t.float()).all()


@pytest.mark.parametrize("name", BACKENDS)
def test_fp16_param_pushed_past_fp16_range_skips(name):
    """An fp16 param (no master) whose new value rounds to inf in fp16 is a non-finite result too."""
    with backend(name):
        p = torch.nn.Parameter(torch.full((6,), 60000.0, dtype=torch.float16))
        opt = FusedSGD([p], lr=1.0, on_nonfinite="skip")
        p.grad = torch.full_like(p, -10000.0)
        opt.step()
        assert torch.equal(p.detach(), torch.full((6,), 60000.0, dtype=torch.float16))
        assert int(opt.nonfinite_skips) == 1


@pytest.mark.parametrize("name", BACKENDS)
def test_bad_tensor_lr_is_not_a_result_overflow(name):
    """A NaN tensor lr makes every result NaN; it is the optimizer's own ``hparam_skips``, and the result check
    must not raise the scaler's ``found_inf`` for it (the scale does not back off)."""
    with backend(name):
        params = _params()
        opt = FusedAdagrad(params, lr=torch.tensor(0.1), on_nonfinite="skip")
        _grads(params, 1)
        opt.step()
        opt.param_groups[0]["lr"].fill_(float("nan"))
        scaler = _scaler(4.0, growth_interval=1000)
        before = bits(opt, params)
        scaler.step(opt)
        scaler.update()
        assert_same_bits(bits(opt, params), before)
        assert scaler.get_scale() == 4.0 and int(opt.hparam_skips) == 1


# ----------------------------------------------------------------------------------------------- item 3

ABSURD = [
    (FusedSGD, {"lr": 1e308}, "lr"),
    (FusedSGD, {"lr": 0.1, "momentum": 1e300}, "momentum"),
    (FusedSGD, {"lr": 0.1, "momentum": 1.5}, "momentum"),
    (FusedSGD, {"lr": 0.1, "dampening": 2.0}, "dampening"),
    (FusedSGD, {"lr": 0.1, "dampening": -1.0}, "dampening"),
    (FusedSGD, {"lr": 0.1, "weight_decay": 1e300}, "weight_decay"),
    (FusedAdagrad, {"lr": 1e308}, "lr"),
    (FusedAdagrad, {"weight_decay": 1e300}, "weight_decay"),
    (FusedAdagrad, {"eps": 1e300}, "eps"),
    (FusedNovoGrad, {"lr": 1e308}, "lr"),
    (FusedNovoGrad, {"weight_decay": 1e300}, "weight_decay"),
    (FusedNovoGrad, {"betas": (1.5, 0.999)}, "beta"),
    (FusedNovoGrad, {"eps": 1e300}, "eps"),
]


@pytest.mark.parametrize(("cls", "kwargs", "key"), ABSURD)
def test_absurd_host_hyperparameters_are_refused_at_construction_and_at_step(cls, kwargs, key):
    with pytest.raises(ValueError, match=key):
        cls(_params(), **kwargs)
    params = _params()
    opt = cls(params, lr=0.1)
    _grads(params, 1)
    before = bits(opt, params)
    opt.param_groups[0].update({k: v for k, v in kwargs.items()})  # a hand edit or a scheduler
    with pytest.raises(ValueError, match=key):
        opt.step()
    assert_same_bits(bits(opt, params), before)


@pytest.mark.parametrize("name", BACKENDS)
def test_large_but_valid_hyperparameters_are_caught_by_the_result_check(name):
    """lr = fp32 max passes validation (it is a float32); its overflowing update is skipped on the device."""
    with backend(name):
        params = _params()
        opt = FusedSGD(params, lr=0.1, momentum=1.0, on_nonfinite="skip")
        _grads(params, 1)
        opt.step()
        opt.param_groups[0]["lr"] = F32_MAX
        before = bits(opt, params)
        opt.step()
        assert_same_bits(bits(opt, params), before)


# ----------------------------------------------------------------------------------------------- item 4

WRITERS = {
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=0.1),
    "FusedAdam": lambda ps: FusedAdam(ps, lr=0.1),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=0.1),
    "torch.optim.SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "torch.optim.Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "torch.optim.Adam/AdamW": lambda ps: torch.optim.Adam(ps, lr=0.1),
}
READERS = ("FusedSGD", "FusedAdagrad", "FusedNovoGrad", "FusedAdam", "FusedLAMB")
ACCEPTS = {
    "FusedSGD": {"FusedSGD", "torch.optim.SGD"},
    "FusedAdagrad": {"FusedAdagrad", "torch.optim.Adagrad"},
    "FusedNovoGrad": {"FusedNovoGrad"},
    "FusedAdam": {"FusedAdam", "FusedLAMB", "torch.optim.Adam/AdamW"},
    "FusedLAMB": {"FusedAdam", "FusedLAMB", "torch.optim.Adam/AdamW"},
}


@pytest.mark.parametrize(("writer", "reader"), list(itertools.product(WRITERS, READERS)))
@pytest.mark.parametrize("stepped", [True, False])
def test_cross_class_checkpoints_are_refused_naming_both_classes_or_imported(writer, reader, stepped):
    src = _params()
    w = WRITERS[writer](src)
    if stepped:
        _grads(src, 1)
        w.step()
    saved = w.state_dict()
    params = _params(seed=1)
    opt = WRITERS[reader](params)
    _grads(params, 2)
    opt.step()
    before, groups = bits(opt, params), deep_state(opt)["param_groups"]
    if writer in ACCEPTS[reader]:
        opt.load_state_dict(saved)
        opt.step()
        assert all(torch.isfinite(t.float()).all() for t in bits(opt, params))
        return
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(saved)
    message = str(err.value)
    assert reader in message and writer in message, message
    assert_same_bits(bits(opt, params), before)
    assert deep_state(opt)["param_groups"] == groups


def test_torch_adagrad_state_continues_in_fused_adagrad():
    """torch.optim.Adagrad's ``sum`` is FusedAdagrad's: after an import both continue with the same step."""
    params = _params()
    ref = _clone(params)
    torch_opt = torch.optim.Adagrad(ref, lr=0.1, weight_decay=0.01, initial_accumulator_value=0.5)
    for k in range(3):
        _grads(ref, k)
        torch_opt.step()
    fused = FusedAdagrad(params, lr=0.1, weight_decay=0.01)
    with torch.no_grad():
        for p, q in zip(params, ref):
            p.copy_(q)
    fused.load_state_dict(torch_opt.state_dict())
    assert "step" not in fused.state[params[0]] and "lr_decay" not in fused.param_groups[0]
    _grads(ref, 9)
    _grads(params, 9)
    torch_opt.step()
    fused.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=4e-7, atol=1e-7)
        torch.testing.assert_close(fused.state[p]["sum"], torch_opt.state[q]["sum"], rtol=2e-7, atol=0)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01), "lr_decay"),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1, maximize=True), "maximize"),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, maximize=True), "maximize"),
    ],
)
def test_torch_state_with_other_math_fails_at_load(make, match):
    src = _params()
    w = make(src)
    _grads(src, 1)
    w.step()
    cls = FusedSGD if isinstance(w, torch.optim.SGD) else FusedAdagrad
    opt = cls(_params(seed=1), lr=0.1)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(w.state_dict())
    assert not opt.state


def test_torch_adagrad_l2_state_refused_by_decoupled_fused_adagrad():
    src = _params()
    w = torch.optim.Adagrad(src, lr=0.1, weight_decay=0.1)
    _grads(src, 1)
    w.step()
    with pytest.raises(ValueError, match="adagrad_w_mode"):
        FusedAdagrad(_params(seed=1), lr=0.1, weight_decay=0.1, adagrad_w_mode=True).load_state_dict(w.state_dict())


def test_negative_adagrad_sum_in_a_checkpoint_is_refused():
    params = _params()
    opt = FusedAdagrad(params, lr=0.1)
    _grads(params, 1)
    opt.step()
    saved = deep_state(opt)
    saved["state"][0]["sum"][0] = -1.0
    with pytest.raises(ValueError, match=r"'sum'.*negative"):
        FusedAdagrad(_params(), lr=0.1).load_state_dict(saved)


# ----------------------------------------------------------------------------------------------- item 7


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9), "momentum_buffer"),
        (lambda ps: FusedAdagrad(ps, lr=0.1), "sum"),
        (lambda ps: FusedNovoGrad(ps, lr=0.1), "exp_avg"),
    ],
)
def test_same_size_state_of_another_shape_is_refused(make, key):
    """Kills the mutant ``check_state`` comparing numel instead of shape: a (2, 4) state for an (8,) param has
    the right size and must still be refused at load (and at the step, when set by hand)."""
    params = _params(shapes=((8,),))
    opt = make(params)
    _grads(params, 1)
    opt.step()
    saved = deep_state(opt)
    saved["state"][0][key] = saved["state"][0][key].reshape(2, 4)
    fresh = make(_params(shapes=((8,),)))
    with pytest.raises(ValueError, match=rf"{key}.*\(2, 4\).*does not belong"):
        fresh.load_state_dict(saved)
    assert not fresh.state
    opt.state[params[0]][key] = opt.state[params[0]][key].reshape(2, 4)
    with pytest.raises(ValueError, match="does not belong"):
        opt.step()



# ----------------------------------------------------------------------------------------------- item 6


def _leaf_write(backend_name, op):
    """The outcome of one write into a leaf ``nn.Parameter`` on one backend: ("raised", class, message) or
    ("wrote", bits)."""
    with backend(backend_name):
        p = torch.nn.Parameter(torch.zeros(5))
        try:
            op(p)
        except Exception as e:  # compared across backends
            return ("raised", type(e), str(e))
        return ("wrote", p.detach().clone())


LEAF_WRITES = {
    "copy_": lambda p: copy_([p], [torch.arange(5.0)]),
    "unscale out": lambda p: unscale_and_check([torch.arange(5.0)], 0.5, torch.zeros(1), out=[p]),
}


@pytest.mark.parametrize("op", sorted(LEAF_WRITES))
@pytest.mark.parametrize("grad_mode", [True, False])
def test_writing_into_a_leaf_that_requires_grad_gives_the_same_outcome_on_every_backend(op, grad_mode):
    """guarantees.md 1.4: the same result or the same error. With grad mode on both raise torch's in-place
    error (the torch backend did, the Triton kernels wrote); under no_grad both write the same bits."""
    with torch.set_grad_enabled(grad_mode):
        outcomes = [_leaf_write(name, LEAF_WRITES[op]) for name in ("torch", "auto")]
    if grad_mode:
        assert outcomes[0][0] == "raised" and outcomes[0][1] is RuntimeError
        assert "leaf Variable that requires grad" in outcomes[0][2]
        assert outcomes[0] == outcomes[1]
    else:
        assert outcomes[0][0] == outcomes[1][0] == "wrote"
        assert torch.equal(outcomes[0][1], outcomes[1][1])


def test_apex_multi_tensor_scale_still_writes_model_params_like_apex():
    from fp16kit import amp_C

    for name in ("torch", "auto"):
        with backend(name):
            model = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
            amp_C.multi_tensor_scale(2048, torch.zeros(1, dtype=torch.int), [[torch.ones(4)], [model]], 1.0)
            assert torch.equal(model.detach(), torch.ones(4, dtype=torch.float16))


#: the host-vector layout of the SGD/Adagrad kernels' device-step constexprs (tests/optim/apex_optim_helpers.py)
APEX_HP_LEGACY = {"HP_DEVICE": False, "LR_TENSOR": False, "HAS_SCALE": False, "BIAS_CORRECTION": False,
                  "ADVANCE": False, "OWN_FLAG": False, "FIRST": False, "COUNT": False}


@pytest.mark.parametrize(
    ("module", "kernel", "constexprs"),
    [
        ("sgd", "_sgd_kernel", {"WD": True, "WD_AFTER": False, "MOMENTUM": True, "NESTEROV": True,
                                       "FIRST_RUN": False, **APEX_HP_LEGACY}),
        ("adagrad", "_adagrad_kernel", {"L2_MODE": True, "DECOUPLED": False, **APEX_HP_LEGACY}),
        ("novograd", "_novograd_kernel", {"REG_INSIDE": False, **APEX_HP_LEGACY}),
    ],
)
def test_result_check_kernels_compile_for_sm90_and_store_nothing(module, kernel, constexprs):
    """The ``VERIFY`` variants compile for an H100 without a GPU; full chunks are read with 16-byte vector
    loads, and no vector store is left (the pass writes only the flag, with one atomic)."""
    from apex_optim_helpers import compile_for_sm90

    common = {"P_DTYPE": "float32", "G_DTYPE": "float16", "MODEL_DTYPE": "float16", "HAS_MODEL": True,
              "VERIFY": True, "BLOCK": 4096, "ALIGNED": True}
    result = compile_for_sm90(module, {"verify": (kernel, {**common, **constexprs})})["verify"]
    assert result["v4_loads"] > 0 and result["v4_stores"] == 0, result
