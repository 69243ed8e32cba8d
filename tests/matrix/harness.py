"""One cell of the configuration matrix, built and stepped, and the oracles every accepted cell must pass.

A cell runs three steps: finite gradients, then the cell's gradient kind, then finite gradients again; a batched
run (the slow set) takes every gradient kind as a step of its own (``BATCH``), each step's verdict its own cell's.
Every oracle is checked after every step and a failure is recorded against that step (``Run.failures``). Oracles:

1. **float64 reference**: every step that is taken is checked, from the optimizer's actual state just before it,
   against ``fp16kit.numerics.reference`` within the per-element ulp budgets of ``tests/optim/optim_helpers.py``
   and ``tests/optim/apex_optim_helpers.py`` (the budgets docs/optim.md states). Under a loss scaler the grads are
   set unscaled, snapshotted, then multiplied in place by the (power-of-two) scale just before the scaler steps:
   exact, so the reference sees the true gradients.
2. **the other backend / path as documented**: the same cell on the other backend passes oracle 1 too (so the two
   agree within twice the budget), with bit-for-bit equality where docs/optim.md promises it: 8-bit codes, absmax
   and small fp32 moments between the backends; the device step and the host-vector step; a compiled step and the
   eager step.
3. **a skipped step writes nothing**: an inf/NaN gradient (and a huge one where the optimizer's guard or result
   check applies) leaves params, masters, low halves, moments, codes, absmax and step counters bit-identical.
4. **resume**: ``torch.save(opt.state_dict(), file)`` after the first step, ``torch.load(file, weights_only=True)``
   into a fresh model and optimizer, the same later steps: bit-identical to the uninterrupted run after each.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from apex_optim_helpers import adagrad_step_and_check, novograd_step_and_check, sgd_step_and_check
from optim_helpers import (
    MOMENTS,
    U32,
    K,
    _stored_budget,
    assert_within,
    check_adam_lists,
    clip_terms,
    lamb_budgets,
    moments,
    snapshot,
)

from fp16kit.kernels import from_state8, use_backend
from fp16kit.numerics import gamma, ulp
from fp16kit.numerics.reference import adam_step, lamb_step, larc_grads
from fp16kit.numerics.reference.state8 import resolution

from .axes import Cell, twin_cells

F64 = torch.float64
LR = {"adam": 1e-3, "lamb": 1e-2, "sgd": 0.1, "adagrad": 1e-2, "novograd": 1e-3, "larc": 0.1}
SCALE = 2.0**10  #: the scalers' initial (power-of-two) scale
HUGE = {torch.float32: 1e25, torch.bfloat16: 1e25, torch.float16: 6.0e4}  #: the stored (scaled) huge gradient
SEED = 1234

# ------------------------------------------------------------------------------------------------ params


def _leaf(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t)  # keeps t's strides and storage (a view stays a view)


def _params(c: Cell) -> list[torch.nn.Parameter]:
    """The cell's params (its layout, in its weights' dtype), reproducible."""
    gen = torch.Generator().manual_seed(SEED)
    dt = c.weights.dtype
    lay = c.layout.name

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dt)

    vec = rnd(7)
    if lay == "transposed":
        first = rnd(64, 65).t()
    elif lay == "channels_last":
        first = rnd(16, 16, 4, 4).contiguous(memory_format=torch.channels_last)
    elif lay == "sliced":
        first = rnd(65, 128)[:, ::2]
    elif lay == "below8":
        first = rnd(63, 65)
    elif lay == "above8":
        first = rnd(64, 64)
    elif lay == "empty":
        first = rnd(0, 5)
    elif lay == "shared":
        base = rnd(37)
        return [_leaf(base[:30].view(6, 5)), _leaf(base[30:])]
    else:
        first = rnd(6, 5)
    return [_leaf(first), _leaf(vec)]


def _amp_model(c: Cell) -> torch.nn.Module:
    torch.manual_seed(SEED)
    net = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 4), torch.nn.Flatten(), torch.nn.Linear(16, 7))
    return net.to(memory_format=torch.channels_last)


# ------------------------------------------------------------------------------------------------ optimizers


class Functional:
    """``adam_step_``/``lamb_step_`` dressed as an optimizer (one group), so the oracles read it the same way:
    ``param_groups[0]["step"]``, ``state[p]`` with ``exp_avg``/``exp_avg_sq`` (and ``master`` for fp16/bf16
    params: the function steps the fp32 masters and writes the params as ``model_params``)."""

    def __init__(self, params: list[torch.Tensor], kind: str) -> None:
        from fp16kit.optim import adam_step_, lamb_step_

        self.kind, self.fn = kind, adam_step_ if kind == "adam" else lamb_step_
        self.hp = {"lr": LR[kind], "betas": (0.9, 0.999), "eps": 1e-8 if kind == "adam" else 1e-6,
                   "weight_decay": 0.01, "bias_correction": True}
        if kind == "lamb":
            self.hp["grad_averaging"] = True
        self.adam_w_mode, self.use_nvlamb = True, False
        self.defaults = {"max_grad_norm": 1.0, **self.hp}
        self.param_groups = [{"params": params, "step": torch.zeros(1), **self.hp}]
        self.state: dict = {}
        for p in params:
            st = self.state[p] = {}
            if p.dtype in (torch.float16, torch.bfloat16):
                st["master"] = p.detach().float().contiguous()
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)

    def step(self) -> None:
        rows = [p for p in self.param_groups[0]["params"] if p.grad is not None]
        st = [self.state[p] for p in rows]
        kw = {k: v for k, v in self.hp.items() if k != "grad_averaging" or self.kind == "lamb"}
        if self.kind == "lamb":
            kw["max_grad_norm"] = 1.0
        self.fn([s.get("master", p.detach()) for s, p in zip(st, rows)], [p.grad for p in rows],
                [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], step=self.param_groups[0]["step"],
                model_params=[p.detach() if "master" in s else None for s, p in zip(st, rows)], **kw)

    def state_dict(self) -> dict:
        ps = self.param_groups[0]["params"]
        return {"state": {i: dict(self.state[p]) for i, p in enumerate(ps)},
                "param_groups": [{"step": self.param_groups[0]["step"]}]}

    def load_state_dict(self, sd: dict) -> None:
        for i, p in enumerate(self.param_groups[0]["params"]):
            for k, v in sd["state"][i].items():
                self.state[p][k].copy_(v)
        self.param_groups[0]["step"].copy_(sd["param_groups"][0]["step"])


def _make_opt(c: Cell, params: list[torch.nn.Parameter], pg: Any, **extra: Any) -> Any:
    from fp16kit.optim import (
        LARC,
        FusedAdagrad,
        FusedAdam,
        FusedLAMB,
        FusedMixedPrecisionLamb,
        FusedNovoGrad,
        FusedSGD,
    )

    name, kind = c.opt.name, c.opt.kind
    if c.path.name == "functional":
        return Functional(params, kind)
    kw: dict[str, Any] = {"on_nonfinite": "skip"}
    hp = {"lr": LR[kind], "weight_decay": 0.0 if name == "LARC" else 0.01, **extra}
    if c.weights.master is not False or name != "FusedMixedPrecisionLamb":
        kw["master_weights"] = c.weights.master
    if c.weights.master == "stochastic" and c.opt.bf16_modes:
        kw["rounding_seed"] = 77
    if c.moments.bits != 32:
        kw["state_bits"] = c.moments.bits
    if c.path.name == "zero1":
        kw["process_group"] = pg
    groups: list[dict] = [{"params": params[:1]}, {"params": params[1:]}] if c.layout.name == "copied_group" \
        else [{"params": params}]
    if name == "FusedAdam":
        opt = FusedAdam(groups[:1], **hp, **kw)
    elif name == "FusedLAMB":
        opt = FusedLAMB(groups[:1], max_grad_norm=1.0, **hp, **kw)
    elif name == "FusedMixedPrecisionLamb":
        master = kw.pop("master_weights", False)
        kw["reduced_precision_dtype"] = c.weights.dtype if master else None
        opt = FusedMixedPrecisionLamb(groups[:1], max_grad_norm=1.0, **hp, **kw)
    elif name == "FusedSGD":
        opt = FusedSGD(groups[:1], momentum=0.9, **hp, **kw)
    elif name == "FusedAdagrad":
        opt = FusedAdagrad(groups[:1], **hp, **kw)
    elif name == "FusedNovoGrad":
        opt = FusedNovoGrad(groups[:1], **hp, **kw)
    elif name == "LARC":
        opt = LARC(FusedSGD(groups[:1], **hp, **kw))
    else:  # pragma: no cover - a new optimizer entry needs its constructor here
        raise AssertionError(name)
    if c.layout.name == "copied_group":
        # the second group copies the first group's dict minus params, step counter included (a user's idiom)
        first = opt.param_groups[0]
        if not isinstance(first.get("step"), torch.Tensor) and kind not in ("sgd", "adagrad", "larc"):
            first["step"] = torch.zeros(1)
        opt.add_param_group({**{k: v for k, v in first.items() if k != "params"}, "params": groups[1]["params"]})
    if c.layout.name == "step_2e31":
        sd = opt.state_dict()
        for g in sd["param_groups"]:
            g["step"] = torch.tensor([2.0**31])
        opt.load_state_dict(sd)
    return opt


# ------------------------------------------------------------------------------------------------ a run


@dataclass
class Run:
    """A cell's live objects: params, optimizer, scaler and the way one step is taken."""

    cell: Cell
    params: list[torch.nn.Parameter]
    opt: Any
    scaler: Any = None
    amp_opt: Any = None
    compiled: Callable | None = None
    log: list = field(default_factory=list)  #: each step's (unscaled) gradients
    kinds: tuple[str, ...] = ()  #: each step's gradient kind
    after: list = field(default_factory=list)  #: ``bits`` after each step
    eight: list = field(default_factory=list)  #: ``_eight`` after each step
    failures: list = field(default_factory=list)  #: (step, message) of every failed oracle

    def inner(self) -> Any:
        """The optimizer that holds the state (LARC's wrapped one)."""
        return getattr(self.opt, "optim", self.opt)


def build(c: Cell, pg: Any = None) -> Run:
    if c.layout.name == "ampO2":
        from fp16kit import amp
        from fp16kit.optim import FusedAdam, FusedLAMB

        model = _amp_model(c)
        cls = FusedAdam if c.opt.kind == "adam" else FusedLAMB
        kw = {"max_grad_norm": 1.0} if c.opt.kind == "lamb" else {}
        bits = {"state_bits": 8} if c.moments.bits == 8 else {}
        opt = cls(model.parameters(), lr=LR[c.opt.kind], weight_decay=0.01, on_nonfinite="skip", **kw, **bits)
        cast = torch.float16 if c.weights.dtype == torch.float16 else torch.bfloat16
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=1.0,
                                    cast_model_type=cast)
        return Run(c, list(model.parameters()), opt, amp_opt=opt)
    params = _params(c)
    opt = _make_opt(c, params, pg)
    run = Run(c, params, opt)
    if c.scaler.name == "fp16kitscaler":
        from fp16kit.amp import GradScaler

        run.scaler = GradScaler("cpu", init_scale=SCALE)
    elif c.scaler.name == "torchscaler":
        run.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    if c.path.name == "compiled":
        run.compiled = torch.compile(run.opt.step, backend="eager")
        run.opt.step = run.compiled
    return run


def grads_for(run: Run, k: int, kind: str) -> list[torch.Tensor | None]:
    """Step ``k``'s unscaled gradients (kind ``finite``/``inf``/``nan``/``huge``/``none``), shaped and strided
    like the params (as autograd makes them)."""
    gen = torch.Generator().manual_seed(SEED + 100 * (k + 1))
    out: list[torch.Tensor | None] = []
    for p in run.params:
        g = (torch.randn(p.shape, generator=gen, dtype=F64) * 1e-2).to(p.dtype)
        out.append(torch.empty_like(p).copy_(g))  # empty_like keeps a dense non-contiguous param's strides
    first = out[next(i for i, p in enumerate(run.params) if p.numel())]
    if kind in ("inf", "nan", "huge"):  # its first element in memory (any strides)
        value = float(kind) if kind != "huge" else HUGE[first.dtype] / current_scale(run)
        first.as_strided((1,), (1,), first.storage_offset())[0] = value
    elif kind == "none":
        out[-1] = None
    return out


def current_scale(run: Run) -> float:
    return 1.0 if run.scaler is None else float(run.scaler.get_scale())


def take_step(run: Run, grads: Sequence[torch.Tensor | None]) -> None:
    """Put ``grads`` (unscaled) in place and step the cell's way. (The oracles snapshot before this.)"""
    c = run.cell
    if run.amp_opt is not None:
        from fp16kit import amp

        run.opt.zero_grad()
        live = [(p, g) for p, g in zip(run.params, grads) if g is not None]
        loss = sum((p.float() * g.float()).sum() for p, g in live)
        with amp.scale_loss(loss, run.opt) as scaled:
            scaled.backward()
        run.opt.step()
        return
    with use_backend(c.backend.select), _host_vector(c):
        if run.scaler is None:
            run.opt.step()
            return
        s = current_scale(run)
        for p in run.params:
            if p.grad is not None:
                p.grad.mul_(s)  # exact: a power of two, and the grads stay finite
        run.scaler.scale(torch.ones(()))  # the scaler needs a scale() before step()
        run.scaler.step(run.opt)
        run.scaler.update()


@contextlib.contextmanager
def _host_vector(c: Cell):
    """The ``host`` path on the Triton backend: the host-vector step (the device step switched off)."""
    if c.path.name != "host" or c.backend.name != "interp":
        yield
        return
    from fp16kit.optim._apex_common import ApexStateOptimizer
    from fp16kit.optim._base import FusedOptimizer

    saved = FusedOptimizer._on_device, ApexStateOptimizer._on_device
    FusedOptimizer._on_device = ApexStateOptimizer._on_device = lambda self, device: False
    try:
        yield
    finally:
        FusedOptimizer._on_device, ApexStateOptimizer._on_device = saved


def install_grads(run: Run, grads: Sequence[torch.Tensor | None]) -> None:
    for p, g in zip(run.params, grads):
        p.grad = None if g is None else g.clone(memory_format=torch.preserve_format)


# ------------------------------------------------------------------------------------------------ state views


def bits(run: Run) -> list[torch.Tensor]:
    """Everything a step may change, copied: params, every state tensor (codes, absmax, low halves, masters,
    moments), every group's step counter."""
    opt = run.inner()
    out = [p.detach().clone() for p in run.params]
    for p in run.params:
        out += [t.detach().clone() for _, t in sorted(opt.state.get(p, {}).items()) if isinstance(t, torch.Tensor)]
    out += [g["step"].clone() for g in opt.param_groups if isinstance(g.get("step"), torch.Tensor)]
    return out


def assert_same_bits(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} tensors against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: tensor {i} {x.dtype}{tuple(x.shape)} " \
                                                          f"against {y.dtype}{tuple(y.shape)}"
        xb = x.contiguous().view(torch.uint8) if x.dim() else x
        yb = y.contiguous().view(torch.uint8) if y.dim() else y
        assert torch.equal(xb, yb), f"{what}: tensor {i} ({x.dtype}{tuple(x.shape)}) differs"


def _moment64(state: dict, key: str) -> torch.Tensor:
    t = state[key]
    if t.dtype == torch.uint8:
        return from_state8(t, key == "exp_avg").to(F64)
    return t.detach().to(F64, copy=True)


def _updated(run: Run, p: torch.Tensor) -> torch.Tensor:
    """The fp32 (or param-dtype) tensor the optimizer updates for ``p``: its master, its split master, or p."""
    opt = run.inner()
    st = opt.state.get(p, {})
    if "master" in st:
        return st["master"]
    if "master_low" in st:
        from fp16kit.kernels.bf16_weights.modes import join_halves

        return join_halves(p.detach(), st["master_low"])
    return p.detach()


# ------------------------------------------------------------------------------------------------ oracle 1


def _hp(group: dict, keys: tuple[str, ...]) -> dict:
    out = {k: (float(group[k]) if isinstance(group[k], torch.Tensor) else group[k]) for k in keys}
    out["step"] = int(group["step"].item())
    return out


def _snapshot_adam_like(run: Run) -> list[dict]:
    snap = snapshot(run.inner(), MOMENTS, updated=lambda p: _updated(run, p), read=_moment64)
    return [moments(items) for items in snap]


def _check_8bit_moment(stored: torch.Tensor, absmax: torch.Tensor, ref: torch.Tensor, err: torch.Tensor,
                       signed: bool, what: str) -> None:
    """An 8-bit moment within the quantizer's resolution (docs/optim.md, "8-bit moments") of the reference:
    ``0.0434 |x| + (c_min / 2 + 2^-24) absmax`` of its block, plus the fp32 budget of the value quantized."""
    rel, floor = resolution(signed)
    n = stored.numel()
    block = absmax.to(F64).repeat_interleave(256)[:n].reshape(stored.shape)
    deq = from_state8(stored, signed).to(F64)
    budget = rel * (ref.abs() + err) + floor * block + err
    assert_within(deq, ref, budget, what)


def _check_adam(run: Run, snap: list[dict]) -> None:
    opt = run.inner()
    for group, items in zip(opt.param_groups, snap):
        if not items["params"]:
            continue
        hp = _hp(group, ("lr", "betas", "eps", "weight_decay", "bias_correction"))
        targets = [_updated(run, p) for p in items["params"]]
        eight = [opt.state[p]["exp_avg"].dtype == torch.uint8 for p in items["params"]]
        check_adam_lists(items, targets, None, None, hp=hp, adam_w_mode=opt.adam_w_mode)
        _, ref_m, ref_v = adam_step(items["p"], items["g"], items["m"], items["v"], adam_w_mode=opt.adam_w_mode,
                                    **hp)
        b1, b2 = hp["betas"]
        for i, p in enumerate(items["params"]):
            st = opt.state[p]
            a_g = items["g"][i].abs()
            err_m = K * U32 * (b1 * items["m"][i].abs() + (1 - b1) * a_g)
            err_v = K * U32 * (b2 * items["v"][i] + (1 - b2) * a_g**2)
            _check_moments(st, ref_m[i], ref_v[i], err_m, err_v, eight[i], i)
        _check_model_copies(run, items["params"], targets)


def _check_moments(st: dict, ref_m, ref_v, err_m, err_v, eight: bool, i: int) -> None:
    """Both moments of row ``i`` against their float64 references: 8-bit codes through their absmax, fp32 directly."""
    if eight:
        _check_8bit_moment(st["exp_avg"], st["exp_avg_absmax"], ref_m, err_m, True, f"exp_avg {i}")
        _check_8bit_moment(st["exp_avg_sq"], st["exp_avg_sq_absmax"], ref_v, err_v, False, f"exp_avg_sq {i}")
    else:
        assert_within(st["exp_avg"], ref_m, err_m, f"exp_avg {i}")
        assert_within(st["exp_avg_sq"], ref_v, err_v, f"exp_avg_sq {i}")


def _lamb_from_moments(p0, m, v, hp, adam_w_mode, use_nvlamb):
    """LAMB's parameter update from given (stored) moments, float64: 8-bit LAMB computes ``u`` and its norms from
    the moments as stored (docs/optim.md, "8-bit moments")."""
    b1, b2 = hp["betas"]
    t = hp["step"]
    bc1, bc2 = (1 - b1**t, 1 - b2**t) if hp["bias_correction"] else (1.0, 1.0)
    out = []
    for p, mi, vi in zip(p0, m, v):
        u = (mi / bc1) / (torch.sqrt(vi / bc2) + hp["eps"])
        if adam_w_mode and hp["weight_decay"] != 0:
            u = u + hp["weight_decay"] * p
        pn, un = float(p.norm()), float(u.norm())
        trust = (use_nvlamb or hp["weight_decay"] != 0) and pn != 0 and un != 0
        out.append(p - (hp["lr"] * pn / un if trust else hp["lr"]) * u)
    return out


def _check_lamb(run: Run, snap: list[dict]) -> None:
    opt = run.inner()
    maxn = float(opt.defaults["max_grad_norm"])
    norm = clip_terms([g for items in snap for g in items["g"]], maxn)
    for group, items in zip(opt.param_groups, snap):
        if not items["params"]:
            continue
        hp = _hp(group, ("lr", "betas", "eps", "weight_decay", "bias_correction", "grad_averaging"))
        ref_p, ref_m, ref_v = lamb_step(items["p"], items["g"], items["m"], items["v"], max_grad_norm=maxn,
                                        global_norm=norm[0], adam_w_mode=opt.adam_w_mode,
                                        use_nvlamb=opt.use_nvlamb, **hp)
        targets = [_updated(run, p) for p in items["params"]]
        stored = []
        for i, p in enumerate(items["params"]):
            st = opt.state[p]
            eight = st["exp_avg"].dtype == torch.uint8
            new_m, new_v = _moment64(st, "exp_avg"), _moment64(st, "exp_avg_sq")
            stored.append((new_m, new_v))
            err_p, err_m, err_v = lamb_budgets(items["p"][i], items["g"][i], items["m"][i], items["v"][i],
                                               ref_m[i], ref_v[i], hp=hp, clip=norm[1], delta_clip=norm[2],
                                               adam_w_mode=opt.adam_w_mode, use_nvlamb=opt.use_nvlamb)
            _check_moments(st, ref_m[i], ref_v[i], err_m, err_v, eight, i)
        if any(opt.state[p]["exp_avg"].dtype == torch.uint8 for p in items["params"]):
            # the update from the moments as stored: its own reference, the same per-element budget
            ref_p = _lamb_from_moments(items["p"], [m for m, _ in stored], [v for _, v in stored], hp,
                                       opt.adam_w_mode, opt.use_nvlamb)
        for i, target in enumerate(targets):
            err_p = lamb_budgets(items["p"][i], items["g"][i], items["m"][i], items["v"][i], ref_m[i], ref_v[i],
                                 hp=hp, clip=norm[1], delta_clip=norm[2], adam_w_mode=opt.adam_w_mode,
                                 use_nvlamb=opt.use_nvlamb)[0]
            assert_within(target, ref_p[i], _stored_budget(err_p, ref_p[i], target.dtype), f"param {i}")
        _check_model_copies(run, items["params"], targets)


def _check_model_copies(run: Run, params: list, targets: list) -> None:
    """Master-weights mode: the model param is the rounded master bit for bit (split: the high half, round to
    nearest with ties away; stochastic: one of the two bf16 neighbours, checked by the budget)."""
    for i, (p, t) in enumerate(zip(params, targets)):
        if t is not p and t.dtype != p.dtype and run.inner().state[p].get("master") is not None:
            assert torch.equal(p.detach(), t.to(p.dtype)), f"model copy {i} is not round(master)"


class _Proxy:
    """The optimizer as the apex helpers see it (they call ``opt.step()`` between their snapshot and their check),
    with ``step`` the cell's way of stepping."""

    def __init__(self, run: Run, grads: Sequence[torch.Tensor | None]) -> None:
        self._run, self._grads = run, grads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run.inner(), name)

    def step(self) -> None:
        take_step(self._run, self._grads)


def _check_larc(run: Run, grads: Sequence[torch.Tensor | None]) -> None:
    """LARC(FusedSGD without momentum or decay): ``p - lr g'`` with ``g'`` apex's LARC gradient (``larc_grads``).
    Budget of ``g'`` (tests/optim/test_larc.py): ``(K u + 2 gamma(n)) |g| a`` plus two ulps of the grad dtype;
    of the update: ``K u (|p| + lr |g'|) + lr err(g')``."""
    opt = run.inner()
    group = opt.param_groups[0]
    live = [(p, g) for p, g in zip(group["params"], grads) if g is not None]
    p0 = [_updated(run, p).detach().to(F64, copy=True) for p, _ in live]
    g64 = [g.to(F64) for _, g in live]
    lr = float(group["lr"])
    want = larc_grads(p0, g64, lr=lr, weight_decay=0.0, trust_coefficient=run.opt.trust_coefficient,
                      clip=run.opt.clip, eps=run.opt.eps)
    take_step(run, grads)
    for i, ((p, g), gi, wi, pi) in enumerate(zip(live, g64, want, p0)):
        n = max(1, gi.numel())
        a = (wi.abs() / gi.abs().clamp_min(1e-300)).nan_to_num(0.0)
        err_g = (K * U32 + 2 * gamma(n, torch.float32)) * gi.abs() * a + 2 * ulp(wi, g.dtype)
        ref = pi - lr * wi
        err_p = K * U32 * (pi.abs() + lr * wi.abs()) + lr * err_g + K * 2.0**-149
        target = _updated(run, p)
        assert_within(target, ref, _stored_budget(err_p, ref, target.dtype), f"param {i}")


def checked_step(run: Run, grads: Sequence[torch.Tensor | None]) -> None:
    """Oracle 1: install ``grads``, take the step, check it against the float64 reference."""
    install_grads(run, grads)
    kind = run.cell.opt.kind
    # (amp O2 recomputes the grads in take_step from a linear loss at scale 1: the same values as installed here)
    if kind in ("adam", "lamb"):
        snap = _snapshot_adam_like(run)
        take_step(run, grads)
        (_check_adam if kind == "adam" else _check_lamb)(run, snap)
    elif kind == "larc":
        _check_larc(run, grads)
    else:
        check = {"sgd": sgd_step_and_check, "adagrad": adagrad_step_and_check,
                 "novograd": novograd_step_and_check}[kind]
        check(_Proxy(run, grads))


def skipped_step(run: Run, grads: Sequence[torch.Tensor | None]) -> None:
    """Oracle 3: the step is skipped and writes nothing."""
    install_grads(run, grads)
    before = bits(run)
    take_step(run, grads)
    assert_same_bits(bits(run), before, "a skipped step wrote")


def expects_skip(run: Run, kind: str) -> bool:
    if kind in ("inf", "nan"):
        return True
    if kind == "huge":
        dt = run.params[next(i for i, p in enumerate(run.params) if p.numel())].dtype
        return run.cell.opt.huge_skips(HUGE[dt] / current_scale(run))
    return False


#: a batch's schedule: one run takes every gradient kind as a step of its own, each step held to its own oracles
#: from the actual state before it, so each step is one cell's verdict (the ``grads`` axis costs no extra run)
BATCH = ("finite", "inf", "nan", "huge", "none", "finite")


def schedule(c: Cell, batched: bool = False) -> tuple[str, ...]:
    """The gradient kinds of a run's steps: a single cell's three steps (finite, its kind, finite), or ``BATCH``."""
    return BATCH if batched else ("finite", c.grads.name, "finite")


def _ckpt_state(run: Run) -> dict:
    return {"opt": run.opt.state_dict(), "params": [p.detach().clone() for p in run.params],
            "scaler": None if run.scaler is None else run.scaler.state_dict()}


def trajectory(c: Cell, pg: Any = None, ckpt: str | None = None, kinds: Sequence[str] | None = None) -> Run:
    """The run's steps (``kinds``, default the cell's three) with oracles 1 and 3; with ``ckpt`` the state after the
    first step is saved there (``torch.save``) with the params and the scaler's state. A failed oracle is recorded
    against its step (``run.failures``) and the run goes on from the actual state (the oracles start from it); an
    error that is not an oracle's ends the run, recorded against the step and every later one."""
    run = build(c, pg)
    run.kinds = tuple(kinds or schedule(c))
    taken = 0
    for k, kind in enumerate(run.kinds):
        try:
            grads = grads_for(run, k, kind)
            run.log.append(grads)
            if expects_skip(run, kind):
                skipped_step(run, grads)
            else:
                checked_step(run, grads)
                taken += 1
            _all_finite(run)
            _counts(run, taken)
        except AssertionError as e:
            run.failures.append((k, f"step {k} ({kind}): {e}"))
        except Exception as e:  # the run cannot go on: this step and every later one fail
            run.failures += [(i, f"step {k} ({kind}) raised {e!r}") for i in range(k, len(run.kinds))]
            return run
        finally:
            run.after.append(bits(run))
            run.eight.append(_eight(run))
        if k == 0 and ckpt is not None:
            torch.save(_ckpt_state(run), ckpt)
    return run


def _counts(run: Run, taken: int) -> None:
    """The first group (it has grads at every step) counts the steps taken, exactly (at 2**31 fp32 cannot count)."""
    step = run.inner().param_groups[0].get("step")
    if isinstance(step, torch.Tensor) and run.cell.layout.name != "step_2e31":
        assert float(step.reshape(-1)[0]) == taken, f"group 0's step counter reads {float(step)} after {taken} steps"


def _all_finite(run: Run) -> None:
    for t in bits(run):
        if t.is_floating_point():
            assert torch.isfinite(t).all(), "inf/NaN in params, masters or state"


def resumed(c: Cell, ckpt: str, ref: Run, pg: Any = None) -> list[tuple[int, str]]:
    """Oracle 4's second half: a fresh model and optimizer loaded from ``ckpt`` (weights_only), then the
    uninterrupted run ``ref``'s later steps with the same gradients, compared with it bit for bit after each step;
    returns the failures by step."""
    try:
        run = build(c, pg)
        saved = torch.load(ckpt, weights_only=True)
        with torch.no_grad():
            for p, s in zip(run.params, saved["params"]):
                p.copy_(s)
        run.opt.load_state_dict(saved["opt"])
        if run.scaler is not None:
            run.scaler.load_state_dict(saved["scaler"])
    except Exception as e:
        return [(k, f"resume: loading the checkpoint raised {e!r}") for k in range(1, len(ref.kinds))]
    out = []
    for k, grads in enumerate(ref.log[1:], start=1):  # unscaled, as in the uninterrupted run (the scaler: saved)
        try:
            install_grads(run, grads)
            take_step(run, grads)
            assert_same_bits(bits(run), ref.after[k], "the resumed run differs from the uninterrupted one")
        except AssertionError as e:
            out.append((k, f"step {k} ({ref.kinds[k]}) after a resume: {e}"))
        except Exception as e:
            return out + [(i, f"step {k} ({ref.kinds[k]}) after a resume raised {e!r}")
                          for i in range(k, len(ref.kinds))]
    return out


def run_cell(c: Cell, pg: Any = None, kinds: Sequence[str] | None = None) -> Run:
    """Oracles 1, 3 and 4 for one accepted cell's run (or a batch's: ``kinds``), failures recorded by step in
    ``run.failures``; returns the uninterrupted run (for oracle 2)."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "opt.pt")
        run = trajectory(c, pg, ckpt, kinds)
        if os.path.exists(ckpt):
            run.failures += resumed(c, ckpt, run, pg)
    return run


def twins(c: Cell) -> list[tuple[Cell, str]]:
    """Oracle 2: the runs to compare with (``axes.twin_cells``), and how (``"bits"``: every state tensor and param
    bit for bit; ``"moments8"``: 8-bit codes and absmax bit for bit; ``"reference"``: each within the float64 budget
    of its own reference, run by the twin itself)."""
    out = []
    for t in twin_cells(c):
        if t.backend != c.backend:  # host, ZeRO-1, functional: the other backend
            how = "moments8" if c.moments.bits == 8 and c.opt.state8 and c.weights.master != "stochastic" \
                else "reference"
        elif c.path.name == "device":
            # bit for bit where every row is a kernel row; rows the kernels do not take (non-contiguous) run the
            # torch passes, whose masked (device-step) and host-branch (host-vector) sequences round differently
            # (docs/optim.md, "Where each optimizer's math lives")
            how = "reference" if c.layout.noncontiguous else "bits"
        else:  # compiled: the eager step
            how = "bits"
        out.append((t, how))
    return out


def compare(a: Run, b: Run, how: str) -> list[tuple[int, str]]:
    """Oracle 2 between a run and its twin, after each step (the same schedule): the failures by step."""
    out = []
    for k in range(min(len(a.after), len(b.after))):
        try:
            if how == "bits":
                assert_same_bits(a.after[k], b.after[k], f"{a.cell.id} against {b.cell.id}")
            elif how == "moments8":
                assert [n for n, _ in a.eight[k]] == [n for n, _ in b.eight[k]], "different 8-bit state"
                for (name, x), (_, y) in zip(a.eight[k], b.eight[k]):
                    assert_same_bits([x], [y], f"8-bit {name}, {a.cell.id} against {b.cell.id}")
        except AssertionError as e:
            out.append((k, f"step {k} ({a.kinds[k]}): {e}"))
    return out


def _eight(run: Run) -> list[tuple[str, torch.Tensor]]:
    """The 8-bit codes and their absmax, named (oracle 2's ``moments8``: bit for bit between the backends)."""
    opt = run.inner()
    out = []
    for i, p in enumerate(run.params):
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
            x = opt.state.get(p, {}).get(key)
            if x is not None and (x.dtype == torch.uint8 or "absmax" in key):
                out.append((f"{key} of param {i}", x.detach().clone()))
    return out
