"""Soak test (issue 9, item 7; issue 22): long seeded runs with random faults, hyper-parameter changes and
checkpoint/resume cycles over FusedLAMB, FusedAdam, FusedSGD, FusedAdagrad, FusedNovoGrad and torch optimizers,
under fp16kit's GradScaler, amp O1/O2 or no scaler.

A run follows a plan drawn up front from a seed (so two runs can follow the same one). Per step, at random:

- a fault: one grad element set to inf or NaN after backward (amp: the loss times inf); the step must be skipped;
- an overflow (FusedSGD, FusedAdagrad, FusedNovoGrad; always on the first step too): a whole grad set to a
  *finite* value whose update would be inf (Adagrad's g * g, Nesterov's g + momentum * m, NovoGrad's per-tensor
  norm); the result check must skip the step as for an inf grad (issue 22, item 2);
- a hyper-parameter change: a valid new lr; an invalid host value (NaN/negative lr, beta1 = 1, eps = 0,
  negative weight decay; for the apex optimizers also lr = 1e308, weight_decay = 1e300, momentum = 1e300 or 1.5)
  that ``step()`` must reject with ValueError before changing anything (then the value is restored and the step
  taken); or a NaN tensor lr (fp16kit optimizers) that must skip the step on the device;
- a checkpoint: model, optimizer and scaler/amp state go through ``torch.save``/``torch.load`` into freshly built
  objects (initialised differently), and training continues from them.

Invariants: weights, masters and optimizer state are finite after every step; the optimizer's step counter equals
steps taken minus injected faults and overflows minus NaN-lr steps; and a run with checkpoints ends bit-identical
to the same plan without them. CI runs the small version (~30 steps per case); ``-m slow`` runs long plans and
the Triton kernels under the interpreter.
"""

from __future__ import annotations

import copy
import io
import random
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from fp16kit import amp
from fp16kit.amp import GradScaler
from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

INVALID = {
    "lr_nan": ("lr", float("nan")),
    "lr_negative": ("lr", -1e-3),
    "beta1_one": ("betas", (1.0, 0.999)),
    "eps_zero": ("eps", 0.0),
    "wd_negative": ("weight_decay", -0.01),
    # absurd host values (issue 22, item 3): beyond float32, or a momentum that grows the buffer geometrically
    "lr_huge": ("lr", 1e308),
    "wd_huge": ("weight_decay", 1e300),
    "momentum_huge": ("momentum", 1e300),
    "momentum_above_one": ("momentum", 1.5),
}
_BASIC = ("lr_nan", "lr_negative", "beta1_one", "eps_zero", "wd_negative")
#: the invalid values each optimizer is fed (keys it has)
INVALID_FOR = {
    "sgd": ("lr_nan", "lr_negative", "wd_negative", "lr_huge", "wd_huge", "momentum_huge", "momentum_above_one"),
    "adagrad": ("lr_nan", "lr_negative", "eps_zero", "wd_negative", "lr_huge", "wd_huge"),
    "novograd": (*_BASIC, "lr_huge", "wd_huge"),
}
#: the apex optimizers, with the finite (unscaled) grad value whose update overflows float32
APEX = {
    "sgd": (lambda params, **kw: FusedSGD(params, momentum=0.9, nesterov=True, **kw), 3e38),  # g + 0.9 m
    "adagrad": (lambda params, **kw: FusedAdagrad(params, **kw), 3e19),  # g * g
    "novograd": (lambda params, **kw: FusedNovoGrad(params, **kw), 3e38),  # the norm of >= 4 such elements
}


@dataclass(frozen=True)
class Case:
    optimizer: str  # "lamb" | "adam" | "torch_adamw" | "sgd" | "adagrad" | "novograd"
    mode: str  # "scaler" | "O1" | "O2" | "none"
    dtype: torch.dtype = torch.float32
    master_weights: bool = False
    tensor_lr: bool = False


CASES = {
    "lamb-gradscaler": Case("lamb", "scaler", tensor_lr=True),
    "adam-gradscaler-bf16-masters": Case("adam", "scaler", torch.bfloat16, master_weights=True),
    "torch_adamw-gradscaler": Case("torch_adamw", "scaler"),
    "lamb-noscaler-fp16-masters": Case("lamb", "none", torch.float16, master_weights=True, tensor_lr=True),
    "lamb-O1": Case("lamb", "O1"),
    "adam-O2": Case("adam", "O2", tensor_lr=True),
    "torch_adamw-O2": Case("torch_adamw", "O2"),
    "sgd-noscaler-nesterov": Case("sgd", "none", tensor_lr=True),
    "adagrad-gradscaler-bf16-masters": Case("adagrad", "scaler", torch.bfloat16, master_weights=True),
    "adagrad-noscaler": Case("adagrad", "none", tensor_lr=True),
    "novograd-noscaler": Case("novograd", "none", tensor_lr=True),
    "novograd-gradscaler-bf16-masters": Case("novograd", "scaler", torch.bfloat16, master_weights=True),
}


@dataclass
class Step:
    fault: tuple[int, int, float] | None = None  # (param index, flat element, value)
    overflow: int | None = None  # the param whose whole grad gets a finite value that overflows the update
    lr: float | None = None  # a valid new lr
    invalid: str | None = None  # a key of INVALID
    nan_tensor_lr: bool = False
    checkpoint: bool = False


def _overflows(case: Case) -> bool:
    """Can a finite grad overflow this case's update? Under a loss scale S the unscaled grads stay below
    fp32max / S, so only Adagrad's g * g (with a bf16/fp32 grad) can; without a scaler every apex optimizer."""
    return case.optimizer in APEX and (case.mode == "none" or case.optimizer == "adagrad")


def make_plan(seed: int, steps: int, case: Case) -> list[Step]:
    rng = random.Random(seed)
    plan = []
    for k in range(steps):
        s = Step()
        if rng.random() < 0.15:
            s.fault = (rng.randrange(4), rng.randrange(8), rng.choice([float("inf"), float("-inf"), float("nan")]))
        elif _overflows(case) and rng.random() < 0.1:
            s.overflow = rng.randrange(4)
        r = rng.random()
        if r < 0.1:
            s.lr = rng.choice([1e-3, 3e-3, 1e-2])
        elif r < 0.2 and s.fault is None and s.overflow is None:
            s.invalid = rng.choice(INVALID_FOR.get(case.optimizer, _BASIC))
        elif r < 0.27 and case.tensor_lr:
            s.nan_tensor_lr = True
        s.checkpoint = k > 0 and rng.random() < 0.12
        plan.append(s)
    # every kind of event at least once, even in a short plan
    if case.optimizer in APEX:  # a skipped very first step (NovoGrad's v = n must wait for the next one)
        plan[0] = Step(overflow=rng.randrange(4)) if _overflows(case) else Step(fault=(1, 0, float("inf")))
    if not any(s.fault for s in plan):
        plan[2].fault, plan[2].invalid, plan[2].overflow = (0, 1, float("nan")), None, None
    if not any(s.checkpoint for s in plan):
        plan[steps // 2].checkpoint = True
    if not any(s.invalid for s in plan):
        k = next(k for k in range(3, steps) if plan[k].fault is None and plan[k].overflow is None)
        plan[k].invalid, plan[k].nan_tensor_lr = rng.choice(INVALID_FOR.get(case.optimizer, _BASIC)), False
    if case.tensor_lr and not any(s.nan_tensor_lr for s in plan):
        k = next(k for k in range(steps - 1, 0, -1) if plan[k].invalid is None)
        plan[k].nan_tensor_lr = True
    return plan


@dataclass
class Run:
    case: Case
    seed: int
    model: nn.Module = field(init=False)
    opt: torch.optim.Optimizer = field(init=False)
    scaler: GradScaler | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.build(self.seed)

    def build(self, seed: int) -> None:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        if self.case.mode in ("scaler", "none"):
            model = model.to(self.case.dtype)
        lr = torch.tensor([3e-3]) if self.case.tensor_lr else 3e-3
        kw = {"lr": lr, "weight_decay": 0.01}
        if self.case.optimizer == "torch_adamw":
            opt = torch.optim.AdamW(model.parameters(), **kw)
        elif self.case.optimizer in APEX:
            make = APEX[self.case.optimizer][0]
            opt = make(list(model.parameters()), master_weights=self.case.master_weights, on_nonfinite="warn", **kw)
        else:
            cls = FusedLAMB if self.case.optimizer == "lamb" else FusedAdam
            opt = cls(model.parameters(), master_weights=self.case.master_weights, on_nonfinite="warn", **kw)
        if self.case.mode in ("O1", "O2"):
            model, opt = amp.initialize(model, opt, opt_level=self.case.mode, verbosity=0, loss_scale="dynamic")
        elif self.case.mode == "scaler":
            self.scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=5)
        self.model, self.opt = model, opt

    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def step(self, k: int, s: Step) -> None:
        g = torch.Generator().manual_seed(10_000 + k)
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        self.opt.zero_grad()
        if s.lr is not None:
            self._set_lr(s.lr)
        if s.nan_tensor_lr:
            saved_lr = self.opt.param_groups[0]["lr"].clone()
            self.opt.param_groups[0]["lr"].fill_(float("nan"))
        dtype = self.case.dtype if self.case.mode in ("scaler", "none") else torch.float32
        loss = (self.model(x.to(dtype)).float() - y).square().mean()
        if self.case.mode in ("O1", "O2"):
            if s.fault is not None:
                loss = loss * float("inf")
            with amp.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
        elif self.case.mode == "scaler":
            self.scaler.scale(loss).backward()
        else:
            loss.backward()
        if s.fault is not None and self.case.mode not in ("O1", "O2"):
            i, j, value = s.fault
            grad = self.params()[i].grad.view(-1)
            grad[j % grad.numel()] = value
        if s.overflow is not None:
            value = APEX[self.case.optimizer][1] * (self.scaler.get_scale() if self.scaler is not None else 1.0)
            self.params()[s.overflow].grad.fill_(value)
        if s.invalid is not None:
            self._check_invalid_rejected(s.invalid)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Gradient overflow")
            warnings.simplefilter("ignore", RuntimeWarning)  # the on_nonfinite="warn" reports of expected skips
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
        if s.nan_tensor_lr:
            self.opt.param_groups[0]["lr"].copy_(saved_lr)

    def _set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr

    def _check_invalid_rejected(self, name: str) -> None:
        if self.case.optimizer == "torch_adamw":
            return  # torch's optimizers do not check after construction: nothing fp16kit promises there
        key, value = INVALID[name]
        group = self.opt.param_groups[0]
        old = group[key]
        group[key] = value
        before = self.bits()
        with pytest.raises(ValueError, match=key):
            self.opt.step()
        group[key] = old
        assert all(torch.equal(a, b) for a, b in zip(self.bits(), before)), f"{name}: a rejected step changed state"

    def checkpoint_and_resume(self) -> None:
        ckpt = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        if self.scaler is not None:
            ckpt["scaler"] = self.scaler.state_dict()
        if self.case.mode in ("O1", "O2"):
            ckpt["amp"] = amp.state_dict()
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=False)
        self.build(self.seed + 1)  # different initial weights: everything must come from the checkpoint
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(ckpt["scaler"])
        if self.case.mode in ("O1", "O2"):
            amp.load_state_dict(ckpt["amp"])

    def tensors(self) -> list[torch.Tensor]:
        out = [p.detach() for p in self.params()]
        if self.case.mode in ("O1", "O2"):
            out += [m.detach() for m in amp.master_params(self.opt)]
        for state in self.opt.state.values():
            out += [v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"]
        return out

    def bits(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors()]

    def steps_taken(self) -> int:
        if self.case.optimizer == "torch_adamw":
            return int(next(iter(self.opt.state.values()))["step"])
        return int(self.opt.param_groups[0]["step"])


def soak(case: Case, seed: int, steps: int, *, resume: bool) -> tuple[list[torch.Tensor], dict]:
    plan = make_plan(seed, steps, case)
    run = Run(case, seed)
    for k, s in enumerate(plan):
        run.step(k, s)
        for i, t in enumerate(run.tensors()):
            assert torch.isfinite(t).all(), f"step {k}: tensor {i} is not finite ({s})"
        if resume and s.checkpoint:
            run.checkpoint_and_resume()
    faults = sum(s.fault is not None or s.overflow is not None for s in plan)
    nan_lr = sum(s.nan_tensor_lr and s.fault is None and s.overflow is None for s in plan)
    assert run.steps_taken() == steps - faults - nan_lr, "skipped steps differ from the injected faults"
    extra = {"taken": run.steps_taken()}
    if run.scaler is not None:
        extra["scale"] = run.scaler.get_scale()
    return [t.clone() for t in run.tensors()], extra


def _soak_and_compare(case: Case, seed: int, steps: int) -> None:
    resumed, extra_a = soak(case, seed, steps, resume=True)
    straight, extra_b = soak(case, seed, steps, resume=False)
    assert extra_a == extra_b
    assert len(resumed) == len(straight)
    for i, (a, b) in enumerate(zip(resumed, straight)):
        assert torch.equal(a, b), f"tensor {i} differs between the resumed and the uninterrupted run"


@pytest.fixture(autouse=True)
def _amp_session_isolation():
    yield
    from fp16kit.amp._frontend import state, stepping

    stepping.REPORTS.clear()
    state.set_current_session(None)


@pytest.mark.parametrize("name", sorted(CASES))
def test_soak_small(name):
    _soak_and_compare(CASES[name], seed=sorted(CASES).index(name), steps=24)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", sorted(CASES))
def test_soak_long(name, seed):
    _soak_and_compare(CASES[name], seed=seed, steps=200)


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize(
    "name",
    ["lamb-gradscaler", "adam-gradscaler-bf16-masters", "lamb-noscaler-fp16-masters", "sgd-noscaler-nesterov",
     "adagrad-gradscaler-bf16-masters", "novograd-noscaler"],
)
def test_soak_triton_interpreter(name):
    with use_backend("auto"):
        _soak_and_compare(copy.deepcopy(CASES[name]), seed=7, steps=40)


# ---------------------------------------------------------------- cases that need fixes outside the optimizer layer


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -8.0])
def test_soak_scaler_rejects_invalid_new_scale(bad):
    """A random invalid scale change in a GradScaler run must raise and leave the scale as it was."""
    run = Run(Case("lamb", "scaler"), seed=3)
    plan = make_plan(3, 10, run.case)
    for k, s in enumerate(plan):
        run.step(k, Step(fault=s.fault))
        if k == 5:
            scale = run.scaler.get_scale()
            with pytest.raises((ValueError, RuntimeError, AssertionError, TypeError)):
                run.scaler.update(torch.tensor([bad]))
            assert run.scaler.get_scale() == scale
    assert all(torch.isfinite(t).all() for t in run.tensors())


@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_soak_o2_param_group_added_after_initialize(optimizer):
    """At O2 the optimizer steps fp32 masters only; a group added mid-run (an fp16 param, as the model's) must
    get masters too, and train with unscaled grads."""
    run = Run(Case(optimizer, "O2"), seed=4)
    extra = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    forward = run.model.forward
    run.model.forward = lambda x: forward(x) + extra.float()
    plan = make_plan(4, 12, run.case)
    for k, s in enumerate(plan):
        if k == 4:
            run.opt.add_param_group({"params": [extra]})
        run.step(k, Step(fault=s.fault))
        # fp16kit's fused optimizers keep the master in their state (amp/_frontend/masters.py), others in the groups
        assert all(
            p.dtype == torch.float32 or run.opt.state[p]["master"].dtype == torch.float32
            for g in run.opt.param_groups for p in g["params"]
        ), "the optimizer steps a param without an fp32 master"
        assert all(torch.isfinite(t).all() for t in run.tensors())
