"""The dispatcher engine of autocast (fp16kit/amp/_dispatch.py, docs/autocast.md "The dispatcher engine").

Engine-specific contracts; the behaviour every engine shares is tested by the rest of tests/amp, which runs against
this engine with ``FP16KIT_AUTOCAST_ENGINE=dispatch``:

* override kernels are registered on the engine's own key (``AutocastIPU``) only for the aten ops whose fp16kit
  rule differs from torch's kernel on CPU or CUDA; the ops where they agree keep torch's C++ kernel, and torch's own
  autocast keys are never touched (with the default table);
* outside an fp16kit region, plain ``torch.autocast`` gives torch's dtypes and bits with the kernels installed, in
  eager and compiled code, and reaches no kernel of ours;
* compiled == eager: dtypes under aot_eager and inductor, bits under aot_eager, with ``fullgraph=True``, the region
  outside or inside the compiled function;
* the plan follows the table (``policy_override``), and :func:`_dispatch.uninstall` gives torch its kernels back.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_autocast_compile import Small

from fp16kit.amp import _dispatch as D
from fp16kit.amp import autocast, autocast_mode, disable_casts, is_autocast_enabled, policy_override
from fp16kit.numerics.assertions import assert_bitwise_equal

LOW = (torch.float16, torch.bfloat16)
IDS = ["fp16", "bf16"]


@pytest.fixture(autouse=True)
def dispatch_engine():
    """This engine for the test, installed afresh (kernels registered for earlier tables stay registered until
    ``uninstall``, which the kernel-source checks below would see); afterwards the engine the session runs (and,
    under the mode engine, no kernels)."""
    before = autocast_mode.engine()
    autocast_mode.set_engine("dispatch")
    D.uninstall()
    D.install(autocast_mode.cast_args)
    yield
    autocast_mode.set_engine(before)
    if before != "dispatch":
        D.uninstall()


def _kernel_source(op: str, key: str = "AutocastCPU") -> str:
    lines = [ln for ln in torch._C._dispatch_dump_table(op).splitlines() if ln.startswith(f"{key}:")]
    return "fallthrough" if not lines or "fallthrough" in lines[0] else lines[0]


def test_overrides_only_where_fp16kit_differs_from_torch():
    cpu = D.installed_ops("AutocastCPU")
    # torch's CPU kernels run these LOW or FP32, as fp16kit's table does: no Python kernel on them
    for agree in ("linear", "addmm", "mm", "bmm", "matmul", "conv2d", "baddbmm", "mse_loss", "nll_loss"):
        assert agree not in cpu, agree
        assert "autocast_mode.cpp" in _kernel_source(f"aten::{agree}"), agree
    # torch's CPU autocast leaves these alone (FP32 rows), has no kernel for in-place forms, raises on fp16 + bf16
    # (cat: PROMOTE), runs binary_cross_entropy in fp32 (BANNED here) and casts avg_pool3d (absent here)
    for differ in ("softmax.int", "layer_norm", "exp", "exp_", "sum", "addmm_", "atan2", "binary_cross_entropy"):
        assert differ in cpu, differ
        assert "_dispatch.py" in _kernel_source(f"aten::{differ}", D.KEY), differ
        assert "_dispatch.py" not in _kernel_source(f"aten::{differ}"), differ  # torch's CPU key untouched
    assert cpu["avg_pool3d"][0] is D.AS_CALLED and cpu["reflection_pad1d"][0] is D.AS_CALLED
    assert cpu["exp"][0][0].name == "FP32"
    assert _kernel_source("aten::relu", D.KEY) == "fallthrough"  # an op neither casts is not touched
    for agree in ("linear", "mm", "conv2d"):
        assert _kernel_source(f"aten::{agree}", D.KEY) == "fallthrough", agree


def test_torch_autocast_keys_carry_no_kernel_of_ours_with_the_default_table():
    """Plain ``torch.autocast`` code pays nothing for the engine (issue 23, item 2): every override sits on the
    engine's own key, which only a region of the engine puts in the dispatch path."""
    assert D.cuda_overrides() == {}
    for name in D._LIVE:
        for key in D.KEYS:
            assert "_dispatch.py" not in _kernel_source(f"aten::{name}", key), (name, key)
    own = torch._C.DispatchKey.AutocastIPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch._C._dispatch_tls_is_dispatch_key_excluded(own)  # not in torch.autocast's path
    with autocast(dtype=torch.bfloat16):
        assert not torch._C._dispatch_tls_is_dispatch_key_excluded(own)
        assert torch._C._dispatch_tls_is_dispatch_key_included(own)
    assert torch._C._dispatch_tls_is_dispatch_key_excluded(own)


def test_a_user_edited_row_that_torch_cuda_casts_gets_a_cuda_kernel():
    """On CUDA tensors torch's kernel runs before the engine's key: a row the user changes against it gets a kernel
    on ``AutocastCUDA`` (its cost is documented); the default table needs none."""
    with policy_override({"linear": "fp32", "softmax": "low", F.gelu: "low"}):
        # torch's CUDA autocast runs softmax in fp32 and linear low; it has no gelu kernel to pre-empt
        assert {name.partition(".")[0] for name in D.cuda_overrides()} == {"linear", "softmax"}
        assert "_dispatch.py" in _kernel_source("aten::linear", "AutocastCUDA")
        assert "_dispatch.py" in _kernel_source("aten::linear", D.KEY)
    assert D.cuda_overrides() == {}


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_torch_cpu_kernels_missing_from_its_test_lists_are_known(low):
    """The rules ``_dispatch`` adds to torch's test lists are torch's real behaviour (fp32 inputs come out in the
    region's dtype, bit for bit the manual cast), so those ops keep torch's C++ kernel and no Python hop."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))
    a, b = torch.randn(4, 16), torch.randn(4, 16)
    x, w = torch.randn(1, 2, 9), torch.randn(3, 2, 3)
    calls = {
        "scaled_dot_product_attention": (lambda: F.scaled_dot_product_attention(q, k, v),
                                         lambda: F.scaled_dot_product_attention(q.to(low), k.to(low), v.to(low))),
        "linalg_vecdot": (lambda: torch.linalg.vecdot(a, b), lambda: torch.linalg.vecdot(a.to(low), b.to(low))),
        "_convolution": (
            lambda: torch._convolution(x, w, None, [1], [0], [1], False, [0], 1, False, False, True),
            lambda: torch._convolution(x.to(low), w.to(low), None, [1], [0], [1], False, [0], 1, False, False, True),
        ),
    }
    assert set(calls) == set(D._RULES_MISSING_FROM_TEST_LISTS["AutocastCPU"])
    D.uninstall()  # torch's own kernels only
    for name, (call, manual) in calls.items():
        with torch.autocast("cpu", dtype=low):
            got = call()
        assert got.dtype == low, name
        assert torch.equal(got, manual()), name
    with autocast(dtype=low):
        pass  # installs the engine again
    cpu = D.installed_ops("AutocastCPU")
    assert "scaled_dot_product_attention" not in cpu and "linalg_vecdot" not in cpu
    assert "_convolution.deprecated" not in cpu


def test_rows_without_an_aten_op_are_listed():
    # Python composites: this engine sees their aten constituents only (docs/autocast.md says which still match)
    assert set(D.composite_rows()) == {
        "softmin", "local_response_norm", "normalize", "multilabel_soft_margin_loss", "interpolate", "grid_sample"
    }


def _ops(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Ops whose kernels this engine replaces on AutocastCPU, called on fp32 ``x`` and low-precision ``y``."""
    return [
        torch.softmax(y, -1),
        F.layer_norm(y, (8,)),
        y.exp(),
        y.sum(),
        torch.cat([x, y]),
        F.pad(y.reshape(1, 4, 8), (2, 2), mode="reflect"),  # reflection_pad1d, torch CPU: fp32; fp16kit: as called
        F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(-x)),
        F.scaled_dot_product_attention(x.reshape(1, 4, 8), x.reshape(1, 4, 8), x.reshape(1, 4, 8)),
        F.linear(x, x),
    ]


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_plain_torch_autocast_is_unaffected_outside_fp16kit_regions(low):
    x = torch.randn(4, 8)
    y = torch.randn(4, 8).to(low)
    D.uninstall()
    with torch.autocast("cpu", dtype=low):
        ref = _ops(x, y)
    D.install(autocast_mode.cast_args)
    with torch.autocast("cpu", dtype=low):
        got = _ops(x, y)
    for r, g in zip(ref, got):
        assert_bitwise_equal(g, r)
    with autocast(dtype=low), disable_casts(), torch.autocast("cpu", dtype=low):  # a disabled fp16kit region
        for r, g in zip(ref, _ops(x, y)):
            assert_bitwise_equal(g, r)


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_inside_a_region_the_ops_follow_fp16kit(low):
    x = torch.randn(4, 8)
    y = torch.randn(4, 8).to(low)
    with autocast(dtype=low):
        assert is_autocast_enabled()
        assert torch.softmax(y, -1).dtype == torch.float32 and F.layer_norm(y, (8,)).dtype == torch.float32
        assert_bitwise_equal(y.exp(), y.float().exp())
        assert torch.cat([y, y.to(torch.bfloat16 if low is torch.float16 else torch.float16)]).dtype == torch.float32
        assert F.pad(y.reshape(1, 4, 8), (2, 2), mode="reflect").dtype == low  # absent: run as called
        assert F.linear(x, x).dtype == low  # torch's C++ kernel
        with pytest.raises(RuntimeError, match=r"Cannot call in-place torch\.Tensor\.exp_"):
            y.clone().exp_()
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(torch.sigmoid(y), torch.rand_like(y))
        m = torch.randn(4, 4)
        m2 = m.clone().addmm_(y, y.t())  # in-place LOW: the others are cast to self's dtype (fp32)
        with disable_casts():
            assert_bitwise_equal(m2, torch.addmm(m, y.float(), y.float().t()))
        assert y.sum(dtype=low).dtype == low  # explicit dtype= runs as called
    assert not is_autocast_enabled()
    assert y.exp().dtype == low


def test_the_plan_follows_the_table():
    y = torch.randn(4, 8)
    with autocast(dtype=torch.bfloat16):
        assert torch.softmax(y, -1).dtype == torch.float32
        with policy_override({"softmax": "low", "linear": "fp32"}):
            assert torch.softmax(y, -1).dtype == torch.bfloat16
            assert F.linear(y.bfloat16(), y.bfloat16()).dtype == torch.float32  # torch's LOW kernel overridden
        assert torch.softmax(y, -1).dtype == torch.float32
        assert F.linear(y, y).dtype == torch.bfloat16
    assert "linear" not in D.installed_ops()  # agrees again: torch's kernel runs (ours passes through to it)


def test_uninstall_removes_the_kernels():
    assert "_dispatch.py" in _kernel_source("aten::binary_cross_entropy", D.KEY)
    assert "autocast_mode.cpp" in _kernel_source("aten::binary_cross_entropy")  # torch's, installed or not
    D.uninstall()
    assert "autocast_mode.cpp" in _kernel_source("aten::binary_cross_entropy")
    assert _kernel_source("aten::softmax.int", D.KEY) == "fallthrough"
    with autocast(dtype=torch.bfloat16):  # a region installs them again
        assert torch.softmax(torch.randn(2, 2).bfloat16(), -1).dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------------
# Python-level rows: the wrapped functions of torch.nn.functional
# ----------------------------------------------------------------------------------------------------------------


def _composites(y: torch.Tensor) -> list[torch.Tensor]:
    """The four rows whose aten constituents do not give the row's dtype and bits (all FP32), on ``y`` (32 values)."""
    img = y.reshape(1, 2, 4, 4)
    grid = (y[:18] / 4).reshape(1, 3, 3, 2)
    return [
        F.interpolate(img, scale_factor=2, mode="bilinear"),
        F.grid_sample(img, grid, align_corners=False),
        F.local_response_norm(img, 2),
        F.multilabel_soft_margin_loss(y.reshape(4, 8), (y.reshape(4, 8) > 0).to(y.dtype)),
    ]


def _attr(qual: str):
    owner, _, name = qual.rpartition(".")
    return (F if owner == "torch.nn.functional" else torch.Tensor), name


def test_python_level_rows_are_wrapped_while_installed():
    originals = {qual: getattr(*_attr(qual)) for qual in D.wrapped_functions()}
    names = {qual.rpartition(".")[2] for qual in originals}
    assert {"interpolate", "grid_sample", "local_response_norm", "multilabel_soft_margin_loss", "layer_norm",
            "softmax", "__rtruediv__", "__rdiv__"} <= names
    assert "linear" not in names and "relu" not in names  # a builtin; a function without a row
    for qual, wrapper in originals.items():
        assert getattr(wrapper.__fp16kit_wrapped__, "__name__", None) in (qual.rpartition(".")[2], "__rdiv__")
    D.uninstall()
    assert D.wrapped_functions() == []
    for qual, wrapper in originals.items():
        assert getattr(*_attr(qual)) is wrapper.__fp16kit_wrapped__  # the original is back


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_composite_rows_follow_the_table(low):
    torch.manual_seed(0)
    y = torch.randn(32).to(low)
    with autocast(dtype=low):
        got = _composites(y)
        with disable_casts():
            manual = _composites(y.float())
    for g, m in zip(got, manual):
        assert_bitwise_equal(g, m)  # dtype fp32 and the fp32 computation's bits
    with torch.autocast("cpu", dtype=low):  # outside an fp16kit region: torch's behaviour (as called)
        assert _composites(y)[0].dtype == low


def test_a_wrapped_function_hops_through_no_kernel():
    live = D._LIVE
    real = live["layer_norm"]
    hops: list[int] = []

    class Spy:  # the kernel unpacks its live entry: count that
        def __iter__(self):
            hops.append(1)
            return iter(real)

    live["layer_norm"] = Spy()
    try:
        y = torch.randn(4, 8).bfloat16()
        with autocast(dtype=torch.bfloat16):
            assert F.layer_norm(y, (8,)).dtype == torch.float32
            assert torch.nn.LayerNorm(8)(y).dtype == torch.float32
            assert not hops
            assert torch.layer_norm(y, (8,)).dtype == torch.float32  # the builtin reaches the aten kernel
            assert hops
    finally:
        live["layer_norm"] = real


def test_a_wrapped_function_reads_the_live_row():
    y = torch.randn(4, 8).bfloat16()
    with autocast(dtype=torch.bfloat16):
        with policy_override({"layer_norm": None, "interpolate": "low"}):
            assert F.layer_norm(y, (8,)).dtype == torch.bfloat16  # absent: as called
            assert F.interpolate(y.float().reshape(1, 4, 8), scale_factor=2).dtype == torch.bfloat16
        assert F.layer_norm(y, (8,)).dtype == torch.float32


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_reflected_division_follows_native_promotion(low):
    # 2 / x is x.reciprocal() * 2 in torch's Python, and reciprocal is an FP32 row: the operator itself follows
    # torch's native promotion (as under the mode engine), eager and compiled
    y = torch.randn(8).to(low)

    def ops(y):
        return 2 / y, 2.0 / y, y.reciprocal()

    with autocast(dtype=low):
        eager = ops(y)
        compiled = torch.compile(ops, backend="aot_eager", fullgraph=True)(y)
    assert [t.dtype for t in eager] == [low, low, torch.float32]
    assert_bitwise_equal(eager[0], y.reciprocal() * 2)  # the native computation, outside any region
    for c, e in zip(compiled, eager):
        assert_bitwise_equal(c, e)


def test_torchscript_compiles_through_the_wrappers():
    # torch.jit.script compiles F.* from their source, resolving names in the function's globals: the wrapper must
    # lead it to the original (docs/autocast.md, "The dispatcher engine")
    wrapped = F.layer_norm
    assert wrapped.__globals__ is F.layer_norm.__fp16kit_wrapped__.__globals__
    assert not set(wrapped.__code__.co_names) - {"get"}  # the body reads closure variables only
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Softmax(-1))
    scripted = torch.jit.script(net)

    def up(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2.0)

    x = torch.randn(2, 4)
    assert_bitwise_equal(scripted(x), net(x))
    assert torch.jit.script(up)(x.reshape(1, 2, 4)).shape == (1, 2, 8)
    with autocast(dtype=torch.bfloat16):  # scripted code reaches the aten ops: the override kernels apply the rows
        assert scripted(x).dtype == torch.float32


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_wrapped_function_inside_another_runs_as_called():
    # F.interpolate(mode="area") calls F.adaptive_avg_pool2d: with a LOW row of its own that one is wrapped too, but
    # inside interpolate's FP32 call it runs as called (fp32), as under the mode engine
    y = torch.randn(1, 2, 4, 4).bfloat16()

    def area(y):
        return F.interpolate(y, size=(2, 2), mode="area"), F.adaptive_avg_pool2d(y.float(), 2)

    with autocast(dtype=torch.bfloat16), policy_override({"torch.nn.functional.adaptive_avg_pool2d": "low"}):
        assert "torch.nn.functional.adaptive_avg_pool2d" in D.wrapped_functions()
        got, alone = area(y)
        compiled, compiled_alone = torch.compile(area, backend="aot_eager", fullgraph=True)(y)
        with disable_casts():
            manual = F.interpolate(y.float(), size=(2, 2), mode="area")
    assert_bitwise_equal(got, manual)
    assert_bitwise_equal(compiled, manual)
    assert alone.dtype == compiled_alone.dtype == torch.bfloat16  # called alone, its own row applies


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_wrapped_functions_compiled_equal_eager(low):
    torch.manual_seed(0)
    y = torch.randn(32).to(low)

    def inside(y):
        with autocast(dtype=low):
            return _composites(y), F.layer_norm(y.reshape(4, 8), (8,))

    def bare(y):
        return _composites(y), F.layer_norm(y.reshape(4, 8), (8,))

    eager = inside(y)
    compiled = torch.compile(inside, backend="aot_eager", fullgraph=True)(y)
    with autocast(dtype=low):
        compiled_outside = torch.compile(bare, backend="aot_eager", fullgraph=True)(y)
    for got in (compiled, compiled_outside):
        for g, e in zip([*got[0], got[1]], [*eager[0], eager[1]]):
            assert_bitwise_equal(g, e)


def test_leaving_the_engine_uninstalls_it():
    y = torch.randn(4, 8).bfloat16()
    with autocast(dtype=torch.bfloat16):
        F.layer_norm(y, (8,))
    assert D.wrapped_functions() and D.installed_ops()
    autocast_mode.set_engine("mode")
    assert not D.wrapped_functions() and not D.installed_ops()
    assert not hasattr(F.layer_norm, "__fp16kit_wrapped__")
    with autocast(dtype=torch.bfloat16):  # the mode engine sees F.layer_norm itself: its FP32 row applies
        assert F.layer_norm(y, (8,)).dtype == torch.float32


@pytest.mark.usefixtures("fresh_dynamo")
def test_leaving_the_engine_lets_compiled_code_see_the_originals_again():
    """Dynamo caches which objects are torch functions by resolving their names once; built while this engine's
    ``torch.nn.functional`` wrappers are installed (running a checkpoint does), it forgot the originals that
    uninstalling puts back, and the mode engine's FP32 rows of ``F.cross_entropy``, ``F.interpolate`` & co missed
    under ``torch.compile`` (the suite under the mode engine failed this way after a dispatcher-engine test)."""
    from torch._dynamo import trace_rules

    x = torch.randn(4, 5).bfloat16()
    target = torch.randint(0, 5, (4,))
    with autocast(dtype=torch.bfloat16):
        F.cross_entropy(x, target)
    assert hasattr(F.cross_entropy, "__fp16kit_wrapped__")
    trace_rules.clear_lru_cache()
    trace_rules.get_torch_obj_rule_map()  # built now, with the wrappers in torch.nn.functional
    autocast_mode.set_engine("mode")

    def f(a, b):
        return F.cross_entropy(a, b), F.interpolate(a[None], scale_factor=2.0)

    with autocast(dtype=torch.bfloat16):
        eager, compiled = f(x, target), torch.compile(f, backend="aot_eager", fullgraph=True)(x, target)
    for e, c in zip(eager, compiled, strict=True):
        assert e.dtype == torch.float32
        assert_bitwise_equal(c, e)


def test_set_engine_refuses_inside_a_region():
    with autocast(dtype=torch.float16), pytest.raises(RuntimeError, match="cannot switch engines"):
        autocast_mode.set_engine("mode")
    with pytest.raises(ValueError, match="use one of"):
        autocast_mode.set_engine("cuda")


# ----------------------------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------------------------


class _Net(Small):
    """tests/amp/test_autocast_compile.py's model (LOW, FP32, PROMOTE rows) plus the issue's examples."""

    def forward(self, x):
        outs = super().forward(x)
        h, y = outs[0], outs[2]
        return (*outs, h.exp(), (y * 1).sum(), y @ y.t(), h ** 2)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_compiled_equals_eager_region_outside(low):
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 16)
    with autocast(dtype=low):
        eager = net(x)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        with autocast(dtype=low):
            compiled = torch.compile(net, backend=backend, fullgraph=True)(x)
        assert [t.dtype for t in compiled] == [t.dtype for t in eager], backend
        if backend == "aot_eager":
            for c, e in zip(compiled, eager):
                assert_bitwise_equal(c, e)
    # the same compiled function under plain torch.autocast: torch's dtypes (exp stays low on CPU)
    with torch.autocast("cpu", dtype=low):
        plain_eager = net(x)
        plain_compiled = torch.compile(net, backend="aot_eager", fullgraph=True)(x)
    assert [t.dtype for t in plain_compiled] == [t.dtype for t in plain_eager]
    assert plain_eager[6].dtype == low and eager[6].dtype == torch.float32  # h.exp()


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_compiled_equals_eager_region_inside(low):
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(4, 16, requires_grad=True)

    def step(x):
        with autocast(dtype=low):
            outs = net(x)
        return outs, sum(o.float().sum() for o in outs)

    eager, eager_loss = step(x)
    (eager_grad,) = torch.autograd.grad(eager_loss, x)
    compiled, compiled_loss = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    (compiled_grad,) = torch.autograd.grad(compiled_loss, x)
    for c, e in zip(compiled, eager):
        assert_bitwise_equal(c, e)
    assert_bitwise_equal(compiled_grad, eager_grad)
    assert eager[4].dtype == torch.float32 and eager[0].dtype == low


def test_plain_torch_autocast_on_another_thread_during_a_region_is_untouched():
    """The engine's dispatch state is per thread: while one thread is inside an fp16kit region, plain
    ``torch.autocast`` code on another thread dispatches exactly as torch does (issue 23, item 2, "during")."""
    import threading

    y = torch.randn(4, 8).bfloat16()
    seen: dict[str, object] = {}
    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait(10)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seen["excluded"] = torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutocastIPU)
            seen["softmax"] = torch.softmax(y, -1).dtype  # torch's CPU autocast leaves softmax alone
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with autocast(dtype=torch.bfloat16):
        inside.set()
        assert done.wait(10)
        assert torch.softmax(y, -1).dtype == torch.float32  # this thread: fp16kit's row
    t.join(10)
    assert seen == {"excluded": True, "softmax": torch.bfloat16}


def _aot_graphs(model, x, region):
    """The forward and backward aten graphs AOT autograd traces for ``model(x).float().sum()`` under ``region``."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append([f"{n.target}[{getattr(n.meta.get('val'), 'dtype', None)}]"
                       for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: model(x).float().sum(), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    with region():
        loss = compiled(x)
    loss.backward()
    return graphs


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_the_policy_is_not_applied_in_backward(low):
    """Backward runs as under torch.autocast: in eager (``backward()`` inside the region) and in the backward graph
    AOT autograd traces (a compiled step): the graphs of a GELU MLP are torch.autocast's, op for op and dtype for
    dtype (before, the bias gradients' ``sum`` came out as an FP32 row: 40 extra nodes)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU())
    x = torch.randn(4, 16)
    ours = _aot_graphs(mlp, x, lambda: autocast(dtype=low))
    torch_graphs = _aot_graphs(mlp, x, lambda: torch.autocast("cpu", dtype=low))
    assert ours == torch_graphs

    def eager_grads(region):
        mlp.zero_grad()
        with region():
            mlp(x).float().sum().backward()  # backward inside the region
        return [p.grad.clone() for p in mlp.parameters()]

    ours = eager_grads(lambda: autocast(dtype=low))
    for got, ref in zip(ours, eager_grads(lambda: torch.autocast("cpu", dtype=low))):
        assert_bitwise_equal(got, ref)
