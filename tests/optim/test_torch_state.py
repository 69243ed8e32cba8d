"""Optimizer state both ways between fp16kit and torch.optim (``fp16kit.optim.torch_state``).

Each case runs one side for a few steps, moves the state through ``torch.save`` to a file and
``torch.load(weights_only=True)``, loads it into the other side, and takes the next step on both with the same
gradient. Oracle: the float64 reference step (``fp16kit.numerics.reference``) from the state both sides start from;
each side must be within the per-element fp32 budget of that step (``optim_helpers.adam_budget``: K = 8 roundings at
the magnitudes of p and of the update, moment errors carried through; the same construction for SGD and Adagrad), so
torch and fp16kit differ by at most twice that budget. Masters: the fp32 values (``fp32_params``) are what the torch
model holds, and what fp16kit's masters hold after an import.
"""

from __future__ import annotations

import pytest
import torch
from optim_helpers import U32, K, adam_budget, assert_within, make_params, set_grads

from fp16kit.kernels import dequantize_state8
from fp16kit.numerics import ulp_distance
from fp16kit.numerics.reference import adagrad_step, adam_step, sgd_step
from fp16kit.optim import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedSGD,
    fp32_params,
    from_torch_state_dict,
    to_torch_state_dict,
)

F64 = torch.float64
FLOOR = K * 2.0**-149  # budgets' absolute floor: fp32 results in the subnormal range are multiples of 2^-149
SHAPES = [(64, 64), (9,), (3, 5)]  # 4096 elements: 8-bit moments apply to the first
ADAM_HP = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
SGD_HP = {"lr": 0.05, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "nesterov": True}
ADAGRAD_HP = {"lr": 0.05, "eps": 1e-10, "weight_decay": 0.01}

# case -> (fp16kit class, its keywords, param dtype, torch class)
CASES = {
    "adamw": (FusedAdam, {**ADAM_HP}, torch.float32, torch.optim.AdamW),
    "adam-l2": (FusedAdam, {**ADAM_HP, "adam_w_mode": False}, torch.float32, torch.optim.Adam),
    "adamw-8bit": (FusedAdam, {**ADAM_HP, "state_bits": 8}, torch.float32, torch.optim.AdamW),
    "adamw-bf16-masters": (FusedAdam, {**ADAM_HP, "master_weights": True}, torch.bfloat16, torch.optim.AdamW),
    "adamw-bf16-split": (FusedAdam, {**ADAM_HP, "master_weights": "split"}, torch.bfloat16, torch.optim.AdamW),
    "sgd": (FusedSGD, {**SGD_HP}, torch.float32, torch.optim.SGD),
    "adagrad": (FusedAdagrad, {**ADAGRAD_HP}, torch.float32, torch.optim.Adagrad),
}


def _through_file(state_dict: dict, tmp_path) -> dict:
    path = tmp_path / "optim.pt"
    torch.save(state_dict, path)
    return torch.load(path, weights_only=True)


def _moments(opt, p: torch.Tensor, keys: tuple[str, ...]) -> list[torch.Tensor | None]:
    """float64 copies of ``opt.state[p][key]`` (8-bit codes dequantized: the values the next step reads)."""
    state = opt.state.get(p, {})
    out = []
    for key in keys:
        value = state.get(key)
        if value is not None and value.dtype == torch.uint8:
            value = dequantize_state8(value, state[f"{key}_absmax"], key == "exp_avg")
        out.append(None if value is None else value.detach().to(F64, copy=True))
    return out


def _check_next_step(kind: str, torch_cls, fp16kit_opt, torch_opt, torch_params, hp: dict, seed: int, *,
                     same_state: bool = True) -> tuple[int, float]:
    """One step on both sides with the same gradient, each within budget of the float64 step from the state they
    share (``same_state=False``: fp16kit's 8-bit moments are a quantized copy of torch's, so only fp16kit's side is
    checked against the step from its own state); returns the largest ulp distance between the two (fp32)."""
    ours = [p for g in fp16kit_opt.param_groups for p in g["params"]]
    set_grads(ours, seed)
    for p, q in zip(ours, torch_params):
        q.grad = p.grad.detach().float()
    p0 = [t.to(F64) for t in fp32_params(fp16kit_opt)]
    g = [q.grad.to(F64) for q in torch_params]
    keys = {"sgd": ("momentum_buffer",), "adagrad": ("sum",)}.get(kind, ("exp_avg", "exp_avg_sq"))
    state0 = [_moments(fp16kit_opt, p, keys) for p in ours]
    step = float(fp16kit_opt.param_groups[0].get("step", torch.zeros(1)).reshape(())) + 1
    fp16kit_opt.step()
    torch_opt.step()
    if kind == "sgd":
        ref, _ = sgd_step(p0, g, [s[0] for s in state0], **hp)
        budgets = []
        for p, gi, (m0,) in zip(p0, g, state0):
            a = gi.abs() + hp["weight_decay"] * p.abs()
            mag_m = hp["momentum"] * m0.abs() + a
            budgets.append(K * U32 * (p.abs() + hp["lr"] * (a + 2 * mag_m + hp["weight_decay"] * p.abs()))
                           + 2 * hp["lr"] * K * U32 * mag_m)
    elif kind == "adagrad":
        ref, ref_h = adagrad_step(p0, g, [s[0] for s in state0], **hp)
        budgets = []
        for p, gi, h in zip(p0, g, ref_h):
            upd = (gi.abs() + hp["weight_decay"] * p.abs()) / (h.sqrt() + hp["eps"])
            budgets.append(K * U32 * (p.abs() + 2 * hp["lr"] * upd))
    else:
        hp = {**hp, "step": step}
        ref, ref_m, ref_v = adam_step(p0, g, [s[0] for s in state0], [s[1] for s in state0],
                                      adam_w_mode=torch_cls is torch.optim.AdamW, **hp)
        budgets = [adam_budget(p, m, v, gi, s[0], hp) for p, m, v, gi, s in zip(p0, ref_m, ref_v, g, state0)]
    worst, same, total = 0, 0, 0
    for i, (a, b, r, budget) in enumerate(zip(fp32_params(fp16kit_opt), torch_params, ref, budgets)):
        assert_within(a, r, budget + FLOOR, f"fp16kit param {i}")
        if same_state:
            assert_within(b, r, budget + FLOOR, f"torch param {i}")
            assert_within(a, b.detach().to(F64), 2 * (budget + FLOOR), f"fp16kit vs torch, param {i}")
        dist = ulp_distance(a.float(), b.detach().float())
        worst, same, total = max(worst, int(dist.max())), same + int((dist == 0).sum()), total + dist.numel()
    return worst, same / total


def _hp(kind: str, kwargs: dict) -> dict:
    keys = {"sgd": SGD_HP, "adagrad": ADAGRAD_HP}.get(kind, ADAM_HP)
    return {k: kwargs[k] for k in keys}


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_into_torch_and_steps_like_fp16kit(case, tmp_path) -> None:
    cls, kwargs, dtype, torch_cls = CASES[case]
    kind = case if case in ("sgd", "adagrad") else "adam"
    params = make_params(SHAPES, dtype, seed=3)
    opt = cls(params, **kwargs)
    for k in range(3):
        set_grads(params, seed=10 + k)
        opt.step()
    exported = _through_file(to_torch_state_dict(opt), tmp_path)
    assert all(not isinstance(v, torch.Tensor) or v.dtype != torch.uint8
               for s in exported["state"].values() for v in s.values())
    masters = [torch.nn.Parameter(t) for t in fp32_params(opt)]  # the fp32 model torch continues with
    theirs = torch_cls(masters, lr=1.0)  # every hyper-parameter comes from the export
    theirs.load_state_dict(exported)
    if kind != "sgd":
        assert all(float(s["step"]) == 3 for s in theirs.state.values())
    _check_next_step(kind, torch_cls, opt, theirs, masters, _hp(kind, kwargs), seed=99)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_run_continues_in_fp16kit(case, tmp_path) -> None:
    cls, kwargs, dtype, torch_cls = CASES[case]
    kind = case if case in ("sgd", "adagrad") else "adam"
    hp = _hp(kind, kwargs)
    theirs_params = make_params(SHAPES, torch.float32, seed=4)
    theirs = torch_cls(theirs_params, foreach=False, **hp)
    for k in range(3):
        set_grads(theirs_params, seed=20 + k)
        theirs.step()
    saved = _through_file(theirs.state_dict(), tmp_path)
    ours = [torch.nn.Parameter(q.detach().to(dtype, copy=True)) for q in theirs_params]
    opt = cls(ours, **{**kwargs, "lr": 1.0})  # the checkpoint's hyper-parameters win
    from_torch_state_dict(opt, saved, fp32_params=[q.detach() for q in theirs_params])
    if dtype != torch.float32:  # the masters are the torch run's fp32 values, bit for bit
        for a, q in zip(fp32_params(opt), theirs_params):
            assert torch.equal(a, q.detach())
    quantized = kwargs.get("state_bits") == 8
    _check_next_step(kind, torch_cls, opt, theirs, theirs_params, hp, seed=98, same_state=not quantized)


# ------------------------------------------------------------------------------------------------ refusals
def test_wrong_side_and_what_torch_cannot_continue_raise_naming_the_fix() -> None:
    params = make_params([(4,)], torch.float32, seed=0)
    adam = FusedAdam(params, lr=1e-3)
    adam.step()
    with pytest.raises(ValueError, match=r"fp16kit's own layout .*optimizer.load_state_dict"):
        from_torch_state_dict(FusedAdam(params), adam.state_dict())
    with pytest.raises(ValueError, match=r"torch\.optim has no LAMB"):
        to_torch_state_dict(FusedLAMB(params))
    with pytest.raises(TypeError, match="already in torch's layout"):
        to_torch_state_dict(torch.optim.AdamW(params))
    with pytest.raises(ValueError, match="bias_correction=False"):
        to_torch_state_dict(FusedAdam(params, bias_correction=False))
    with pytest.raises(ValueError, match="wd_after_momentum=True"):
        to_torch_state_dict(FusedSGD(params, lr=0.1, weight_decay=0.1, wd_after_momentum=True))
    with pytest.raises(ValueError, match="adagrad_w_mode=True"):
        to_torch_state_dict(FusedAdagrad(params, weight_decay=0.1, adagrad_w_mode=True))
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    sgd.step()
    with pytest.raises(ValueError, match=r"saved by torch\.optim\.SGD"):
        from_torch_state_dict(FusedAdam(params), sgd.state_dict())
    with pytest.raises(ValueError, match="fp32_params has 2 tensors"):
        torch_adam = torch.optim.AdamW(params)
        torch_adam.step()
        from_torch_state_dict(FusedAdam(params), torch_adam.state_dict(), fp32_params=[params[0], params[0]])
