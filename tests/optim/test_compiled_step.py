"""``torch.compile(opt.step)`` for FusedLAMB and FusedAdam (fp16kit/optim/_base.py, docs/optim.md).

A compiled step is one graph (no more graph breaks than ``torch.optim.AdamW``'s, measured side by side with
``torch._dynamo.explain``), holds the ``fp16kit::`` ops (fp16kit/kernels/library.py) and no host read, and
gives the eager step's bits: the compiled graph runs the same op implementations on the same values, and
its hyper-parameter arithmetic (float64 scalars) is the eager arithmetic under "eager"/"aot_eager". Inductor
(``@pytest.mark.slow``: minutes of compile time on the CI box) regenerates that scalar arithmetic, so there
the budget is 2 ulp of the parameter dtype instead of 0.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fp16kit import _versions, amp
from fp16kit.optim import FusedAdam, FusedLAMB

CONFIGS = {  # param dtype, master_weights
    "fp32": (torch.float32, False),
    "bf16-master": (torch.bfloat16, True),
    "fp16": (torch.float16, False),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _make(cls, dtype=torch.float32, master=False, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (7, 33, 3)]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}]
    return params, cls(groups, lr=1e-2, weight_decay=0.01, master_weights=master, **kw)


def _set_grads(params, k, scale=1.0, inf_at=None):
    gen = torch.Generator().manual_seed(100 + k)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
    if inf_at is not None:
        params[inf_at].grad[0] = float("inf")


def _assert_same(params_a, opt_a, params_b, opt_b):
    """Bit-identical params, state (moments, masters) and step counters."""
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
        for key in opt_a.state[a]:
            assert torch.equal(opt_a.state[a][key], opt_b.state[b][key]), key
    for ga, gb in zip(opt_a.param_groups, opt_b.param_groups):
        assert torch.equal(ga["step"], gb["step"])


def _explain(opt):
    return torch._dynamo.explain(opt.step)()


def _host_reads(graphs) -> list[str]:
    """Nodes that read a tensor on the host. Dynamo turns a Python float hyper-parameter into a graph input
    that it reads back with ``item()``: that is a host value, not a device read, so an ``item`` of a graph
    input is allowed; an ``item`` of anything the step computed is not."""
    bad = []
    for gm in graphs:
        for n in gm.graph.nodes:
            name = str(n.target)
            reads = name in ("item", "tolist", "data_ptr") or "_local_scalar_dense" in name
            if reads and not (name == "item" and n.args and n.args[0].op == "placeholder"):
                bad.append(name)
    return bad


def _targets(graphs) -> list[str]:
    return [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]


def test_graph_breaks_no_more_than_torch_adamw():
    """explain(opt.step) on ours beside torch.optim.AdamW, same params and grads, after one eager step (state
    exists, as after a warm-up): ours is one graph with no more breaks (torch 2.13: 0), also with a scaler's
    hand-over; the graph calls the fp16kit:: ops and reads nothing on the host."""
    params, adamw = _make(lambda g, master_weights, **kw: torch.optim.AdamW(g, **kw))
    _set_grads(params, 0)
    adamw.step()
    torch_breaks = _explain(adamw).graph_break_count
    for cls, kind in ((FusedAdam, "adam"), (FusedLAMB, "lamb")):
        params, opt = _make(cls, torch.bfloat16, master=True)
        _set_grads(params, 0)
        opt.step()
        for scaled in (False, True) if cls is FusedLAMB else (True,):
            if scaled:  # torch.amp.GradScaler's forms: 0-dim fp32
                opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
            torch._dynamo.reset()
            ex = _explain(opt)
            assert ex.graph_count == 1 and ex.graph_break_count <= torch_breaks, ex.break_reasons
            targets = _targets(ex.graphs)
            assert any("fp16kit.check_and_norm" in t for t in targets), targets
            assert any(f"fp16kit.{kind}_update" in t for t in targets), targets
            assert not _host_reads(ex.graphs)


def test_first_step_compiles_state_creation_without_host_read():
    """A fresh optimizer's first step, compiled: state and step counters are created in the graph (no break);
    the only ``item`` nodes are Dynamo's reads of Python-float graph inputs."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    params, opt = _make(FusedLAMB, torch.float16, master=True)
    _set_grads(params, 0)
    torch.compile(opt.step, backend=record, fullgraph=True)()
    assert any("fp16kit.lamb_update" in t for t in _targets(graphs))
    assert not _host_reads(graphs)
    assert all(opt.state[p]["master"].dtype == torch.float32 for p in params)


FAST = [(FusedAdam, "fp16", "aot_eager"), (FusedLAMB, "bf16-master", "eager")]  # the rest: -m slow
FULL = [(c, k, b) for c in (FusedAdam, FusedLAMB) for k in CONFIGS for b in ("eager", "aot_eager")]


@pytest.mark.parametrize(
    "cls,config,backend", FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in FULL if case not in FAST]
)
def test_compiled_equals_eager(cls, config, backend):
    """3 steps, the first compiled one creating the state, bitwise as eager; the middle step under a
    torch.amp.GradScaler-style hand-over (0-dim grad_scale/found_inf) with an inf grad is skipped alike."""
    dtype, master = CONFIGS[config]
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        params, opt = _make(cls, dtype, master)
        step = torch.compile(opt.step, backend=backend) if compiled else opt.step
        for k in range(3):
            scaled = k >= 1
            if scaled:
                opt.grad_scale, opt.found_inf = torch.tensor(256.0), torch.tensor(0.0)
            _set_grads(params, k, 256.0 if scaled else 1.0, inf_at=1 if k == 1 else None)
            step()
            if scaled:
                assert float(opt.found_inf) == (1.0 if k == 1 else 0.0)
                del opt.grad_scale, opt.found_inf
        runs.append((params, opt))
    _assert_same(*runs[0], *runs[1])
    assert [float(g["step"]) for g in runs[1][1].param_groups] == [2.0, 2.0]


def test_tensor_lr_schedule_compiles_once():
    """A tensor lr changed in place every step (a scheduler): no recompile after the first two compiles (state
    creation, then steady state), and eager's bits. A Python-float lr is guarded: each new value recompiles."""
    from torch._dynamo.testing import CompileCounter

    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        params, opt = _make(FusedLAMB, torch.bfloat16, master=True)
        for group in opt.param_groups:
            group["lr"] = torch.tensor(group["lr"])
        step = torch.compile(opt.step, backend=counter) if compiled else opt.step
        for k in range(4):
            _set_grads(params, k)
            step()
            for group in opt.param_groups:
                group["lr"].mul_(0.5)
        runs.append((params, opt))
    _assert_same(*runs[0], *runs[1])
    assert counter.frame_count == 2


@pytest.mark.interpreter
def test_compiled_equals_eager_triton_interpreter():
    """The same with the Triton kernels (interpreter) behind the ops."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        params, opt = _make(FusedLAMB, torch.bfloat16, master=True)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        _set_grads(params, 0)
        opt.step()
        _set_grads(params, 1)
        step()
        runs.append((params, opt))
    _assert_same(*runs[0], *runs[1])


@pytest.mark.parametrize("cls,scaler_cls", [(FusedAdam, amp.GradScaler), (FusedLAMB, torch.amp.GradScaler)])
def test_compiled_step_under_grad_scaler(cls, scaler_cls):
    """``opt.step = torch.compile(opt.step)`` driven by fp16kit's or torch's GradScaler (its grad_scale/found_inf
    hand-over), an overflowing step included: same params, state, scale and (``unscale_grads``) grads as eager."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        params, opt = _make(cls, torch.float16, master=True)
        opt.unscale_grads = cls is FusedLAMB  # apex's grads-left-unscaled mode: fp16kit::unscale_and_check
        if compiled:
            opt.step = torch.compile(opt.step, backend="eager")
        scaler = scaler_cls("cpu", init_scale=2.0**12, growth_interval=1)
        grads = []
        for k in range(3):
            loss = sum((p.float() * (k + 1)).square().sum() for p in params)
            scaler.scale(loss).backward()
            if k == 1:
                params[0].grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            grads += [p.grad.clone() for p in params]
            opt.zero_grad()
        runs.append((params, opt, scaler.get_scale(), grads))
    _assert_same(*runs[0][:2], *runs[1][:2])
    assert runs[0][2] == runs[1][2]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][3], runs[1][3]))
    assert all(float(g["step"]) < 3 for g in runs[1][1].param_groups)  # the overflowing step was skipped


def test_compiled_warn_reads_nothing_and_counts():
    """``on_nonfinite="warn"`` (default) in a compiled step: no host read (no graph break), no warning; the
    skipped step is counted on the device in ``nonfinite_skips``; nothing changes."""
    params, opt = _make(FusedAdam, torch.float32)
    _set_grads(params, 0)
    opt.step()
    before = [p.detach().clone() for p in params]
    _set_grads(params, 1, inf_at=0)
    assert _explain(opt).graph_break_count == 0
    torch._dynamo.reset()
    _set_grads(params, 1, inf_at=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(opt.step, backend="aot_eager")()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert int(opt.nonfinite_skips) == 2  # the explained trace ran the step too
    with pytest.warns(RuntimeWarning, match="inf or NaN"):  # the eager step still warns
        opt.step()
    assert int(opt.nonfinite_skips) == 3


def test_compiled_raise_still_raises():
    """``on_nonfinite="raise"`` keeps its host read in a compiled step (a documented sync: one graph break)."""
    params, opt = _make(FusedLAMB, torch.float32, on_nonfinite="raise")
    _set_grads(params, 0, inf_at=2)
    with pytest.raises(RuntimeError, match="inf or NaN"):
        torch.compile(opt.step, backend="eager")()
    assert [float(g["step"]) for g in opt.param_groups] == [0.0, 0.0]


def test_compiled_step_counter_set_by_hand_is_checked_on_device():
    """A NaN step counter installed by hand is not read on the host in a compiled step: the step is skipped
    on the device (as for a NaN tensor lr) instead of turning the weights NaN."""
    params, opt = _make(FusedAdam, torch.float32)
    _set_grads(params, 0)
    opt.step()
    opt.param_groups[1]["step"] = torch.tensor([float("nan")])
    before = [p.detach().clone() for p in params]
    _set_grads(params, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(opt.step, backend="aot_eager")()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert int(opt.hparam_skips) == 1
    with pytest.raises(ValueError, match="step counter"):  # eager reads it and says so
        opt.step()


def _mlp_run(compiled: bool, backend: str = "aot_eager"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    scaler = amp.GradScaler("cpu", init_scale=2.0**10)

    def train_step(x, y):
        with amp.autocast(torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    fn = torch.compile(train_step, backend=backend) if compiled else train_step
    gen = torch.Generator().manual_seed(1)
    losses = [fn(torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)) for _ in range(3)]
    return model, opt, scaler, losses


@pytest.mark.skipif(
    not _versions.dynamo_traces_any_id(),
    reason="torch < 2.13: Dynamo cannot trace GradScaler.step's hand-over (optimizer.grad_scale = ...) inside a "
    "compiled region; the compiled optimizer step alone is tested above on every torch",
)
def test_compiled_training_step_equals_eager():
    """autocast(bf16) + GradScaler + FusedAdam on a tiny MLP: the compiled training step (aot_eager) gives
    eager's losses, params, state and scale for 3 steps."""
    me, oe, se, le = _mlp_run(False)
    torch._dynamo.reset()
    mc, oc, sc, lc = _mlp_run(True)
    _assert_same(list(me.parameters()), oe, list(mc.parameters()), oc)
    assert all(torch.equal(a, b) for a, b in zip(le, lc))
    assert se.get_scale() == sc.get_scale()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    spacing = torch.finfo(a.dtype).eps * a.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
    return float(((a.float() - b.float()).abs() / spacing).max())


@pytest.mark.slow
@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
def test_inductor_step_within_two_ulp(cls):
    """Inductor regenerates the scalar hyper-parameter arithmetic: params within 2 ulp of eager after 3 steps."""
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        params, opt = _make(cls, torch.bfloat16, master=True)
        step = torch.compile(opt.step) if compiled else opt.step
        for k in range(3):
            _set_grads(params, k)
            step()
        runs.append((params, opt))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert _ulps(runs[0][1].state[a]["master"], runs[1][1].state[b]["master"]) <= 2
