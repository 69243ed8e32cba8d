"""The dispatcher engine of autocast (fp16kit/amp/_dispatch.py, docs/autocast.md "The dispatcher engine").

Engine-specific contracts; the behaviour every engine shares is tested by the rest of tests/amp, which runs against
this engine with ``FP16KIT_AUTOCAST_ENGINE=dispatch``:

* override kernels are registered only for the aten ops whose fp16kit rule differs from torch's kernel on the key;
  the ops where they agree keep torch's C++ kernel;
* outside an fp16kit region, plain ``torch.autocast`` gives torch's dtypes and bits with the kernels installed, in
  eager and compiled code;
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
    for differ in ("softmax.int", "layer_norm", "exp", "exp_", "sum", "addmm_", "cat", "binary_cross_entropy"):
        assert differ in cpu, differ
        assert "_dispatch.py" in _kernel_source(f"aten::{differ}"), differ
    assert cpu["avg_pool3d"][0] is D.AS_CALLED and cpu["reflection_pad1d"][0] is D.AS_CALLED
    assert cpu["exp"][0][0].name == "FP32"
    assert _kernel_source("aten::relu") == "fallthrough"  # an op neither casts is not touched


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


def test_uninstall_gives_torch_its_kernels_back():
    assert "_dispatch.py" in _kernel_source("aten::binary_cross_entropy")
    D.uninstall()
    assert "autocast_mode.cpp" in _kernel_source("aten::binary_cross_entropy")
    assert _kernel_source("aten::softmax.int") == "fallthrough"
    with autocast(dtype=torch.bfloat16):  # a region installs them again
        assert torch.softmax(torch.randn(2, 2).bfloat16(), -1).dtype == torch.float32


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
