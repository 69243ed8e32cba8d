"""Backend-differential tests of the optimizer steps (issue 9, item 1): the torch fallback
(``use_backend("torch")``), the same fallback with the device-side masked commits it uses off-CPU
(``fb_step.masked_commits``), and the Triton kernels under the interpreter (``use_backend("auto")``
with ``TRITON_INTERPRET=1``, CPU tensors) take one step from the same inputs and must agree.

Hypothesis drives FusedLAMB and FusedAdam (state injected through ``load_state_dict``, so any step counter and
any moments are reachable in one step) and the functional ``lamb_step_``/``adam_step_``: fp32/fp16/bf16 params,
master weights, all-zero params and grads (a zero-initialised bias), ``grad_averaging=False``, ``adam_w_mode``
both ways, ``weight_decay=0`` with and without ``use_nvlamb``, clipping active and inactive, a loss scale that is
not a power of two together with clipping, a ``found_inf`` handed over set or clear, non-contiguous params and
grads, 0-size params. One step per example: differences do not compound.

Budget: each backend's result is checked against the float64 reference (``fp16kit.numerics.reference``)
with the per-element budgets of ``tests/optim/optim_helpers.py`` (fp32 rounding chains at the magnitudes of
the operands — ``g + wd p`` may cancel —, ``gamma(n)`` for the norms and the clip, one ulp of a low-precision
dtype for a stored result), so any two backends agree within twice that budget. A skipped step (``found_inf``
set, inf/NaN grads, a NaN tensor lr) must leave everything bit for bit on every backend. Errors must have the
same class on all of them.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp16kit.kernels import use_backend
from fp16kit.kernels.fallback import step as fb_step
from fp16kit.optim import FusedAdam, FusedLAMB, adam_step_, lamb_step_

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "optim"))
from optim_helpers import (
    adam_step_and_check,
    check_adam_lists,
    check_lamb_lists,
    clip_terms,
    lamb_step_and_check,
)

pytestmark = [
    pytest.mark.interpreter,
    # the interpreter evaluates both arms of tl.where: 0/0 in the unused arm of the trust ratio
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning"),
]

BACKENDS = ("torch", "auto", "masked")
SHAPES = [(1,), (7,), (3, 5), (0,), (2, 0), (64,), (4100,)]
LOW = (torch.float16, torch.bfloat16)


@st.composite
def tensors_case(draw):
    n = draw(st.integers(1, 3))
    shapes = [draw(st.sampled_from(SHAPES)) for _ in range(n)]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    return {
        "shapes": shapes,
        "dtype": dtype,
        "seed": draw(st.integers(0, 2**16)),
        "grad_exp": draw(st.integers(-12, 4)),
        "zero_param": draw(st.sampled_from([None, *range(n)])),
        "zero_grad": draw(st.sampled_from([None, *range(n)])),
        "noncontig": draw(st.booleans()),
        "master": draw(st.booleans()) and dtype in LOW,
        "scale": draw(st.sampled_from([None, 2.0**10, 1000.0])),  # None: no scaler; 1000: not a power of two
        "found_inf": draw(st.sampled_from([None, 0.0, 0.0, 1.0])),
        "step0": draw(st.sampled_from([0, 1, 7, 1000])),
    }


def _make(case):
    """Params (with grads; some transposed views), their injected state, and the handed-over scaler values."""
    gen = torch.Generator().manual_seed(case["seed"])
    dtype = case["dtype"]
    params, state = [], {}
    for i, shape in enumerate(case["shapes"]):
        noncontig = case["noncontig"] and len(shape) == 2
        full = shape[::-1] if noncontig else shape
        p = torch.randn(full, generator=gen, dtype=torch.float64)
        g = torch.randn(full, generator=gen, dtype=torch.float64) * 2.0 ** case["grad_exp"]
        if case["zero_param"] == i:
            p.zero_()
        if case["zero_grad"] == i:
            g.zero_()
        if case["scale"] is not None:
            g = g * case["scale"]
        param = torch.nn.Parameter(p.to(dtype).t() if noncontig else p.to(dtype))
        param.grad = g.to(dtype).t() if noncontig else g.to(dtype)
        params.append(param)
        if case["step0"]:
            m = torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0 ** case["grad_exp"]
            v = m.square() * torch.rand(shape, generator=gen, dtype=torch.float64) * 2
            entry = {"exp_avg": m.float(), "exp_avg_sq": v.float()}
            if case["master"]:
                entry["master"] = param.detach().float() + (torch.rand(shape, generator=gen) - 0.5) * 1e-3 * (
                    param.detach().float().abs()
                )
                with torch.no_grad():
                    param.copy_(entry["master"])
            state[i] = entry
    return params, state


def _written(opt, params):
    """Everything a step may write, by name: params, each param's state, the step counters."""
    out = {("param", i): p.detach().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        for key, t in opt.state.get(p, {}).items():
            out[(key, i)] = t.clone()
    for gi, g in enumerate(opt.param_groups):
        if isinstance(g.get("step"), torch.Tensor):
            out[("step", gi)] = g["step"].clone()
    return out


def _unchanged(before, got_a, got_b):
    """A skipped step: both backends left every tensor bit for bit (no state created either)."""
    for got in (got_a, got_b):
        assert got.keys() == before.keys(), "a skipped step created state"
        for key, x0 in before.items():
            assert torch.equal(got[key], x0), f"a skipped step changed {key}"


@contextlib.contextmanager
def _backend(name):
    """ "torch": the fallback as it runs on CPU (host-decided skip); "masked": the fallback as it runs on a GPU
    (device-side ``torch.where`` commits); "auto": the Triton kernels (interpreter)."""
    with use_backend("torch" if name == "masked" else name):
        if name == "masked":
            with fb_step.masked_commits():
                yield
        else:
            yield


def _skips(case, params) -> bool:
    return case["found_inf"] == 1.0 or any(not bool(torch.isfinite(p.grad).all()) for p in params)


def _run(cls, case, options, backend):
    """One step on ``backend``, checked against the float64 reference unless it is to be skipped."""
    params, state = _make(case)
    opt = cls(params, lr=options["lr"], master_weights=case["master"], on_nonfinite="skip",
              **{k: v for k, v in options.items() if k != "lr"})  # fmt: skip
    if state:
        sd = opt.state_dict()
        sd["state"] = copy.deepcopy(state)
        sd["param_groups"][0]["step"] = torch.tensor([float(case["step0"])])
        opt.load_state_dict(sd)
    if case["scale"] is not None or case["found_inf"] is not None:
        opt.grad_scale = None if case["scale"] is None else torch.tensor(case["scale"])
        opt.found_inf = torch.full((1,), case["found_inf"] or 0.0)
    inv = 1.0 if case["scale"] is None else 1.0 / case["scale"]
    before = _written(opt, params)
    with _backend(backend):
        try:
            if _skips(case, params):
                opt.step()
            elif cls is FusedLAMB:
                lamb_step_and_check(opt, inv_scale=inv)
            else:
                adam_step_and_check(opt, adam_w_mode=options["adam_w_mode"], inv_scale=inv)
        except AssertionError as exc:
            raise AssertionError(f"{backend} backend: {exc}") from None
        except Exception as exc:  # the other backends must raise the same class
            return None, type(exc), before, params
    return _written(opt, params), None, before, params


def _same_errors(run) -> dict | None:
    """``run(backend)`` on every backend: each ``(result, error class, ...)``. All must raise the same error class (or
    none); returns the runs by backend when none raised, None when they all raised."""
    runs = {backend: run(backend) for backend in BACKENDS}
    errors = {backend: r[1] for backend, r in runs.items()}
    assert len(set(errors.values())) == 1, f"error classes differ: {errors}"
    return runs if errors["torch"] is None else None


def _differential(cls, case, options):
    runs = _same_errors(lambda backend: _run(cls, case, options, backend))
    if runs is None:
        return
    got, _, before, params = runs["torch"]
    for backend, (other, *_) in runs.items():
        assert other.keys() == got.keys(), f"{backend} wrote other tensors than torch: {other.keys() ^ got.keys()}"
        if _skips(case, params):
            # lazily created state (zero moments, masters = params) may appear; nothing that existed changes
            for key, x0 in before.items():
                assert torch.equal(other[key], x0), f"{backend}: a skipped step changed {key}"


_SETTINGS = settings(max_examples=40, print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


#: the options FusedAdam and FusedLAMB share, drawn for both
_ADAM_OPTIONS = {
    "lr": st.sampled_from([1e-3, 0.1]),
    "weight_decay": st.sampled_from([0.0, 0.01]),
    "adam_w_mode": st.booleans(),
    "bias_correction": st.booleans(),
}


@_SETTINGS
@given(
    case=tensors_case(),
    grad_averaging=st.booleans(),
    use_nvlamb=st.booleans(),
    max_grad_norm=st.sampled_from([0.0, 1e4, 0.05]),
    **_ADAM_OPTIONS,
)
def test_fused_lamb_backends_agree(case, **options):
    _differential(FusedLAMB, case, options)


@_SETTINGS
@given(case=tensors_case(), **_ADAM_OPTIONS)
def test_fused_adam_backends_agree(case, **options):
    _differential(FusedAdam, case, options)


# ------------------------------------------------------------------------------------------ functional API


def _functional(fn, backend, case, kw):
    """One functional step on ``backend``; checked against the float64 reference unless it is to be skipped."""
    params, state = _make(case)
    masters = [state[i]["master"].clone() if i in state and "master" in state[i] else p.detach().float()
               for i, p in enumerate(params)] if case["master"] else [p.detach().clone() for p in params]  # fmt: skip
    math = [torch.float64 if m.dtype == torch.float64 else torch.float32 for m in masters]
    ms = [state[i]["exp_avg"].clone() if i in state else torch.zeros(m.shape, dtype=d) for i, (m, d) in
          enumerate(zip(masters, math))]  # fmt: skip
    vs = [state[i]["exp_avg_sq"].clone() if i in state else torch.zeros(m.shape, dtype=d) for i, (m, d) in
          enumerate(zip(masters, math))]  # fmt: skip
    models = [p.detach() for p in params] if case["master"] else None
    step = torch.full((1,), float(case["step0"]))
    flag = None if case["found_inf"] is None else torch.full((1,), case["found_inf"])
    inv = 1.0 if case["scale"] is None else 1.0 / case["scale"]
    inv_t = None if case["scale"] is None else torch.tensor(inv, dtype=torch.float64)
    named = lambda: {i: t.clone() for i, t in enumerate(masters + ms + vs + (models or []) + [step])}
    before = named()
    p0, m0, v0 = [m.double() for m in masters], [m.double() for m in ms], [v.double() for v in vs]
    g = [p.grad.double() * inv for p in params]
    before64 = {"p": p0, "g": g, "m": m0, "v": v0}
    with _backend(backend):
        try:
            out = fn(masters, [p.grad for p in params], ms, vs, step=step, model_params=models, inv_scale=inv_t,
                     found_inf=flag, **kw)  # fmt: skip
        except Exception as exc:
            return None, type(exc), before, None
    skipped = float(out) != 0 or bool(step == case["step0"])
    if not skipped:
        hp = {k: v for k, v in kw.items() if k in ("weight_decay",)}
        lr = kw["lr"]
        hp.update(lr=float(lr) if isinstance(lr, torch.Tensor) else lr, betas=(0.9, 0.999), bias_correction=True,
                  step=case["step0"] + 1)  # fmt: skip
        try:
            if fn is lamb_step_:
                hp.update(eps=1e-6, grad_averaging=True)
                check_lamb_lists(before64, masters, ms, vs, hp=hp, max_grad_norm=kw["max_grad_norm"],
                                 norm=clip_terms(g, kw["max_grad_norm"]), adam_w_mode=kw["adam_w_mode"],
                                 use_nvlamb=False)  # fmt: skip
            else:
                hp.update(eps=1e-8)
                check_adam_lists(before64, masters, ms, vs, hp=hp, adam_w_mode=kw["adam_w_mode"])
        except AssertionError as exc:
            raise AssertionError(f"{backend} backend: {exc}") from None
        for model, master in zip(models or [], masters):
            assert torch.equal(model, master.to(model.dtype)), f"{backend}: a model copy is not round(master)"
    return named(), None, before, out


@_SETTINGS
@given(
    case=tensors_case(),
    kind=st.sampled_from(["lamb", "adam"]),
    lr_tensor=st.sampled_from([None, 0.01, float("nan")]),
    weight_decay=st.sampled_from([0.0, 0.1]),
    adam_w_mode=st.booleans(),
)
def test_functional_steps_backends_agree(case, kind, lr_tensor, weight_decay, adam_w_mode):
    fn = lamb_step_ if kind == "lamb" else adam_step_
    lr = 0.01 if lr_tensor is None else torch.tensor([lr_tensor])
    kw = {"lr": lr, "weight_decay": weight_decay, "adam_w_mode": adam_w_mode}
    if kind == "lamb":
        kw["max_grad_norm"] = 0.05
    runs = _same_errors(lambda backend: _functional(fn, backend, case, kw))
    if runs is None:
        return
    _, _, before, flag = runs["torch"]
    for backend, (got, _, _, other_flag) in runs.items():
        assert torch.equal(other_flag, flag), f"{backend}: the returned flag differs"
        if float(flag) != 0 or (lr_tensor is not None and lr_tensor != lr_tensor):
            _unchanged(before, got, got)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p, g, m, v: g.__setitem__(0, torch.zeros(3)),  # a grad of the wrong shape
        lambda p, g, m, v: m.__setitem__(0, torch.zeros(9)),  # a moment of the wrong shape
        lambda p, g, m, v: v.__setitem__(0, torch.zeros(8, dtype=torch.float16)),  # a moment of the wrong dtype
        lambda p, g, m, v: p.__setitem__(0, torch.zeros(8, dtype=torch.int32)),  # not a float tensor
    ],
)
@pytest.mark.parametrize("fn", [lamb_step_, adam_step_])
def test_bad_input_same_error_class_on_both_backends(fn, mutate):
    classes = []
    for backend in ("torch", "auto"):
        p, g, m, v = [torch.ones(8)], [torch.ones(8)], [torch.zeros(8)], [torch.zeros(8)]
        mutate(p, g, m, v)
        with use_backend(backend), pytest.raises((TypeError, ValueError)) as info:
            fn(p, g, m, v, step=torch.zeros(1))
        classes.append(info.type)
    assert classes[0] == classes[1]
