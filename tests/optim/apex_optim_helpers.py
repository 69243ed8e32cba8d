"""Shared by the tests of apex's other optimizers (FusedSGD, FusedAdagrad, FusedNovoGrad): one step checked
against the float64 references of ``fp16kit.numerics.reference.optim_apex``, from the optimizer's actual state
just before the step (so budgets do not accumulate over steps), with per-element error budgets.

Budgets (fp32 arithmetic, u = 2^-24, K = 8 roundings, as in ``optim_helpers``): every intermediate is bounded by
``K u`` times the *absolute* magnitudes that enter it (sums may cancel), errors of earlier values are carried
through the later operations, and a value stored in fp16/bf16 gets one more ulp of that format. Per-tensor
norms (NovoGrad) have relative error at most ``gamma(n) + K u``.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from hypothesis import strategies as st
from optim_helpers import (
    U32,
    K,
    _stored_budget,
    _updated_tensor,
    assert_within,
    checked_steps,
    clone_params,
    make_params,
    reference_tests,
    set_grads,
    stepped_groups,
)

from fp16kit.kernels import use_backend
from fp16kit.numerics import gamma, ulp
from fp16kit.numerics.reference import adagrad_step, novograd_step, sgd_step

F64 = torch.float64
#: absolute floor of every fp32 budget: results in fp32's subnormal range are rounded to multiples of 2^-149
FLOOR = K * 2.0**-149

#: the param shapes the apex optimizers' Hypothesis tests draw
SHAPES = st.lists(st.sampled_from([(1,), (7,), (3, 5), (2, 3, 4), (64,)]), min_size=1, max_size=3)


def apex_reference_tests(make, step_and_check, hyper: dict, *, examples: int = 40, interpreter_examples: int = 6):
    """An apex optimizer's ``test_matches_reference_*`` pair (``optim_helpers.reference_tests``): steps of
    ``make(params, master_weights=master, **hp)``, each checked by ``step_and_check`` against its float64 reference,
    ``hp`` drawn from the optimizer's own ``hyper`` strategies; the param dtype, seed, masters, grad magnitude
    (``2**grad_exp``) and the zeroed param and/or grad of tensor 0 (``checked_steps``) drawn alike for all."""
    config = {
        "dtype": st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
        "seed": st.integers(0, 2**16),
        **hyper,
        "master": st.booleans(),
        "grad_exp": st.integers(-12, 6),
        "zero": st.sampled_from(["none", "param", "grad", "both"]),
    }

    def run(shapes, seed, dtype, master, grad_exp, zero, steps, **hp):
        factory = partial(make, master_weights=master, **hp)
        checked_steps(factory, step_and_check, shapes, dtype, seed, steps, grad_exp=grad_exp, zero=zero)

    return reference_tests(run, SHAPES, config, examples, interpreter_examples)


def _check_param(opt, p, expected, budget, what):
    budget = budget + FLOOR
    target = _updated_tensor(opt, p)
    assert_within(target, expected, _stored_budget(budget, expected, target.dtype), what)
    if target is not p:  # master-weights mode: the model param is the rounded master, bit for bit
        assert torch.equal(p.detach(), target.to(p.dtype)), f"{what}: model copy is not round(master)"


def sgd_step_and_check(opt) -> None:
    """``opt.step()`` (a FusedSGD) against :func:`sgd_step` from the state before the step."""
    for group, items in stepped_groups(opt, ("momentum_buffer",)):
        hp = {k: group[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov")}
        ref_p, ref_m = sgd_step(
            items["p"], items["g"], items["momentum_buffer"], wd_after_momentum=opt.wd_after_momentum, **hp
        )
        lr, mom, damp, wd = hp["lr"], hp["momentum"], hp["dampening"], hp["weight_decay"]
        for i, p in enumerate(items["params"]):
            p0, g, m0 = items["p"][i], items["g"][i], items["momentum_buffer"][i]
            a = g.abs() + wd * p0.abs()  # magnitude of the decayed gradient
            mag_m = a if m0 is None else mom * m0.abs() + abs(1 - damp) * a
            err_m = K * U32 * mag_m
            direction = a + (mom + 1) * mag_m + wd * p0.abs()
            err_p = K * U32 * (p0.abs() + lr * direction) + lr * (1 + mom) * err_m
            _check_param(opt, p, ref_p[i], err_p, f"param {i}")
            if ref_m[i] is not None:
                assert_within(
                    opt.state[p]["momentum_buffer"], ref_m[i], err_m + U32 * ref_m[i].abs() + FLOOR, f"buf {i}"
                )
            else:
                assert "momentum_buffer" not in opt.state[p]


def adagrad_step_and_check(opt) -> None:
    """``opt.step()`` (a FusedAdagrad) against :func:`adagrad_step` from the state before the step."""
    for group, items in stepped_groups(opt, ("sum",)):
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        h0 = [torch.zeros_like(p) if h is None else h for p, h in zip(items["p"], items["sum"])]
        ref_p, ref_h = adagrad_step(
            items["p"], items["g"], h0, lr=lr, eps=eps, weight_decay=wd, adagrad_w_mode=opt.adagrad_w_mode
        )
        for i, p in enumerate(items["params"]):
            p0, g = items["p"][i], items["g"][i]
            a = g.abs() + (0 if opt.adagrad_w_mode else wd) * p0.abs()
            err_h = K * U32 * (h0[i] + a * a)  # d = g + wd p may cancel: its error is relative to |g| + wd|p|
            den = torch.sqrt(ref_h[i]) + eps
            upd = a / den
            # K roundings at |p| and at the update; the sqrt halves h's relative error: 1 + 0.5 K u relative
            # + the absolute floor of a subnormal g + wd p, divided by the denominator
            err_p = K * U32 * (p0.abs() + 2 * lr * (upd + wd * p0.abs())) + lr * FLOOR / den
            _check_param(opt, p, ref_p[i], err_p, f"param {i}")
            assert_within(opt.state[p]["sum"], ref_h[i], err_h + FLOOR, f"sum {i}")


def novograd_step_and_check(opt) -> None:
    """``opt.step()`` (a FusedNovoGrad) against :func:`novograd_step` from the state before the step."""
    for group, items in stepped_groups(opt, ("exp_avg", "exp_avg_sq")):
        step = int(group["step"].item())
        hp = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "bias_correction", "grad_averaging")}
        hp.update(norm_type=group["norm_type"], init_zero=group["init_zero"])
        m0 = [torch.zeros_like(p) if m is None else m for p, m in zip(items["p"], items["exp_avg"])]
        v0 = [None if v is None else float(v) for v in items["exp_avg_sq"]]
        ref_p, ref_m, ref_v = novograd_step(
            items["p"], items["g"], m0, v0, step=step, reg_inside_moment=opt.reg_inside_moment, **hp
        )
        b1, b2 = hp["betas"]
        bc1 = 1 - b1**step if hp["bias_correction"] else 1.0
        bc2 = math.sqrt(1 - b2**step) if hp["bias_correction"] else 1.0
        beta3 = 1 - b1 if hp["grad_averaging"] else 1.0
        lr, wd = hp["lr"], hp["weight_decay"]
        for i, p in enumerate(items["params"]):
            p0, g = items["p"][i], items["g"][i]
            rel = K * U32 + 2 * gamma(max(1, g.numel()), torch.float32)  # of v, hence of denom
            denom = ref_v[i] / bc2 + hp["eps"]
            if opt.reg_inside_moment:
                d = g.abs() / denom + wd * p0.abs()
                err_d = g.abs() / denom * rel + K * U32 * d
                err_m = K * U32 * (b1 * m0[i].abs() + beta3 * d) + beta3 * err_d
                err_u = err_m / bc1 + K * U32 * ref_m[i].abs() / bc1
                u_mag = ref_m[i].abs() / bc1
            else:
                err_m = K * U32 * (b1 * m0[i].abs() + beta3 * g.abs())
                q = ref_m[i].abs() / bc1 / denom
                err_u = err_m / bc1 / denom + q * rel + K * U32 * (q + wd * p0.abs())
                u_mag = q + wd * p0.abs()
            err_p = K * U32 * (p0.abs() + lr * u_mag) + lr * err_u + lr * FLOOR / denom / bc1
            _check_param(opt, p, ref_p[i], err_p, f"param {i}")
            assert_within(opt.state[p]["exp_avg"], ref_m[i], err_m + U32 * ref_m[i].abs() + FLOOR, f"exp_avg {i}")
            v = torch.tensor([ref_v[i]], dtype=F64)
            # squares below fp32's smallest subnormal vanish from the norm: sqrt(n 2^-149) absolute at most
            lost = math.sqrt(g.numel() * 2.0**-149)
            assert_within(opt.state[p]["exp_avg_sq"], v, rel * v.abs() + U32 * v.abs() + lost, f"exp_avg_sq {i}")


def restart_torch_from(opt, ref, ours, theirs, seed: int, key: str) -> None:
    """New grads for ``ours`` (``set_grads(ours, seed)``) and torch's optimizer ``ref`` restarted from our state:
    ``theirs`` get our params and grads, ``ref.state[q][key]`` our ``opt.state[p][key]`` where we keep one (the
    differential tests against torch.optim, so each step is compared from the same state)."""
    set_grads(ours, seed)
    for p, q in zip(ours, theirs):
        q.grad = p.grad.clone()
        with torch.no_grad():
            q.copy_(p)
        if opt.state[p].get(key) is not None:
            ref.state[q][key].copy_(opt.state[p][key])


def step_both_backends(make, step_and_check, dtype: torch.dtype, seed: int, steps: int = 2) -> dict:
    """The same params (tensors of 4100 elements span two chunks) stepped by ``make``'s optimizer on the default
    backend (the Triton kernels; the interpreter without a GPU) and on the torch fallback, every step of both
    checked against the reference by ``step_and_check``. Returns the two optimizers and param lists
    (``opt``, ``params``; ``fb``, ``twin``) and the fallback's params and grads in float64 just before its last
    step (``before``, ``grads``)."""
    params = make_params([(300,), (4100,), (3, 7)], dtype, seed)
    twin = clone_params(params)
    opt, fb = make(params), make(twin)
    for k in range(steps):
        before, grads = [q.detach().double() for q in twin], [q.grad.double() for q in twin]
        step_and_check(opt)
        with use_backend("torch"):
            step_and_check(fb)
        set_grads(params, 10 + k)
        set_grads(twin, 10 + k)
    return {"opt": opt, "params": params, "fb": fb, "twin": twin, "before": before, "grads": grads}


def assert_backends_agree(run: dict, dtype: torch.dtype, budget) -> None:
    """Each param of :func:`step_both_backends`'s kernel run within ``budget(i, q64)`` of the fallback's (``q64``:
    its float64 value), plus an ulp of ``dtype`` when stored in fp16/bf16 (the two may round to neighbours)."""
    for i, (p, q) in enumerate(zip(run["params"], run["twin"])):
        q64 = q.detach().double()
        b = budget(i, q64)
        if dtype != torch.float32:
            b = b + ulp(q64, dtype)
        assert_within(p, q64, b, f"param {i}: kernel vs fallback")


# ------------------------------------------------------------------------------------------------------------
# contracts every fused optimizer keeps; each test file calls these with its own factory ``make(params)``


def _model(seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def _data() -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(1))


#: per dtype: 0, -0, a subnormal, tiny, 1, and magnitudes near the top of the range that still square in fp32
EDGE_VALUES = {
    torch.float32: [0.0, -0.0, 1e-40, -3e-39, 1e-30, 1.0, -2.5, 3e15, -1e17],
    torch.float16: [0.0, -0.0, 6e-8, -3e-6, 1e-4, 1.0, -2.5, 6e4, -6.5e4],
    torch.bfloat16: [0.0, -0.0, 1e-39, -3e-39, 1e-30, 1.0, -2.5, 3e15, -1e17],
}


def edge_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Params and grads made of ``EDGE_VALUES`` in several arrangements (values meet every other value), plus an
    all-zero-gradient tensor and an all-zero param."""
    vals = torch.tensor(EDGE_VALUES[dtype], dtype=F64)
    n = vals.numel()
    out = []
    for shift in (0, 3, 5):
        p = torch.nn.Parameter(vals.to(dtype))
        p.grad = vals.roll(shift).flip(0).to(dtype)
        out.append(p)
    zero_grad = torch.nn.Parameter(vals.to(dtype))
    zero_grad.grad = torch.zeros(n, dtype=dtype)
    zero_param = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
    zero_param.grad = vals.to(dtype)
    return [*out, zero_grad, zero_param]


def check_edge_values(make, step_and_check, dtype: torch.dtype, steps: int = 2) -> None:
    """``steps`` checked steps on ``edge_params``: finite, and within budget of the float64 reference."""
    params = edge_params(dtype)
    opt = make(params)
    for _ in range(steps):
        step_and_check(opt)


def check_nonfinite_grad_skips(make, dtype: torch.dtype = torch.float16) -> None:
    """A NaN or inf gradient skips the whole step (params, every state tensor, step counters keep their bits)
    and warns; so does a ``found_inf`` set by a caller."""
    import pytest
    from optim_helpers import assert_step_skipped, make_params, set_grads

    params = make_params([(5,), (2, 3)], dtype, 1)
    opt = make(params)
    opt.step()
    for bad in (float("nan"), float("inf")):
        set_grads(params, 2)
        params[1].grad[1, 2] = bad
        assert_step_skipped(opt, params, pytest.warns(RuntimeWarning, match="skipped"))
    set_grads(params, 3)
    opt.found_inf, opt.grad_scale = torch.ones(1), None
    assert_step_skipped(opt, params)


def check_grad_scaler(make, scaler_kind: str) -> None:
    """Training through a GradScaler (power-of-two scale) equals unscaled training bit for bit, and an inf
    gradient skips the step while the scaler backs off."""
    from optim_helpers import assert_same_bits, bits

    if scaler_kind == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    else:
        from fp16kit.amp import GradScaler

        scaler = GradScaler("cpu", init_scale=2.0**10)
    ref, mod = _model(0), _model(0)
    o_ref, o_mod = make(list(ref.parameters())), make(list(mod.parameters()))
    x = _data()
    for _ in range(3):
        o_ref.zero_grad()
        ref(x).square().sum().backward()
        o_ref.step()
        o_mod.zero_grad()
        scaler.scale(mod(x).square().sum()).backward()
        scaler.step(o_mod)
        scaler.update()
    assert_same_bits([p.detach() for p in ref.parameters()], [p.detach() for p in mod.parameters()])
    o_mod.zero_grad()
    scaler.scale(mod(x).square().sum()).backward()
    next(mod.parameters()).grad[0, 0] = float("inf")
    before = bits(o_mod, list(mod.parameters()))
    scaler.step(o_mod)
    scaler.update()
    assert_same_bits(bits(o_mod, list(mod.parameters())), before)
    assert float(scaler.get_scale()) == 2.0**9


def check_amp_o2(make) -> None:
    """amp O2 through fp16kit's apex-style frontend: fp16 model, fp32 masters stepped by ``make``'s optimizer;
    an overflowing step is skipped, and the model stays the rounded masters."""
    from fp16kit import amp

    model = _model(0)
    opt = make(list(model.parameters()))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x = _data()
    masters = list(amp.master_params(opt))
    start = [m.detach().clone() for m in masters]
    for step in range(4):
        loss = model(x.half()).float().square().sum()
        if step == 2:
            loss = loss * float("inf")
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        before = [m.detach().clone() for m in masters]
        opt.step()
        if step == 2:
            assert all(torch.equal(m, b) for m, b in zip(masters, before)), "the overflowing step was not skipped"
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m, s) for m, s in zip(masters, start))
    for m, p in zip(masters, model.parameters()):
        assert torch.isfinite(m).all()
        assert torch.equal(m.to(p.dtype), p.detach())


def check_state_dict_round_trip(
    make,
    dtype: torch.dtype = torch.bfloat16,
    *,
    shapes: tuple = ((6,), (2, 5)),
    seed: int = 4,
    steps: int = 2,
    grad_seeds: tuple[int, int] = (0, 10),
):
    """Save after ``steps`` steps, run ``steps`` more; a fresh optimizer loaded from the checkpoint (with the
    saved params and the grads of the save) runs the same steps bit for bit. A checkpoint of other params (wrong
    shapes) is refused with a clear error, and so is one holding a NaN. Returns the resumed optimizer and params."""
    import pytest
    from optim_helpers import assert_same_bits, bits, clone_params, deep_state, make_params, set_grads

    params = make_params(list(shapes), dtype, seed)
    opt = make(params)
    for k in range(steps):
        opt.step()
        set_grads(params, grad_seeds[0] + k)
    saved, saved_params = deep_state(opt), [p.detach().clone() for p in params]
    for k in range(steps):
        opt.step()
        set_grads(params, grad_seeds[1] + k)
    # resume: fresh params with the saved values, a fresh optimizer, the saved state
    resumed = clone_params(params)
    with torch.no_grad():
        for q, s in zip(resumed, saved_params):
            q.copy_(s)
    opt2 = make(resumed)
    opt2.load_state_dict(saved)
    set_grads(resumed, grad_seeds[0] + steps - 1)
    for k in range(steps):
        opt2.step()
        set_grads(resumed, grad_seeds[1] + k)
    assert_same_bits(bits(opt2, resumed), bits(opt, params))
    other = make_params([(3,), (2, 5)], dtype, 5)
    opt3 = make(other)
    before = deep_state(opt3)
    with pytest.raises(ValueError, match=r"params'?\]?\[0\].*does not belong to th"):
        opt3.load_state_dict(saved)
    after = deep_state(opt3)  # a refused checkpoint leaves the optimizer as it was
    assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()
    corrupt = deep_state(opt)
    entry = next(e for e in corrupt["state"].values() if any(torch.is_tensor(v) and v.numel() for v in e.values()))
    key = next(k for k, v in entry.items() if torch.is_tensor(v) and v.is_floating_point() and v.numel())
    entry[key] = entry[key].clone().fill_(float("nan"))
    opt4 = make(clone_params(params))
    with pytest.raises(ValueError, match="inf or NaN"):
        opt4.load_state_dict(corrupt)
    assert not opt4.state, "a refused checkpoint must leave no state behind"
    return opt2, resumed


# ------------------------------------------------------------------------------------------------------------
# compiling the kernels for a GPU without one (as tests/kernels/test_gpu_compile.py does for the others)

_COMPILE = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, {kernels_dir!r})
import aot_compile
import triton.language as tl
from fp16kit.kernels.triton import {module}
cases = {cases}
aot_compile.CASES = {{
    name: (getattr({module}, fn), {{k: getattr(tl, v) if v in ("float16", "bfloat16", "float32") else v
                                    for k, v in constexprs.items()}}, *overrides)
    for name, (fn, constexprs, *overrides) in cases.items()
}}
aot_compile.main()
"""

#: The device-step constexprs of the SGD/Adagrad kernels: the host-vector layout, the update of a device step,
#: and its check-and-verify launch (fp16kit/kernels/engine/results.py).
APEX_HP_LEGACY = {"HP_DEVICE": False, "LR_TENSOR": False, "HAS_SCALE": False, "BIAS_CORRECTION": False,
                  "ADVANCE": False, "OWN_FLAG": False, "FIRST": False, "COUNT": False}
APEX_HP_DEVICE = {**APEX_HP_LEGACY, "HP_DEVICE": True, "HAS_SCALE": True, "ADVANCE": True}
APEX_HP_DEVICE_VERIFY = {**APEX_HP_LEGACY, "HP_DEVICE": True, "LR_TENSOR": True, "HAS_SCALE": True,
                         "OWN_FLAG": True, "FIRST": True, "COUNT": True}


def compile_for_sm90(module: str, cases: dict[str, tuple]) -> dict:
    """Compile ``fp16kit.kernels.triton.<module>`` kernels for sm_90 with ``tests/kernels/aot_compile.py`` in a
    subprocess (Triton's interpreter mode is process-wide); ``cases``: name -> (kernel name, constexprs with
    dtypes as ``"float16"``..., and optionally a third entry: argument types that differ from aot_compile's naming
    conventions, e.g. ``{"partials_ptr": "*fp64"}``). Returns aot_compile's JSON: per case ``ok`` and the
    16-byte load/store counts."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton with its NVIDIA backend is not installed")
    kernels_dir = str(Path(__file__).resolve().parent.parent / "kernels")
    code = _COMPILE.format(kernels_dir=kernels_dir, module=module, cases=repr(cases))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    failed = {name: r["error"] for name, r in result.items() if not r["ok"]}
    assert not failed, failed
    return result
