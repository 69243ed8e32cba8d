"""The device-resident step of apex's optimizers, FusedSGD, FusedAdagrad and FusedNovoGrad (docs/optim.md, "The step
on the device"): two launches per step and kernel group whatever the number of tensors (the check pass and the result
check in one read of the grads, finished on the device; the update, which derives its hyper-parameters from launch
arguments and advances the step counter), NovoGrad two more (its per-tensor norms and second moments); host-op counts
that do not grow with the number of tensors, no host value made and nothing read back, and the same params, state,
counters and skip counts as the host-vector step, bit for bit.

Launches and torch ops are counted as in ``test_device_step.py`` (the interpreter's launcher, a ``TorchDispatchMode``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_device_step import _params, _step_fn, counting

from fp16kit.amp import GradScaler
from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdagrad, FusedNovoGrad, FusedSGD

MAKERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda ps, **k: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, **k),
    "sgd-nesterov-wd-after": lambda ps, **k: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                      wd_after_momentum=True, **k),
    "sgd-plain": lambda ps, **k: FusedSGD(ps, lr=0.1, **k),
    "adagrad": lambda ps, **k: FusedAdagrad(ps, lr=0.1, weight_decay=0.01, **k),
    "adagrad-w": lambda ps, **k: FusedAdagrad(ps, lr=0.1, weight_decay=0.01, adagrad_w_mode=True, **k),
    "novograd": lambda ps, **k: FusedNovoGrad(ps, lr=0.1, weight_decay=0.01, **k),
    "novograd-reg-inside-init-zero": lambda ps, **k: FusedNovoGrad(ps, lr=0.1, weight_decay=0.01, init_zero=True,
                                                                   reg_inside_moment=True, grad_averaging=False, **k),
    "novograd-no-bias-correction": lambda ps, **k: FusedNovoGrad(ps, lr=0.1, bias_correction=False,
                                                                 betas=(0.95, 0.98), **k),
}
STATE = {"sgd": ("momentum_buffer",), "adagrad": ("sum",), "novograd": ("exp_avg", "exp_avg_sq")}
#: Triton launches per step and kernel group: check-and-verify, update; NovoGrad's per-tensor norms add the norm
#: partials and the per-tensor blend of the second moment (``triton/novograd.py``).
BUDGETS = {"sgd": 2, "adagrad": 2, "novograd": 4}
HOST_OPS = {"aten.lift_fresh", "aten.scalar_tensor", "aten.full", "aten._to_copy", "aten.copy_",
            "aten._local_scalar_dense", "aten.ones", "aten.zeros", "aten.empty", "aten.cat", "aten.fill_",
            "aten.zero_", "aten.clone", "aten.add_", "aten.sub", "aten.reciprocal"}


def _steady_step(opt: torch.optim.Optimizer, scaler: GradScaler | None = None) -> tuple[dict, dict]:
    """Launches and torch ops of a third step (the first two make the state, tables and plans)."""
    one = _step_fn(opt, scaler)
    for _ in range(2):
        one()
    with counting() as (launches, ops):
        one()
    return launches, ops.counts


def _state_keys(kind: str) -> tuple[str, ...]:
    return STATE[kind.split("-")[0]]


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "novograd"])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_launch_budget_and_op_count_do_not_grow_with_tensors(kind, with_scaler):
    counts = {}
    for n in (12, 48):  # both below the planner's 64-tensor switch (see test_device_step.py)
        scaler = GradScaler("cpu", init_scale=256.0) if with_scaler else None
        launches, ops = _steady_step(MAKERS[kind](_params(n, numel=4)), scaler)
        counts[n] = (sum(launches.values()), sum(ops.values()), dict(launches), dict(ops))
    assert counts[12][0] == counts[48][0] == BUDGETS[kind], counts
    assert counts[12][1] == counts[48][1], counts
    # what stays is per step: views of the flag, the profiler's record_function, the CPU read of "warn" (a pinned
    # non-blocking copy on CUDA), and the scaler's own ops
    assert counts[48][1] <= (12 if with_scaler else 8), counts


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["sgd", "sgd-plain", "adagrad", "novograd"])
@pytest.mark.parametrize("with_scaler", [False, True])
def test_step_creates_no_host_value_and_reads_nothing_back(kind, with_scaler):
    """As ``test_device_step.py``'s test of the same name: with ``on_nonfinite="skip"`` the step makes no tensor
    from host values, copies, fills or clones nothing, does no hyper-parameter arithmetic and reads nothing."""
    opt = MAKERS[kind](_params(40, numel=4), on_nonfinite="skip")
    if with_scaler:  # a scaler's hand-over, as GradScaler.step makes it
        opt.grad_scale = torch.full((1,), 256.0)
        opt.found_inf = torch.zeros(1)
    launches, ops = _steady_step(opt)
    seen = {name.rsplit(".", 1)[0] for name in ops}
    assert not (seen & HOST_OPS), ops
    assert sum(launches.values()) == BUDGETS[kind.split("-")[0]], launches


def _run(kind: str, steps: int, dtype: torch.dtype, *, scaler_scale: float | None = None, lr_tensor: bool = False,
         inject_inf_at: int | None = None, huge_grad_at: int | None = None, groups: bool = False,
         backend: str = "triton", **kwargs) -> tuple[list, dict]:
    """``steps`` steps (a learning-rate change before the third); params, state, counters and skip counts."""
    ps = _params(6, 4096 + 37, dtype=dtype, seed=3)
    with use_backend(backend):
        if groups:  # two param groups of two dtypes: two kernel groups, each checked before either is written
            ps[3:] = [p.detach().half().requires_grad_() for p in ps[3:]]
            opt = MAKERS[kind]([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.05}], **kwargs)
        else:
            opt = MAKERS[kind](ps, **kwargs)
        if lr_tensor:
            for grp in opt.param_groups:
                grp["lr"] = torch.tensor(0.1)
        one = _step_fn(opt, GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None)
        g = torch.Generator().manual_seed(7)
        for i in range(steps):
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * (scaler_scale or 1.0) * 1e-2).to(p.dtype)
            if inject_inf_at == i:
                ps[1].grad[5] = float("inf")
            if huge_grad_at == i:  # finite, but g * g (Adagrad), the norm (NovoGrad) past fp32's range: result skip
                ps[2].grad[7:9] = 3e38 if ps[2].grad.dtype != torch.float16 else 6e4
            if i == 2:
                for grp in opt.param_groups:
                    if lr_tensor:
                        grp["lr"].fill_(0.03)
                    else:
                        grp["lr"] = grp["lr"] * 0.3
            one()
        state = {k: [opt.state[p][k].clone() for p in ps if k in opt.state[p]] for k in _state_keys(kind)}
        state["master"] = [opt.state[p]["master"].clone() for p in ps if "master" in opt.state[p]]
        state["step"] = [grp["step"].clone() for grp in opt.param_groups]
        for name in ("nonfinite_skips", "result_skips", "hparam_skips"):
            count = getattr(opt, name)
            state[name] = [count.clone()] if count is not None else []
    return [p.detach().clone() for p in ps], state


CASES = [
    dict(dtype=torch.float32),
    dict(dtype=torch.float32, scaler_scale=1024.0, inject_inf_at=1),
    dict(dtype=torch.float16, scaler_scale=1024.0, master_weights=True),
    dict(dtype=torch.float32, lr_tensor=True),
    dict(dtype=torch.bfloat16, master_weights=True, inject_inf_at=0),
    dict(dtype=torch.float32, huge_grad_at=1, on_nonfinite="skip"),
    dict(dtype=torch.float32, scaler_scale=1.0, huge_grad_at=2),
    dict(dtype=torch.float32, groups=True, inject_inf_at=3),
]
IDS = ["fp32", "fp32-scaler-overflow", "fp16-master", "tensor-lr-changed", "bf16-master-first-step-inf",
       "result-check-skip", "result-check-skip-scaler", "two-groups-two-dtypes"]


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_device_step_equals_the_host_vector_step_bit_for_bit(kind, case, monkeypatch):
    """The kernels read ``lr``, ``momentum``, ``eps``, ... from launch arguments, ``1/scale`` and a tensor ``lr``
    on the device, and finish the check pass and the result check on the device; the same kernels fed the host-built
    float32 vector after the separate check pass and result check (the path a compiled or sharded step takes) give
    the same params, state, masters, step counters and skip counts."""
    from fp16kit.optim._apex_common import ApexStateOptimizer

    if "-" in kind and case.get("groups"):
        pytest.skip("one variant of each optimizer is enough for the two-group case")
    steps = 4
    device_out = _run(kind, steps, **case)
    monkeypatch.setattr(ApexStateOptimizer, "_on_device", lambda self, device: False)
    vector_out = _run(kind, steps, **case)
    for a, b in zip(device_out[0], vector_out[0]):
        assert torch.equal(a, b)
    assert device_out[1].keys() == vector_out[1].keys()
    for key in device_out[1]:
        assert len(device_out[1][key]) == len(vector_out[1][key]), key
        for a, b in zip(device_out[1][key], vector_out[1][key]):
            assert torch.equal(a, b), (key, a, b)
    if kind.startswith(("adagrad", "novograd")) and case.get("huge_grad_at") is not None:  # g * g, the norm
        assert device_out[1]["result_skips"][0].item() == 1
    if case.get("inject_inf_at") is not None and not case.get("scaler_scale"):
        assert device_out[1]["nonfinite_skips"][0].item() == 1


@pytest.mark.interpreter
def test_the_device_step_runs_and_reports():
    """The step above really is the device step (launch names), and its skips reach ``on_nonfinite`` as before."""
    ps = _params(4)
    opt = FusedSGD(ps, lr=0.1, momentum=0.9, on_nonfinite="warn")
    opt.step()
    ps[0].grad[0] = float("nan")
    with counting() as (launches, _), pytest.warns(RuntimeWarning, match="inf or NaN"):
        opt.step()
    assert dict(launches) == {"_sgd_kernel": 2}
    assert opt.nonfinite_skips.item() == 1 and opt.param_groups[0]["step"].item() == 1.0


@pytest.mark.interpreter
def test_rows_outside_the_kernels_keep_the_host_vector_step():
    """A float64 param goes to the torch fallback: the whole step then takes the host-vector path."""
    ps = [*_params(3), torch.randn(8, dtype=torch.float64, requires_grad=True)]
    ps[-1].grad = torch.randn(8, dtype=torch.float64)
    opt = FusedSGD(ps, lr=0.1, momentum=0.9)
    opt.step()
    with counting() as (launches, _):
        opt.step()
    assert "_sumsq_kernel" in launches  # the host-vector step's separate check pass


@pytest.mark.interpreter
def test_a_changed_lr_needs_no_new_table_or_plan():
    """A scheduler's new ``lr`` is a launch argument: no address table is built, nothing is copied."""
    from fp16kit.kernels.engine import table as _table

    opt = FusedSGD(_params(8), lr=0.1, momentum=0.9, on_nonfinite="skip")
    opt.step()
    opt.step()
    builds = _table.stats["builds"]
    with counting() as (_, ops):
        for lr in (0.05, 0.02, 0.01):
            opt.param_groups[0]["lr"] = lr
            opt.step()
    assert _table.stats["builds"] == builds
    seen = {name.rsplit(".", 1)[0] for name in ops.counts}
    assert not (seen & HOST_OPS), ops.counts


@pytest.mark.interpreter
def test_novograd_inf_norm_and_first_step_keep_the_host_vector_step():
    """NovoGrad's device step is the L2 norm's, from the second step on (the first creates the state)."""
    for norm_type, step_launches in ((2, 4), (0, 6)):  # the inf-norm: check pass, 2 x (absmax, verify or update)
        opt = FusedNovoGrad(_params(4), lr=0.1, norm_type=norm_type)
        with counting() as (first, _):
            opt.step()
        with counting() as (second, _):
            opt.step()
        assert "_novograd_prepare_kernel" not in first
        assert sum(second.values()) == step_launches, second


def test_capturable_is_accepted():
    ps = _params(2)
    for opt in (FusedAdagrad(ps, capturable=True), FusedSGD(ps, lr=0.1, capturable=True),
                FusedNovoGrad(ps, capturable=True)):
        assert opt.capturable is True


# --------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "novograd"])
def test_cuda_graph_capture_replays_equal_eager(kind):
    """torch's documented capture of ``opt.step()`` with a tensor ``lr`` changed between replays."""
    from test_device_step import _cuda_params, replay_against_eager

    ps = _cuda_params(20, 3000, 1)
    ref_ps = [p.detach().clone().requires_grad_() for p in ps]
    for r, p in zip(ref_ps, ps):
        r.grad = p.grad.clone()
    lr = torch.tensor(1e-2, device="cuda")
    opt, ref = MAKERS[kind](ps, capturable=True), MAKERS[kind](ref_ps, capturable=True)
    for grp in opt.param_groups:
        grp["lr"] = lr
    for grp in ref.param_groups:
        grp["lr"] = lr.clone()
    replay_against_eager(opt, ref, lr, 4e-3)
    for a, b in zip(ps, ref_ps):
        assert torch.equal(a, b)
    assert torch.equal(opt.param_groups[0]["step"], ref.param_groups[0]["step"])
