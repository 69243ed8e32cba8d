"""Shared by the optimizer tests: parameter lists, one-step checks against the float64 references, and the
per-element error budgets those checks use.

Error budgets (fp32 arithmetic, u = unit roundoff of fp32 = 2^-24). Each step is checked from the
optimizer's *actual* state before the step (converted to float64), so budgets do not accumulate over steps:

- a chain of at most ``K = 8`` fp32 roundings at the magnitude of its operands costs ``K u * magnitude``
  (the LAMB element chain g/clip, +wd p, m, v, /bc1, /bc2, sqrt, +eps, /, +wd p, ratio*u, p - . has at most
  6 roundings at each magnitude level; K = 8 leaves room for FMA contraction and op-order differences);
- a norm over ``n`` squares has relative error at most ``gamma(n)`` (Higham), the clip factor
  ``gnorm / max_grad_norm`` adds 3 roundings, a trust ratio ``lr * sqrt(pn) / sqrt(un)`` two norms and 4
  roundings, plus the relative error that the elementwise update errors put into ``|u|``;
- moments are bounded by their *absolute* magnitudes (``b1|m| + beta3|g|``), because ``m`` may cancel;
- a result stored in fp16/bf16 gets one more ulp of that format (round to nearest of a value that is
  already within the fp32 budget).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.numerics import gamma, ulp, unit_roundoff
from fp16kit.numerics.reference import adam_step, global_grad_norm, lamb_step

U32 = unit_roundoff(torch.float32)
K = 8
F64 = torch.float64


def make_params(
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    seed: int,
    *,
    scale: float = 1.0,
    grad_scale: float = 1.0,
    zero_params: Sequence[int] = (),
    zero_grads: Sequence[int] = (),
) -> list[torch.nn.Parameter]:
    """Leaf params with grads (same dtype), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, shape in enumerate(shapes):
        p = torch.randn(shape, generator=gen, dtype=F64) * scale
        g = torch.randn(shape, generator=gen, dtype=F64) * grad_scale
        if i in zero_params:
            p.zero_()
        if i in zero_grads:
            g.zero_()
        param = torch.nn.Parameter(p.to(dtype))
        param.grad = g.to(dtype)
        out.append(param)
    return out


def clone_params(params: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.nn.Parameter]:
    """Independent copies (optionally cast) with copied grads."""
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().to(dtype or p.dtype, copy=True))
        q.grad = None if p.grad is None else p.grad.detach().to(dtype or p.grad.dtype, copy=True)
        out.append(q)
    return out


def set_grads(params: Sequence[torch.Tensor], seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, dtype=F64) * scale).to(p.dtype)


def scaled_step(opt: torch.optim.Optimizer, scaler=None) -> None:
    """``opt.step()``, or through ``scaler`` (a GradScaler): ``scale`` (which its ``step`` needs first), ``step``,
    ``update``."""
    if scaler is None:
        opt.step()
    else:
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()


def _updated_tensor(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The tensor the optimizer updates for ``p``: its fp32 master if it has one."""
    state = opt.state.get(p, {})
    return state.get("master", p)


def snapshot(
    opt: torch.optim.Optimizer, keys: tuple[str, ...], inv_scale: float = 1.0, *, updated=None, read=None
) -> list[dict[str, list]]:
    """float64 copies per group, params with grads only: ``params``, ``p`` (the updated tensor: ``updated(p)``, by
    default its fp32 master if it has one), ``g`` (the grad times ``inv_scale``) and, per state key, ``state[key]``
    (``read(state, key)``, by default a float64 copy; None where the param has none yet)."""
    snap = []
    for group in opt.param_groups:
        items: dict[str, list] = {"params": [], "p": [], "g": [], **{k: [] for k in keys}}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt.state.get(p, {})
            items["params"].append(p)
            items["p"].append((updated or partial(_updated_tensor, opt))(p).detach().to(F64, copy=True))
            items["g"].append(p.grad.detach().to(F64) * inv_scale)
            for k in keys:
                value = None if state.get(k) is None else read(state, k) if read else state[k].to(F64, copy=True)
                items[k].append(value)
        snap.append(items)
    return snap


def stepped_groups(opt: torch.optim.Optimizer, keys: tuple[str, ...], inv_scale: float = 1.0) -> list[tuple]:
    """``opt.step()``; then ``(group, items)`` per group with grads, ``items`` its :func:`snapshot` from before."""
    snap = snapshot(opt, keys, inv_scale)
    opt.step()
    return [(group, items) for group, items in zip(opt.param_groups, snap) if items["params"]]


#: the Adam-like moments (FusedAdam, FusedLAMB)
MOMENTS = ("exp_avg", "exp_avg_sq")


def moments(items: dict[str, list]) -> dict[str, list]:
    """A :func:`snapshot` of :data:`MOMENTS` with them as ``m`` and ``v``, zeros before the first step."""
    for key, name in (("exp_avg", "m"), ("exp_avg_sq", "v")):
        items[name] = [torch.zeros_like(p) if t is None else t for p, t in zip(items["p"], items.pop(key))]
    return items


def checked_steps(make, step_and_check, shapes, dtype, seed, steps, *, grad_exp: int = 0, zero: str = "none"):
    """``steps`` steps of ``make(params)``, each through ``step_and_check``, on :func:`make_params` whose grads
    are scaled by ``2**grad_exp``; ``zero`` ("none", "param", "grad", "both") zeroes tensor 0's param and/or
    its grad (at every step). Returns ``(opt, params)``."""
    zp = (0,) if zero in ("param", "both") else ()
    zg = (0,) if zero in ("grad", "both") else ()
    params = make_params(shapes, dtype, seed, grad_scale=2.0**grad_exp, zero_params=zp, zero_grads=zg)
    opt = make(params)
    for k in range(steps):
        step_and_check(opt)
        set_grads(params, seed + k + 1, scale=2.0**grad_exp)
        if zg:
            params[0].grad.zero_()
    return opt, params


def reference_tests(run, shapes, config: dict, examples: int, interpreter_examples: int):
    """The two Hypothesis tests of an optimizer against its float64 reference: ``run(shapes, steps=..., **config)``
    on the default backend (1 to 3 steps, ``examples`` cases) and on the Triton interpreter (2 steps, marked
    ``interpreter``). A test file binds them to its own ``test_matches_reference_*`` names."""

    @settings(max_examples=examples, deadline=None)
    @given(shapes=shapes, steps=st.integers(1, 3), **config)
    def torch_backend(shapes, steps, **kw):
        run(shapes, steps=steps, **kw)

    @pytest.mark.interpreter
    @settings(max_examples=interpreter_examples, deadline=None)
    @given(shapes=shapes, **config)
    def triton_interpreter(shapes, **kw):
        run(shapes, steps=2, **kw)

    return torch_backend, triton_interpreter


def assert_within(actual: torch.Tensor, expected: torch.Tensor, budget: torch.Tensor, what: str) -> None:
    """``|actual - expected| <= budget`` elementwise (all finite), with a message naming the worst element."""
    a = actual.detach().to(F64)
    assert torch.isfinite(a).all(), f"{what}: non-finite values {a}"
    err = (a - expected).abs()
    bad = err > budget
    if bool(bad.any()):
        i = int(torch.argmax(torch.where(bad, err / budget.clamp_min(1e-300), torch.zeros_like(err))))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements exceed the budget; worst at flat index {i}: "
            f"actual {a.reshape(-1)[i].item()!r}, expected {expected.reshape(-1)[i].item()!r}, "
            f"error {err.reshape(-1)[i].item():.3g} > budget {budget.reshape(-1)[i].item():.3g}"
        )


def _stored_budget(budget: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Budget of a value stored in ``dtype``: fp32 budget plus one ulp of a low-precision format."""
    extra = U32 * expected.abs() if dtype == torch.float32 else ulp(expected, dtype)
    return budget + extra


def lamb_budgets(
    p0: torch.Tensor,
    g: torch.Tensor,
    m0: torch.Tensor,
    v0: torch.Tensor,
    new_m: torch.Tensor,
    new_v: torch.Tensor,
    *,
    hp: dict,
    clip: float,
    delta_clip: float,
    adam_w_mode: bool,
    use_nvlamb: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element error budgets (p, m, v) of one LAMB step of one tensor (see the module docstring)."""
    b1, b2 = hp["betas"]
    wd, eps, lr = hp["weight_decay"], hp["eps"], hp["lr"]
    t = hp["step"]
    bc1, bc2 = (1 - b1**t, 1 - b2**t) if hp["bias_correction"] else (1.0, 1.0)
    beta3 = 1 - b1 if hp["grad_averaging"] else 1.0
    gc = (g / clip).abs()
    decay_in_g = wd * p0.abs() if (not adam_w_mode and wd != 0) else torch.zeros_like(p0)
    a_m = b1 * m0.abs() + beta3 * (gc + decay_in_g)
    err_m = K * U32 * a_m + beta3 * gc * delta_clip
    a_v = b2 * v0 + (1 - b2) * (gc + decay_in_g) ** 2
    err_v = (K * U32 + 2 * delta_clip) * a_v
    m_hat = new_m / bc1
    den = torch.sqrt(new_v / bc2) + eps
    rel_den = 0.5 * (K * U32 + 2 * delta_clip) + 2 * U32
    upd = m_hat / den
    decoupled = adam_w_mode and wd != 0
    if decoupled:
        upd = upd + wd * p0
    err_u = (err_m / bc1) / den + (m_hat.abs() / den) * rel_den + K * U32 * (upd.abs() + decoupled * wd * p0.abs())
    pn, un = float(p0.norm()), float(upd.norm())
    trust = (use_nvlamb or wd != 0) and pn != 0 and un != 0
    ratio = lr * pn / un if trust else lr
    delta_r = 2 * gamma(p0.numel(), torch.float32) + K * U32 + (float(err_u.norm()) / un if trust else 0.0)
    err_p = K * U32 * (p0.abs() + (ratio * upd).abs()) + ratio * err_u + (ratio * upd).abs() * delta_r * trust
    return err_p, err_m + U32 * new_m.abs(), err_v + U32 * new_v.abs()


def clip_terms(grads: Sequence[torch.Tensor], max_grad_norm: float) -> tuple[float, float, float]:
    """``(gnorm, clip, delta_clip)`` of unscaled float64 grads: the float64 global norm, apex's clip divisor
    and the relative error bound of an fp32 evaluation of the clip (a norm of n squares plus 4 roundings)."""
    gnorm = global_grad_norm(grads)
    clip = gnorm / max_grad_norm if 0 < max_grad_norm < gnorm else 1.0
    delta_clip = gamma(max(1, sum(g.numel() for g in grads)), torch.float32) + 4 * U32
    return gnorm, clip, delta_clip


def check_lamb_lists(
    before: dict[str, Sequence[torch.Tensor]],
    targets: Sequence[torch.Tensor],
    ms: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    *,
    hp: dict,
    max_grad_norm: float,
    norm: tuple[float, float, float],
    adam_w_mode: bool,
    use_nvlamb: bool,
) -> None:
    """One group's LAMB step results (``targets``: the updated tensors; ``ms``, ``vs``) against the float64
    reference from the state ``before`` the step (float64 lists ``p``, unscaled ``g``, ``m``, ``v``: a
    :func:`snapshot`'s items after :func:`moments`), within the budgets.

    ``hp`` holds lr, betas, eps, weight_decay, bias_correction, grad_averaging and the step number;
    ``norm`` is :func:`clip_terms` of the grads of *all* groups."""
    p0, g, m0, v0 = (before[k] for k in ("p", "g", "m", "v"))
    gnorm, clip, delta_clip = norm
    ref_p, ref_m, ref_v = lamb_step(
        p0,
        g,
        m0,
        v0,
        max_grad_norm=max_grad_norm,
        global_norm=gnorm,
        adam_w_mode=adam_w_mode,
        use_nvlamb=use_nvlamb,
        **hp,
    )
    for i, target in enumerate(targets):
        err_p, err_m, err_v = lamb_budgets(
            p0[i],
            g[i],
            m0[i],
            v0[i],
            ref_m[i],
            ref_v[i],
            hp=hp,
            clip=clip,
            delta_clip=delta_clip,
            adam_w_mode=adam_w_mode,
            use_nvlamb=use_nvlamb,
        )
        assert_within(target, ref_p[i], _stored_budget(err_p, ref_p[i], target.dtype), f"param {i}")
        assert_within(ms[i], ref_m[i], err_m, f"exp_avg {i}")
        assert_within(vs[i], ref_v[i], err_v, f"exp_avg_sq {i}")


def lamb_step_and_check(opt, *, inv_scale: float = 1.0) -> None:
    """Run ``opt.step()`` (a FusedLAMB) and check every updated tensor against the float64 reference
    computed from the state just before the step."""
    groups = [(group, moments(items)) for group, items in stepped_groups(opt, MOMENTS, inv_scale)]
    maxn = float(opt.defaults["max_grad_norm"])
    norm = clip_terms([g for _, items in groups for g in items["g"]], maxn)  # of the grads of all groups
    for group, items in groups:
        hp = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "bias_correction", "grad_averaging")}
        hp["step"] = int(group["step"].item())
        targets = [_updated_tensor(opt, p) for p in items["params"]]
        check_lamb_lists(
            items,
            targets,
            [opt.state[p]["exp_avg"] for p in items["params"]],
            [opt.state[p]["exp_avg_sq"] for p in items["params"]],
            hp=hp,
            max_grad_norm=maxn,
            norm=norm,
            adam_w_mode=opt.adam_w_mode,
            use_nvlamb=opt.use_nvlamb,
        )
        for i, (p, target) in enumerate(zip(items["params"], targets)):
            if target is not p:  # master-weights mode: the model param is the rounded master, bit for bit
                assert torch.equal(p.detach(), target.to(p.dtype)), f"model copy {i} is not round(master)"


def adam_budget(
    p0: torch.Tensor, new_m: torch.Tensor, new_v: torch.Tensor, g: torch.Tensor, m0: torch.Tensor, hp: dict
) -> torch.Tensor:
    """Per-element budget of one Adam step's param (fp32 math): K roundings at the magnitudes of ``p`` and
    of the update, the moments' own errors (absolute magnitudes, since ``m`` may cancel) carried through."""
    b1, b2 = hp["betas"]
    t = hp["step"]
    bc1, bc2 = (1 - b1**t, 1 - b2**t) if hp.get("bias_correction", True) else (1.0, 1.0)
    den = torch.sqrt(new_v) / math.sqrt(bc2) + hp["eps"]
    step_size = hp["lr"] / bc1
    a_m = b1 * m0.abs() + (1 - b1) * (g.abs() + hp["weight_decay"] * p0.abs())
    upd = step_size * new_m.abs() / den
    return K * U32 * (p0.abs() + upd + step_size * a_m / den)


def check_adam_lists(
    before: dict[str, Sequence[torch.Tensor]],
    targets: Sequence[torch.Tensor],
    ms: Sequence[torch.Tensor] | None,
    vs: Sequence[torch.Tensor] | None,
    *,
    hp: dict,
    adam_w_mode: bool,
) -> None:
    """One group's Adam step results against the float64 reference from the state ``before`` the step (as
    :func:`check_lamb_lists`). Moments (when given) within K roundings of their absolute magnitudes: with
    the L2 penalty, ``g + wd p`` may cancel, so the budget is in the operands' magnitudes, not the result's."""
    p0, g, m0, v0 = (before[k] for k in ("p", "g", "m", "v"))
    ref_p, ref_m, ref_v = adam_step(p0, g, m0, v0, adam_w_mode=adam_w_mode, **hp)
    b1, b2 = hp["betas"]
    wd = hp["weight_decay"] if not adam_w_mode else 0.0
    for i, target in enumerate(targets):
        budget = adam_budget(p0[i], ref_m[i], ref_v[i], g[i], m0[i], hp)
        assert_within(target, ref_p[i], _stored_budget(budget, ref_p[i], target.dtype), f"param {i}")
        if ms is None:
            continue
        a_g = g[i].abs() + wd * p0[i].abs()
        err_m = K * U32 * (b1 * m0[i].abs() + (1 - b1) * a_g)
        err_v = K * U32 * (b2 * v0[i] + (1 - b2) * a_g**2)
        assert_within(ms[i], ref_m[i], err_m, f"exp_avg {i}")
        assert_within(vs[i], ref_v[i], err_v, f"exp_avg_sq {i}")


def adam_step_and_check(opt, *, adam_w_mode: bool, inv_scale: float = 1.0) -> None:
    """Run ``opt.step()`` (a FusedAdam) and check it against the float64 reference from the state before."""
    for group, items in stepped_groups(opt, MOMENTS, inv_scale):
        items = moments(items)
        hp = {k: group[k] for k in ("lr", "betas", "eps", "weight_decay", "bias_correction")}
        hp["step"] = int(group["step"].item())
        check_adam_lists(
            items,
            [_updated_tensor(opt, p) for p in items["params"]],
            [opt.state[p]["exp_avg"] for p in items["params"]],
            [opt.state[p]["exp_avg_sq"] for p in items["params"]],
            hp=hp,
            adam_w_mode=adam_w_mode,
        )


def bits(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Everything a step may change, copied: params, every state tensor, every group's step counter."""
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [t.clone() for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
    out += [g["step"].clone() for g in opt.param_groups if isinstance(g.get("step"), torch.Tensor)]
    return out


def assert_step_skipped(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], expect=None) -> None:
    """``opt.step()`` (inside ``expect``, e.g. ``pytest.warns(...)``) leaves every bit of :func:`bits` as it was:
    params, state tensors and step counters."""
    before = bits(opt, params)
    with expect or contextlib.nullcontext():
        opt.step()
    assert_same_bits(bits(opt, params), before)


def assert_same_bits(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8) if y.dim() else y), (
            f"tensor {i} changed"
        )


def deep_state(opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(opt.state_dict())
