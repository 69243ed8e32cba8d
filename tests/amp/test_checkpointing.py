"""Activation checkpointing and the other places torch re-runs or transforms forward code, under fp16kit's autocast
(fp16kit/amp/_recompute.py; docs/autocast.md, "Activation checkpointing").

The oracle is the same model run without checkpointing: loss and every gradient must be equal bit for bit, under
both engines (``dispatch``, the default, and ``mode``), fp16 and bf16 regions, fp32 and bf16 parameters. The block
holds the rows where fp16kit differs from torch's CPU lists (``softmax``, ``exp``, ``sum``, ``layer_norm``,
``rsqrt``), and an ``exp`` of values >= 12, which overflows in fp16 unless its FP32 row applies: before the
recomputation re-entered fp16kit's region, ``use_reentrant=False`` raised torch's ``CheckpointError``,
``use_reentrant=True`` gave other gradients (inf/NaN in fp16), and bf16 parameters raised dtype errors.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from fp16kit import _versions, amp
from fp16kit.amp import _torch_custom_fn, autocast_mode

ENGINES = ("dispatch", "mode")
LOW = (torch.float16, torch.bfloat16)
PARAMS = (torch.float32, torch.bfloat16)


@pytest.fixture(params=ENGINES)
def engine(request):
    with autocast_mode.use_engine(request.param):
        yield request.param


class Block(nn.Module):
    """A residual block whose forward reaches the rows where fp16kit's table differs from torch's CPU lists."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        big = (h.abs() + 12).exp()  # >= e**12 = 162755: inf in fp16, finite under the FP32 row
        h = h.softmax(-1) * big.sum(-1, keepdim=True).rsqrt() * 100
        return self.l2(self.ln(h)) + x


def _model(pdtype: torch.dtype, n: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n)]).to(pdtype)


def _sac_context():
    saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _forward(model: nn.Sequential, x: torch.Tensor, form: str) -> torch.Tensor:
    if form == "none":
        return model(x)
    if form in ("reentrant", "non_reentrant"):
        for block in model:
            x = checkpoint(block, x, use_reentrant=form == "reentrant")
        return x
    if form in ("sequential", "sequential_reentrant"):
        return checkpoint_sequential(model, 2, x, use_reentrant=form == "sequential_reentrant")
    if form == "selective":
        for block in model:
            x = checkpoint(block, x, use_reentrant=False, context_fn=_sac_context)
        return x
    if form == "nested":  # a checkpoint inside a checkpointed function
        return checkpoint(lambda y: checkpoint(model[1], model[0](y), use_reentrant=False), x, use_reentrant=False)
    if form == "save_on_cpu":
        with torch.autograd.graph.save_on_cpu():
            return model(x)
    if form == "save_on_cpu+checkpoint":
        with torch.autograd.graph.save_on_cpu():
            return _forward(model, x, "non_reentrant")
    raise AssertionError(form)


FORMS = ("reentrant", "non_reentrant", "sequential", "sequential_reentrant", "selective", "nested", "save_on_cpu",
         "save_on_cpu+checkpoint")


def _run(pdtype: torch.dtype, low: torch.dtype, form: str) -> list[torch.Tensor]:
    model = _model(pdtype)
    torch.manual_seed(1)
    x = torch.randn(4, 16, dtype=pdtype, requires_grad=True)
    with amp.autocast(dtype=low):
        loss = _forward(model, x, form).float().square().mean()
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for p in model.parameters())]


def _assert_same(ref: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.dtype == b.dtype, (what, i, a.dtype, b.dtype)
        assert torch.equal(a, b), (what, i, (a.float() - b.float()).abs().max().item())


def _check_forms(engine: str, combos, forms=FORMS) -> None:
    for pdtype, low in combos:
        ref = _run(pdtype, low, "none")
        assert all(t.isfinite().all() for t in ref), (pdtype, low)
        for form in forms:
            _assert_same(ref, _run(pdtype, low, form), f"{engine} {pdtype} {low} {form}")


def test_every_checkpoint_form_gives_the_uncheckpointed_gradients(engine):
    """Every form, fp32 parameters in fp16 and bf16 parameters in bf16 (the rest of the matrix: ``-m slow``)."""
    _check_forms(engine, [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])


@pytest.mark.slow
def test_every_checkpoint_form_every_dtype_pairing(engine):
    _check_forms(engine, [(p, d) for p in PARAMS for d in LOW])


def test_recomputation_runs_under_the_forwards_region_not_the_backwards(engine):
    """The state recorded at the checkpointed forward is re-entered, whatever region backward runs in: a forward
    outside every region recomputes outside it when backward is called inside a bf16 region; a forward inside an
    fp16 region recomputes inside it when backward is called inside ``disable_casts`` or a bf16 region. The reference
    is the same forward and backward without checkpointing."""

    def run(form: str, fwd_region, bwd_region) -> list[torch.Tensor]:
        model = _model(torch.float32)
        torch.manual_seed(1)
        x = torch.randn(4, 16, requires_grad=True)
        with fwd_region():
            loss = _forward(model, x, form).float().square().mean()
        with bwd_region():
            loss.backward()
        return [loss.detach(), x.grad, *(p.grad for p in model.parameters())]

    cases = {
        "outside/bf16": (contextlib.nullcontext, lambda: amp.autocast(dtype=torch.bfloat16)),
        "fp16/disable_casts": (lambda: amp.autocast(dtype=torch.float16), amp.disable_casts),
        # the mode engine: autograd runs the recomputation with an empty torch-function mode stack, so the replay
        # pushes the thread's mode again
        "fp16/bf16": (lambda: amp.autocast(dtype=torch.float16), lambda: amp.autocast(dtype=torch.bfloat16)),
    }
    for name, (fwd_region, bwd_region) in cases.items():
        ref = run("none", fwd_region, bwd_region)
        for form in ("reentrant", "non_reentrant"):
            _assert_same(ref, run(form, fwd_region, bwd_region), f"{engine} {form} {name}")


def test_checkpoint_inside_nested_regions_recomputes_each_region(engine):
    """A checkpointed block inside an inner bf16 region of an fp16 region, and inside ``torch.autocast`` that takes
    over an fp16kit region: the recomputation re-enters the state the forward had at that point."""

    def run(form: str) -> list[torch.Tensor]:
        model = _model(torch.float32)
        torch.manual_seed(1)
        x = torch.randn(4, 16, requires_grad=True)
        with amp.autocast(dtype=torch.float16):
            h = _forward(model[:1], x, form)
            with amp.autocast(dtype=torch.bfloat16):
                h = _forward(model[1:], h, form)
            with torch.autocast("cpu", enabled=False):
                h = _forward(model[:1], h.float(), form)
            loss = h.float().square().mean()
        loss.backward()
        return [loss.detach(), x.grad, *(p.grad for p in model.parameters())]

    ref = run("none")
    for form in ("reentrant", "non_reentrant"):
        _assert_same(ref, run(form), f"{engine} {form}")


class _Scale(torch.autograd.Function):
    """y = x * exp(x); the backward computes ``exp`` again: an FP32 row inside it under ``custom_bwd``."""

    @staticmethod
    @amp.custom_fwd
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x.exp()

    @staticmethod
    @amp.custom_bwd
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        e = x.exp()
        ctx.exp_dtype = e.dtype
        return g * (e + x * e)


def test_custom_bwd_applies_the_table_in_backward_and_under_checkpoint(engine):
    x = torch.randn(8, dtype=torch.bfloat16, requires_grad=True)
    with amp.autocast(dtype=torch.bfloat16):
        y = _Scale.apply(x)
    assert y.dtype == torch.float32  # exp is an FP32 row; bf16 * fp32 promotes
    y.sum().backward()
    assert y.grad_fn.exp_dtype == torch.float32  # the FP32 row applied in backward too (both engines)
    ref = x.grad.clone()
    for reentrant in (True, False):
        x.grad = None
        with amp.autocast(dtype=torch.bfloat16):
            y = checkpoint(_Scale.apply, x, use_reentrant=reentrant)
        y.sum().backward()
        assert torch.equal(x.grad, ref), (engine, reentrant)


def test_torch_func_grad_and_vmap_see_the_region(engine):
    """``torch.func.grad`` of a function that opens a region equals ``torch.autograd.grad`` bit for bit. ``vmap``:
    under the mode engine the rows apply as in the batched call (dtype, and bits of the row-wise ops); the
    dispatcher engine refuses a region inside ``vmap``, naming the mode engine (vmap decomposes ``nn.Linear`` and
    ``Tensor.softmax`` before torch's autocast sees them: ``torch.autocast`` leaves them in fp32 there)."""
    block = _model(torch.float32, n=1)[0]
    params = dict(block.named_parameters())
    x = torch.randn(3, 4, 16)

    def loss_fn(p, xb):
        with amp.autocast(dtype=torch.bfloat16):
            return torch.func.functional_call(block, p, (xb,)).float().square().mean()

    got = torch.func.grad(loss_fn)(params, x)
    ref = torch.autograd.grad(loss_fn(params, x), list(params.values()))
    for name, r in zip(params, ref, strict=True):
        assert torch.equal(got[name], r), (engine, name)

    def fwd(xb):
        with amp.autocast(dtype=torch.bfloat16):
            y = xb.to(torch.bfloat16)
            return block.l1(xb), y.softmax(-1), y.exp(), F.layer_norm(y, (16,)), y.sum(-1)

    if engine == "dispatch":
        with pytest.raises(RuntimeError, match=r"inside torch\.func\.vmap.*FP16KIT_AUTOCAST_ENGINE=mode"):
            torch.func.vmap(fwd)(x)
        return
    batched, mapped = fwd(x), torch.func.vmap(fwd)(x)
    assert [t.dtype for t in batched] == [torch.bfloat16] + [torch.float32] * 4
    for i, (a, b) in enumerate(zip(batched, mapped, strict=True)):
        assert a.dtype == b.dtype, (engine, i, a.dtype, b.dtype)
        if i:
            assert torch.equal(a, b), (engine, i)


def _compiled_grads(form: str, low: torch.dtype, fullgraph: bool = True) -> list[torch.Tensor]:
    model = _model(torch.float32)
    torch.manual_seed(1)
    x = torch.randn(4, 16, requires_grad=True)

    def step(inp):
        return _forward(model, inp, form).float().square().mean()

    fn = torch.compile(step, backend="aot_eager", fullgraph=fullgraph) if form != "none" else step
    with amp.autocast(dtype=low):
        loss = fn(x)
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_checkpointed_block_equals_eager_uncheckpointed():
    """torch.compile over checkpointed blocks (``aot_eager``: the traced aten graph, bit-exact), default engine."""
    with autocast_mode.use_engine("dispatch"):
        ref = _compiled_grads("none", torch.bfloat16)
        for form in ("non_reentrant", "selective"):
            _assert_same(ref, _compiled_grads(form, torch.bfloat16), form)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_checkpoint_every_dtype():
    with autocast_mode.use_engine("dispatch"):
        for low in LOW:
            ref = _compiled_grads("none", low)
            for form in ("non_reentrant", "selective", "reentrant", "sequential"):
                torch._dynamo.reset()
                # Dynamo does not trace checkpoint_sequential (torch/utils is on its skip list): a graph break
                _assert_same(ref, _compiled_grads(form, low, fullgraph=form != "sequential"), f"{low} {form}")


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_checkpoint_under_the_mode_engine_runs_the_block_eagerly(monkeypatch):
    """The mode engine cannot trace its rows into a checkpoint's body (Dynamo traces it as a higher-order op, and
    re-pushing the mode there is a mutation it refuses): fp16kit breaks the graph before the checkpoint call, so the
    block runs eagerly under the region and the gradients are those of eager without checkpointing, bit for bit;
    one ``CompiledCheckpointWarning`` per process names the fix; with ``fullgraph=True`` the graph break is Dynamo's
    error carrying the same message. The whole matrix: ``-m slow``."""
    monkeypatch.setattr(autocast_mode, "_COMPILED_CHECKPOINT_WARNED", [])
    with autocast_mode.use_engine("mode"):
        ref = _compiled_grads("none", torch.bfloat16)
        with pytest.warns(autocast_mode.CompiledCheckpointWarning, match=r"set_engine\('dispatch'\)") as seen:
            got = _compiled_grads("non_reentrant", torch.bfloat16, fullgraph=False)
        _assert_same(ref, got, "mode non_reentrant")
        assert len(seen) == 1
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("error", autocast_mode.CompiledCheckpointWarning)  # once per process
            _assert_same(ref, _compiled_grads("selective", torch.bfloat16, fullgraph=False), "mode selective")
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"mode engine.*dispatcher engine"):
            _compiled_grads("non_reentrant", torch.bfloat16)


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_checkpoint_under_the_mode_engine_every_dtype():
    with autocast_mode.use_engine("mode"), warnings.catch_warnings():
        warnings.simplefilter("ignore", autocast_mode.CompiledCheckpointWarning)
        for low in LOW:
            ref = _compiled_grads("none", low)
            for form in ("non_reentrant", "selective", "reentrant", "sequential"):
                torch._dynamo.reset()
                _assert_same(ref, _compiled_grads(form, low, fullgraph=False), f"{low} {form}")


def _exp_function(fwd, bwd, **fwd_kwargs) -> type[torch.autograd.Function]:
    """y = x @ w; the backward computes ``exp`` (an FP32 row of fp16kit's table, as called on torch's CPU list) of
    the saved ``x`` and a matmul (LOW in both tables), and records their dtypes on ctx."""

    class ExpGrad(torch.autograd.Function):
        @staticmethod
        @fwd(device_type="cpu", **fwd_kwargs)
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        @bwd(device_type="cpu")
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            e = x.exp() * 1e-4  # x = 12: exp overflows in fp16, 16.3 in fp32
            gw = x.t() @ g
            ctx.bwd_dtypes = (e.dtype, gw.dtype)
            return g @ w.t() * e, gw

    return ExpGrad


def _exp_run(fn: type[torch.autograd.Function], fwd_region, bwd_region=contextlib.nullcontext, apply=None,
             x_dtype: torch.dtype = torch.float16):
    x = torch.full((2, 4), 12.0, dtype=x_dtype, requires_grad=True)
    w = torch.full((4, 3), 0.25, requires_grad=True)
    with fwd_region():
        y = (apply or fn.apply)(x, w)
    with bwd_region():
        y.float().sum().backward()
    return getattr(y.grad_fn, "bwd_dtypes", None), [y.detach(), x.grad, w.grad]


def test_torch_amp_custom_fwd_bwd_run_the_backward_under_the_region(engine):
    """``torch.amp.custom_fwd``/``custom_bwd`` re-enter torch's autocast state for their device type around the
    backward; inside an fp16kit region fp16kit re-enters the forward's region there too
    (fp16kit/amp/_torch_custom_fn.py), so the backward runs fp16kit's rows, as with ``amp.custom_fwd``/``custom_bwd``:
    the same dtypes and bits as fp16kit's decorators (the oracle), whatever region ``backward`` is called in. Beside
    it, ``torch.autocast`` alone: torch's decorators behave as without fp16kit (its CPU table: ``exp`` in fp16,
    inf), and the row both tables share (the matmul) has the same dtype under both regions."""
    fp16 = lambda: amp.autocast(dtype=torch.float16)
    ours = _exp_function(amp.custom_fwd, amp.custom_bwd)
    theirs = _exp_function(torch.amp.custom_fwd, torch.amp.custom_bwd)
    ref_dtypes, ref = _exp_run(ours, fp16)
    assert ref_dtypes == (torch.float32, torch.float16)
    assert all(t.isfinite().all() for t in ref)
    for bwd_region in (contextlib.nullcontext, lambda: amp.autocast(dtype=torch.bfloat16), amp.disable_casts):
        dtypes, got = _exp_run(theirs, fp16, bwd_region)
        assert dtypes == ref_dtypes, (engine, dtypes)
        _assert_same(ref, got, f"{engine} torch.amp.custom_bwd")

    torch_fp16 = lambda: torch.autocast("cpu", dtype=torch.float16)
    dtypes, got = _exp_run(theirs, torch_fp16)
    assert dtypes == (torch.float16, torch.float16)  # torch's CPU table; the matmul's row as under fp16kit's region
    assert not got[1].isfinite().all()  # exp(12) overflowed in fp16: torch's own behaviour, left alone


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_torch_amp_custom_fwd_bwd_equal_eager(engine):
    """Under ``torch.compile``, a Function with torch's or fp16kit's decorators called inside a region runs eagerly
    (fp16kit/amp/_torch_custom_fn.py): its backward re-enters the forward's region, so the compiled code gives the
    eager bits (the oracle: fp16kit's decorators, eager), fp16 and bf16, where a traced backward would run torch's
    table (``exp(12)`` in fp16: inf). Outside every region torch's decorators compile whole as without fp16kit
    (``fullgraph=True``, beside the eager run); with ``fullgraph=True`` inside a region the graph break is an error
    that says why and what to do."""
    ours = _exp_function(amp.custom_fwd, amp.custom_bwd)
    theirs = _exp_function(torch.amp.custom_fwd, torch.amp.custom_bwd)

    def compiled(fn, fullgraph=False):
        return torch.compile(lambda x, w: fn.apply(x, w), backend="aot_eager", fullgraph=fullgraph)

    for low in LOW:
        region = lambda low=low: amp.autocast(dtype=low)
        ref_dtypes, ref = _exp_run(ours, region)
        assert all(t.isfinite().all() for t in ref)
        for fn in (theirs, ours):
            torch._dynamo.reset()
            dtypes, got = _exp_run(fn, region, apply=compiled(fn))
            if fn is theirs and not _versions.dynamo_calls_ctx_property_setters():
                # torch 2.11's Dynamo stores ctx attributes without calling the setter: traced whole; the dispatcher
                # engine's backward runs torch's table, the documented limit of that version (exp(12) in fp16
                # overflows); the mode engine's traced backward is under its mode, with the eager bits
                assert dtypes is None, (engine, low)
                if engine == "mode":
                    _assert_same(ref, got, f"{engine} {low} compiled, torch 2.11")
                else:
                    assert low is torch.bfloat16 or not got[1].isfinite().all()
                continue
            assert dtypes == ref_dtypes, (engine, low, dtypes)
            _assert_same(ref, got, f"{engine} {low} compiled {fn.forward.__module__}")

    torch._dynamo.reset()
    eager_dtypes, eager = _exp_run(theirs, contextlib.nullcontext, x_dtype=torch.float32)
    dtypes, got = _exp_run(theirs, contextlib.nullcontext, apply=compiled(theirs, True), x_dtype=torch.float32)
    assert eager_dtypes == (torch.float32, torch.float32)
    assert dtypes is None  # traced whole: the output's grad_fn is the compiled graph's, not the Function's node
    _assert_same(eager, got, f"{engine} no region, fullgraph")

    if _versions.dynamo_calls_ctx_property_setters():
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"fp16kit: an autograd\.Function .* runs eagerly.*fullgraph=True"):
            _exp_run(theirs, lambda: amp.autocast(dtype=torch.float16), apply=compiled(theirs, True))


def test_torch_amp_custom_fwd_cast_inputs_inside_a_region(engine, monkeypatch):
    """``torch.amp.custom_fwd(cast_inputs=torch.float32)``: torch casts the inputs and runs forward and backward with
    autocast off. Inside a region of the dispatcher engine the same happens as under ``torch.autocast`` (dtypes and
    bits). The mode engine keeps torch's autocast flag off, which torch's decorator tests, so nothing is cast there:
    one warning names fp16kit's decorators, which do what torch's do (the oracle)."""
    monkeypatch.setattr(_torch_custom_fn, "_WARNED", [])
    fp16 = lambda: amp.autocast(dtype=torch.float16)
    cast = _exp_function(torch.amp.custom_fwd, torch.amp.custom_bwd, cast_inputs=torch.float32)
    torch_dtypes, torch_got = _exp_run(cast, lambda: torch.autocast("cpu", dtype=torch.float16))
    ours_dtypes, ours_got = _exp_run(_exp_function(amp.custom_fwd, amp.custom_bwd, cast_inputs=torch.float32), fp16)
    assert ours_dtypes == torch_dtypes == (torch.float32, torch.float32)
    _assert_same(torch_got, ours_got, f"{engine} fp16kit's cast_inputs")
    if engine == "dispatch":
        dtypes, got = _exp_run(cast, fp16)
        assert dtypes == torch_dtypes
        _assert_same(torch_got, got, "dispatch torch's cast_inputs")
        return
    with pytest.warns(UserWarning, match=r"cast_inputs.*fp16kit\.amp\.custom_fwd\(cast_inputs=\.\.\.\)"):
        dtypes, _ = _exp_run(cast, fp16)
    assert dtypes == (torch.float32, torch.float16)  # the region's rows, not torch's cast: what the warning says
