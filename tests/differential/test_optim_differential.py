"""Backend-differential tests of the optimizer steps (issue 9, item 1): the torch fallback
(``use_backend("torch")``), the same fallback with the device-side masked commits it uses off-CPU
(``optim_fallback.masked_commits``), and the Triton kernels under the interpreter (``use_backend("auto")``
with ``TRITON_INTERPRET=1``, CPU tensors) take one step from the same inputs and must agree.

Hypothesis drives FusedLAMB and FusedAdam (state injected through ``load_state_dict``, so any step counter and
any moments are reachable in one step) and the functional ``lamb_step_``/``adam_step_``: fp32/fp16/bf16 params,
master weights, all-zero params and grads (a zero-initialised bias), ``grad_averaging=False``, ``adam_w_mode``
both ways, ``weight_decay=0`` with and without ``use_nvlamb``, clipping active and inactive, a loss scale that is
not a power of two together with clipping, a ``found_inf`` handed over set or clear, non-contiguous params and
grads, 0-size params. One step per example: differences do not compound.

Budget (``_budget``), per element of every tensor a step writes (param, master, model copy, moments), with
``x0`` its value before and ``x`` after, ``u`` = 2^-24 and ``n`` the number of gradient elements:
``(16 + 2n) u (|x0| + |x|) + ulp_dtype(x)``. 16 roundings cover two fp32 evaluations of the same chain in
different operation orders (each is within 8 of the exact result, see ``tests/optim/optim_helpers.py``);
``2n u`` covers the two backends' different summation orders in the global norm and the per-tensor norms
(a norm of n squares is within ``gamma(n) ~ n u`` of exact on each side); one ulp of a low-precision dtype
covers a rounding that falls on different sides of a tie. A skipped step (``found_inf`` set, inf/NaN grads)
must leave everything bit for bit on both backends. Errors must have the same class on both.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp16kit.kernels import optim_fallback, use_backend
from fp16kit.numerics import ulp
from fp16kit.optim import FusedAdam, FusedLAMB, adam_step_, lamb_step_

pytestmark = [
    pytest.mark.interpreter,
    # the interpreter evaluates both arms of tl.where: 0/0 in the unused arm of the trust ratio
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning"),
]

U32 = 2.0**-24
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


def _budget(x0: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    a, b = x0.double(), x.double()
    extra = ulp(b, x.dtype) if x.dtype in LOW else torch.zeros_like(b)
    return (16 + 2 * n) * U32 * (a.abs() + b.abs()) + extra


def _compare(before, got_a, got_b, n, what):
    """``got_a`` and ``got_b`` (dicts of written tensors) hold the same tensors, equal within ``_budget``."""
    assert got_a.keys() == got_b.keys(), f"{what}: the backends wrote different tensors"
    for key, a in got_a.items():
        b = got_b[key]
        assert a.dtype == b.dtype and a.shape == b.shape, (what, key)
        if a.numel() == 0:
            continue
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), f"{what}: {key} is not finite"
        err = (a.double() - b.double()).abs()
        budget = _budget(before.get(key, torch.zeros_like(a)), a, n)
        worst = int(torch.argmax(err - budget))
        assert bool((err <= budget).all()), (
            f"{what}: {key} differs between backends beyond the budget at flat index {worst}: "
            f"torch {a.reshape(-1)[worst].item()!r}, triton {b.reshape(-1)[worst].item()!r}, "
            f"budget {budget.reshape(-1)[worst].item():.3g}"
        )


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
            with optim_fallback.masked_commits():
                yield
        else:
            yield


def _run(cls, case, options, backend):
    params, state = _make(case)
    opt = cls(params, lr=options.pop("lr"), master_weights=case["master"], **options)
    if state:
        sd = opt.state_dict()
        sd["state"] = copy.deepcopy(state)
        sd["param_groups"][0]["step"] = torch.tensor([float(case["step0"])])
        opt.load_state_dict(sd)
    if case["scale"] is not None or case["found_inf"] is not None:
        opt.grad_scale = None if case["scale"] is None else torch.tensor(case["scale"])
        opt.found_inf = torch.full((1,), case["found_inf"] or 0.0)
    before = _written(opt, params)
    with _backend(backend):
        try:
            opt.step()
        except Exception as exc:  # the other backend must raise the same class
            return None, type(exc), before
    return _written(opt, params), None, before


def _differential(cls, case, options):
    n = sum(torch.Size(s).numel() for s in case["shapes"])
    got_a, err_a, before = _run(cls, case, dict(options), "torch")
    for other in ("auto", "masked"):
        got_b, err_b, _ = _run(cls, case, dict(options), other)
        assert err_a == err_b, f"error classes differ: torch {err_a}, {other} {err_b}"
        if err_a is not None:
            continue
        if case["found_inf"] == 1.0:
            # lazily created state (zero moments, masters = params) may appear; nothing that existed changes
            for got in (got_a, got_b):
                for key, x0 in before.items():
                    assert torch.equal(got[key], x0), f"a skipped step changed {key}"
            continue
        _compare(before, got_a, got_b, n, f"{cls.__name__} vs {other}: {case} {options}")


_SETTINGS = settings(max_examples=40, print_blob=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(
    case=tensors_case(),
    lr=st.sampled_from([1e-3, 0.1]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    adam_w_mode=st.booleans(),
    grad_averaging=st.booleans(),
    use_nvlamb=st.booleans(),
    max_grad_norm=st.sampled_from([0.0, 1e4, 0.05]),
    bias_correction=st.booleans(),
)
def test_fused_lamb_backends_agree(
    case, lr, weight_decay, adam_w_mode, grad_averaging, use_nvlamb, max_grad_norm, bias_correction
):
    options = {
        "lr": lr,
        "weight_decay": weight_decay,
        "adam_w_mode": adam_w_mode,
        "grad_averaging": grad_averaging,
        "use_nvlamb": use_nvlamb,
        "max_grad_norm": max_grad_norm,
        "bias_correction": bias_correction,
    }
    _differential(FusedLAMB, case, options)


@_SETTINGS
@given(
    case=tensors_case(),
    lr=st.sampled_from([1e-3, 0.1]),
    weight_decay=st.sampled_from([0.0, 0.01]),
    adam_w_mode=st.booleans(),
    bias_correction=st.booleans(),
)
def test_fused_adam_backends_agree(case, lr, weight_decay, adam_w_mode, bias_correction):
    options = {"lr": lr, "weight_decay": weight_decay, "adam_w_mode": adam_w_mode, "bias_correction": bias_correction}
    _differential(FusedAdam, case, options)


# ------------------------------------------------------------------------------------------ functional API


def _functional(fn, backend, case, kw):
    params, state = _make(case)
    masters = [p.detach().float() if case["master"] else p.detach().clone() for p in params]
    ms = [state[i]["exp_avg"].clone() if i in state else torch.zeros_like(m) for i, m in enumerate(masters)]
    vs = [state[i]["exp_avg_sq"].clone() if i in state else torch.zeros_like(m) for i, m in enumerate(masters)]
    ms = [m.reshape(x.shape) for m, x in zip(ms, masters)]
    vs = [v.reshape(x.shape) for v, x in zip(vs, masters)]
    models = [p.detach() for p in params] if case["master"] else None
    step = torch.full((1,), float(case["step0"]))
    flag = None if case["found_inf"] is None else torch.full((1,), case["found_inf"])
    inv = None if case["scale"] is None else torch.tensor(1.0 / case["scale"], dtype=torch.float64)
    named = lambda: {i: t.clone() for i, t in enumerate(masters + ms + vs + (models or []) + [step])}
    before = named()
    with _backend(backend):
        try:
            out = fn(masters, [p.grad for p in params], ms, vs, step=step, model_params=models, inv_scale=inv,
                     found_inf=flag, **kw)  # fmt: skip
        except Exception as exc:
            return None, type(exc), before, None
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
    got_a, err_a, before, flag_a = _functional(fn, "torch", case, kw)
    n = sum(torch.Size(s).numel() for s in case["shapes"])
    for other in ("auto", "masked"):
        got_b, err_b, _, flag_b = _functional(fn, other, case, kw)
        assert err_a == err_b, f"error classes differ: torch {err_a}, {other} {err_b}"
        if err_a is not None:
            continue
        assert torch.equal(flag_a, flag_b)
        if case["found_inf"] == 1.0 or (lr_tensor is not None and lr_tensor != lr_tensor):
            _unchanged(before, got_a, got_b)
            continue
        _compare(before, got_a, got_b, n, f"{kind} vs {other}: {case} {kw}")


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
