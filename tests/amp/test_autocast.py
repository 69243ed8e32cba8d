"""autocast's eligibility rules, in-place rules, banned ops, weight-cast cache, nesting and gradients
(cast-policy.md "Eligibility" and "Behaviour users rely on")."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fp16kit.amp import autocast, disable_casts, is_autocast_enabled
from fp16kit.amp.autocast_mode import active_mode
from fp16kit.numerics.assertions import assert_bitwise_equal

LOW = (torch.float16, torch.bfloat16)
IDS = ["fp16", "bf16"]


class CountCasts(TorchFunctionMode):
    """Pushed *outside* autocast: sees the casts autocast issues (they run with autocast's mode popped)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[tuple[int, torch.dtype]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            self.casts.append((id(args[0]), args[1] if len(args) > 1 else kwargs.get("dtype")))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# eligibility
# ---------------------------------------------------------------------------------------------------------------


def test_nothing_is_cast_outside_a_region():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    assert not is_autocast_enabled()
    assert F.linear(x, w).dtype == torch.float32
    with autocast():
        pass
    assert F.linear(x, w).dtype == torch.float32 and active_mode() is None


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_float64_is_never_cast(low):
    x, w = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    with autocast(dtype=low):
        assert F.linear(x, w).dtype == torch.float64  # LOW does not cast down
        assert torch.exp(x).dtype == torch.float64
        # FP32 does not touch float64 either; a low input beside it is cast to fp32, float64 wins natively
        assert torch.cat([x, torch.randn(2, 4).to(low)]).dtype == torch.float64
        out = torch.mm(x, x.t())
    assert_bitwise_equal(out, torch.mm(x, x.t()))


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_integer_bool_complex_pass_through(low):
    i = torch.arange(6).reshape(2, 3)
    b = i > 2
    c = torch.randn(3, 3, dtype=torch.complex64)
    with autocast(dtype=low):
        assert torch.cat([i, i]).dtype == torch.int64
        assert torch.matmul(i, i.t()).dtype == torch.int64
        assert torch.stack([b, b]).dtype == torch.bool
        assert torch.matmul(c, c).dtype == torch.complex64
        assert torch.sum(i).dtype == torch.int64
        assert torch.exp(i).dtype == torch.float32  # native int -> float promotion, nothing to cast
        # integer beside floating: only the floating tensor is cast
        x = torch.randn(2, 3).to(low)
        assert (x + i).dtype == low
        assert torch.cat([x.float(), i.to(low)]).dtype == torch.float32


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_dtype_and_out_are_respected(low):
    x = torch.randn(4, 5).to(low)
    with autocast(dtype=low):
        assert torch.sum(x, dtype=low).dtype == low
        assert torch.softmax(x, -1, dtype=low).dtype == low
        assert x.sum(dtype=torch.float64).dtype == torch.float64
        out = torch.empty(4, 5, dtype=low)
        r = torch.exp(x, out=out)
        assert r is out and out.dtype == low
        w = torch.randn(5, 5)
        o32 = torch.empty(4, 5)
        torch.mm(x.float(), w, out=o32)  # LOW op with out=: not cast, runs in fp32
    assert_bitwise_equal(o32, torch.mm(x.float(), w))
    assert_bitwise_equal(out, torch.exp(x))


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_nested_containers_every_tensor_counts(low):
    a, b = torch.randn(2, 3), torch.randn(2, 3).to(low)
    with autocast(dtype=low):
        out = torch.cat((a, [b][0]))
        assert out.dtype == torch.float32
        lst = [b, b, a]
        assert torch.stack(lst).dtype == torch.float32 and lst[0].dtype == low  # the caller's list is untouched
        mats = [torch.randn(3, 4), torch.randn(4, 2), torch.randn(2, 2)]
        md = torch.linalg.multi_dot(mats)
    assert md.dtype == low
    assert_bitwise_equal(md, torch.linalg.multi_dot([m.to(low) for m in mats]))


def test_keyword_tensor_arguments_are_cast():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with autocast(dtype=torch.bfloat16):
        out = F.linear(input=x, weight=w)
    assert_bitwise_equal(out, F.linear(x.bfloat16(), w.bfloat16()))


# ---------------------------------------------------------------------------------------------------------------
# in-place rules
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_fp32_inplace_on_low_precision_raises(low):
    short = {torch.float16: "fp16", torch.bfloat16: "bf16"}[low]
    x = torch.rand(4).to(low)
    before = x.clone()
    with autocast(dtype=low):
        with pytest.raises(RuntimeError, match=rf"Cannot call in-place torch\.Tensor\.exp_ on {short} tensors"):
            x.exp_()
        with pytest.raises(RuntimeError, match=r"Cannot call in-place torch\.Tensor\.__ipow__"):
            x **= 2
        # the mode engine names the callable; the dispatcher engine names the aten op's best-known callable
        with pytest.raises(RuntimeError, match=r"Cannot call in-place torch\.(Tensor\.)?exp_"):
            torch.exp_(x)
        with pytest.raises(RuntimeError, match="out-of-place form"):
            x.cumsum_(0)
    assert_bitwise_equal(x, before)  # nothing happened
    with autocast(dtype=low), disable_casts():
        x.exp_()  # with casting disabled the policy does not apply


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_inplace_casts_other_args_to_self_dtype(low):
    # in-place operators are not in the table: torch's native promotion (fp32 math, result in self's dtype)
    x, y = torch.randn(4, 5).to(low), torch.randn(4, 5)
    ref = x.clone().add_(y)
    with autocast(dtype=low):
        a = x.clone()
        r = a.add_(y)
        b = x.clone()
        b += y
        c = x.clone()
        c.mul_(y).sub_(y)
    assert r is a and a.dtype == low
    assert_bitwise_equal(a, ref)
    assert_bitwise_equal(b, ref)
    assert_bitwise_equal(c, x.clone().mul_(y).sub_(y))
    # a PROMOTE op in place: the other args are cast to self's dtype
    t = torch.randn(4, 5).to(low)
    with autocast(dtype=low):
        got = t.clone().addcmul_(y, y)
    assert_bitwise_equal(got, t.clone().addcmul_(y.to(low), y.to(low)))
    # an fp32 self under a LOW op: the other args come up to fp32, the op runs in fp32
    m = torch.randn(4, 4)
    m1, m2 = torch.randn(4, 3).to(low), torch.randn(3, 4).to(low)
    with autocast(dtype=low):
        m.clone().addmm_(m1, m2)
        out = m.clone().addmm_(m1, m2)
    assert_bitwise_equal(out, m.clone().addmm_(m1.float(), m2.float()))
    # FP32 in-place on an fp32 tensor is fine (its other args come up to fp32)
    p, e = torch.rand(4) + 0.5, torch.rand(4).to(low)
    with autocast(dtype=low):
        q = p.clone().pow_(e)
    assert_bitwise_equal(q, p.clone().pow_(e.float()))


# ---------------------------------------------------------------------------------------------------------------
# banned
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_banned_binary_cross_entropy_message(low):
    p, y = torch.rand(6).to(low).clamp(0.05, 0.95), torch.rand(6).to(low)
    with autocast(dtype=low):
        with pytest.raises(RuntimeError) as e:
            F.binary_cross_entropy(p, y)
        msg = str(e.value)
        assert "binary_cross_entropy_with_logits" in msg and "BCEWithLogitsLoss" in msg
        assert "register_float_function(torch.nn.functional, 'binary_cross_entropy')" in msg
        assert str(low) in msg
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            nn.BCELoss()(p, y)
        # fp32 probabilities are fine: the ban is about low-precision inputs
        p32, y32 = p.float(), y.float()
        out = F.binary_cross_entropy(p32, y32)
        # the recommended replacement works and runs in fp32
        logits = torch.randn(6).to(low)
        assert F.binary_cross_entropy_with_logits(logits, y).dtype == torch.float32
    assert_bitwise_equal(out, F.binary_cross_entropy(p32, y32))


# ---------------------------------------------------------------------------------------------------------------
# weight-cast cache
# ---------------------------------------------------------------------------------------------------------------


def _w_casts(counter: CountCasts, w: torch.Tensor) -> int:
    return sum(1 for i, _ in counter.casts if i == id(w))


@pytest.mark.parametrize("low", LOW, ids=IDS)
@pytest.mark.usefixtures("mode_engine")
def test_weight_cast_once_per_region_and_released_on_exit(low):
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4).to(low)
    counter = CountCasts()
    with counter:
        with autocast(dtype=low):
            y = F.linear(F.linear(F.linear(x, w), w), w)
            cached = active_mode().cache[id(w)][3]
            assert _w_casts(counter, w) == 1
            assert len(active_mode().cache) == 1
        cast_ref = weakref.ref(cached)
        del cached
        y.float().sum().backward()
        del y
        gc.collect()
        assert cast_ref() is None, "the cached cast must be freed with the region"
        with autocast(dtype=low):
            F.linear(x, w)
            assert _w_casts(counter, w) == 2  # a new region casts again
    assert w.grad is not None and w.grad.dtype == torch.float32


@pytest.mark.usefixtures("mode_engine")
def test_cache_never_grows_under_no_grad():
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    counter = CountCasts()
    with counter, autocast(dtype=torch.bfloat16):
        with torch.no_grad():
            for _ in range(5):
                out = F.linear(x, w)
            assert len(active_mode().cache) == 0
            assert not out.requires_grad
        assert _w_casts(counter, w) == 5
        # the next grad-enabled use gets a grad-tracking cast (not a stale no_grad one), which is then cached
        out = F.linear(x, w)
        assert out.requires_grad and len(active_mode().cache) == 1
        with torch.no_grad():
            F.linear(x, w)  # an existing entry is reused under no_grad
        assert _w_casts(counter, w) == 6


@pytest.mark.usefixtures("mode_engine")
def test_cache_sees_inplace_updates_and_can_be_disabled():
    w = nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4)
    with autocast(dtype=torch.float16):
        a = F.linear(x, w)
        with torch.no_grad():
            w.add_(1.0)  # e.g. an optimizer step inside the region
        b = F.linear(x, w)
    assert_bitwise_equal(b, F.linear(x.half(), w.detach().half()))
    assert not torch.equal(a, b)
    counter = CountCasts()
    with counter, autocast(dtype=torch.float16, cache_enabled=False):
        F.linear(x, w)
        F.linear(x, w)
        assert len(active_mode().cache) == 0
    assert _w_casts(counter, w) == 2


@pytest.mark.usefixtures("mode_engine")
def test_cache_only_for_leaf_tensors_that_require_grad():
    x = torch.randn(4, 4)  # an activation, not a parameter
    h = torch.randn(4, 4, requires_grad=True) * 2  # not a leaf
    with autocast(dtype=torch.float16):
        torch.mm(x, x)
        torch.mm(h, h)
        assert len(active_mode().cache) == 0


# ---------------------------------------------------------------------------------------------------------------
# nesting, disable_casts, decorator, threads
# ---------------------------------------------------------------------------------------------------------------


def test_nesting_inner_region_wins_and_outer_is_restored():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with autocast(dtype=torch.float16):
        assert F.linear(x, w).dtype == torch.float16
        with autocast(dtype=torch.bfloat16):
            assert F.linear(x, w).dtype == torch.bfloat16
            with autocast(enabled=False):
                assert F.linear(x, w).dtype == torch.float32 and not is_autocast_enabled()
                with autocast(dtype=torch.float16):
                    assert F.linear(x, w).dtype == torch.float16
                assert F.linear(x, w).dtype == torch.float32
            assert F.linear(x, w).dtype == torch.bfloat16 and is_autocast_enabled()
        assert F.linear(x, w).dtype == torch.float16
        with disable_casts():
            assert F.linear(x, w).dtype == torch.float32 and not is_autocast_enabled()
            with autocast(dtype=torch.bfloat16):  # a nested region re-enables
                assert F.linear(x, w).dtype == torch.bfloat16
            assert F.linear(x, w).dtype == torch.float32
        assert F.linear(x, w).dtype == torch.float16
    assert F.linear(x, w).dtype == torch.float32 and active_mode() is None
    with autocast(enabled=False):  # a disabled outermost region pushes nothing
        assert active_mode() is None
    with disable_casts():  # and disable_casts outside a region is a no-op
        assert F.linear(x, w).dtype == torch.float32


def test_region_restored_after_exception():
    with pytest.raises(ZeroDivisionError), autocast(dtype=torch.bfloat16):
        1 / 0  # noqa: B018
    assert active_mode() is None and not is_autocast_enabled()
    with autocast():
        with pytest.raises(ZeroDivisionError), disable_casts():
            1 / 0  # noqa: B018
        assert is_autocast_enabled()


def test_decorators():
    x, w = torch.randn(2, 4), torch.randn(3, 4)

    @autocast(dtype=torch.bfloat16)
    def f(a, b):
        return F.linear(a, b), is_autocast_enabled()

    @disable_casts()
    def g(a, b):
        return F.linear(a, b)

    out, on = f(x, w)
    assert out.dtype == torch.bfloat16 and on and not is_autocast_enabled()
    with autocast():
        assert g(x, w).dtype == torch.float32
        assert f(x, w)[0].dtype == torch.bfloat16
        assert F.linear(x, w).dtype == torch.float16


def test_bad_dtype_raises():
    with pytest.raises(ValueError, match=r"torch\.float16 or torch\.bfloat16"):
        autocast(dtype=torch.float32)


def test_region_is_thread_local():
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    seen = []
    with autocast(dtype=torch.float16):
        t = threading.Thread(target=lambda: seen.append((F.linear(x, w).dtype, is_autocast_enabled())))
        t.start()
        t.join()
    assert seen == [(torch.float32, False)]


# ---------------------------------------------------------------------------------------------------------------
# modules, composites and gradients
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_ops_inside_absent_composites_are_seen(low):
    """F.multi_head_attention_forward is absent from the table; the linear/bmm inside it are LOW."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    with autocast(dtype=low):
        out, _ = mha(x, x, x)
    assert out.dtype == low
    # the result is the fp32 one up to low-precision rounding of the projections (a few eps of the format)
    ref = mha(x, x, x)[0]
    tol = 8 * torch.finfo(low).eps
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_gradients_arrive_in_each_parameters_dtype(low):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    model[3].to(low)  # a layer kept in low precision on purpose
    x, target = torch.randn(4, 6), torch.randint(0, 3, (4,))
    with autocast(dtype=low):
        logits = model(x)
        loss = F.cross_entropy(logits, target)
    assert logits.dtype == low and loss.dtype == torch.float32
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
    # and the gradient equals the one through the hand-cast graph
    g0 = model[0].weight.grad.clone()
    model.zero_grad()
    h = F.linear(x.to(low), model[0].weight.to(low), model[0].bias.to(low))
    h = F.layer_norm(h.float(), (8,), model[1].weight, model[1].bias)
    h = F.gelu(h)
    ref = F.cross_entropy(F.linear(h.to(low), model[3].weight, model[3].bias).float(), target)
    ref.backward()
    assert_bitwise_equal(loss, ref)
    assert_bitwise_equal(g0, model[0].weight.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_cuda_model_and_ops(low):
    dev = "cuda"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    x = torch.randn(8, 16, device=dev)
    with autocast(dtype=low):
        out = model(x)
        sm = torch.softmax(out, -1)
        cat = torch.cat([out, out.float()])
    assert out.dtype == low and sm.dtype == torch.float32 and cat.dtype == torch.float32
    ref = F.linear(F.relu(F.linear(x.to(low), model[0].weight.to(low), model[0].bias.to(low))),
                   model[2].weight.to(low), model[2].bias.to(low))
    assert_bitwise_equal(out, ref)
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with autocast(dtype=low), pytest.raises(RuntimeError, match="Cannot call in-place"):
        out.detach().exp_()


def test_composite_pass_through_follows_table_changes():
    """F.relu is a Python composite absent from the table whose body cannot reach a table op, so it is simply run;
    once torch.relu gets a row, F.relu's body must be seen by the policy (the pass-through set is rebuilt)."""
    from fp16kit.amp import policy_override
    from fp16kit.amp.autocast_mode import _DISPATCH

    x = torch.randn(4, 4)
    assert id(F.relu) not in _DISPATCH
    with autocast(dtype=torch.bfloat16):
        assert F.relu(x).dtype == torch.float32
        with policy_override({"torch.relu": "low"}):
            assert id(F.relu) in _DISPATCH
            assert F.relu(x).dtype == torch.bfloat16
            assert nn.ReLU()(x).dtype == torch.bfloat16
        assert F.relu(x).dtype == torch.float32
    assert id(F.relu) not in _DISPATCH
    assert id(F.multi_head_attention_forward) in _DISPATCH  # its body reaches linear / bmm / softmax
