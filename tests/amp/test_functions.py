"""half_function / float_function / promote_function and custom_fwd / custom_bwd (cast-policy.md, apex-amp.md)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from fp16kit.amp import (
    autocast,
    custom_bwd,
    custom_fwd,
    disable_casts,
    float_function,
    half_function,
    is_autocast_enabled,
    promote_function,
)
from fp16kit.numerics.assertions import assert_bitwise_equal

LOW = (torch.float16, torch.bfloat16)
IDS = ["fp16", "bf16"]


@half_function
def h_fn(a, b, *, scale=1.0):
    return a * b * scale, a.dtype, b.dtype


@float_function
def f_fn(a, b):
    return torch.tanh(a) + b


@promote_function
def p_fn(a, b):
    return a, b


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_rule_decorators(low):
    a, b = torch.randn(4), torch.randn(4).to(low)
    with autocast(dtype=low):
        out, da, db = h_fn(a, b, scale=2.0)
        assert (da, db) == (low, low) and out.dtype == low
        assert f_fn(b, b).dtype == torch.float32
        pa, pb = p_fn(a, b)
        assert pa.dtype == pb.dtype == torch.float32
        qa, qb = p_fn(b, b)
        assert qa is b and qb is b  # agreeing dtypes: untouched (no copy)
        with disable_casts():
            assert h_fn(a, b)[1:] == (torch.float32, low)
    assert_bitwise_equal(out, a.to(low) * b * 2.0)
    # outside a region the decorated functions run as called
    assert h_fn(a, b)[1:] == (torch.float32, low)
    assert f_fn(b, b).dtype == low
    assert h_fn.__name__ == "h_fn" and h_fn.__fp16kit_wrapped__.__name__ == "h_fn"


def test_ops_inside_decorated_functions_still_follow_the_policy():
    @half_function
    def block(x, w):
        return torch.softmax(F.linear(x, w), -1)  # softmax is FP32 inside, as with apex

    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with autocast(dtype=torch.bfloat16):
        assert block(x, w).dtype == torch.float32


class ScaledMatmul(torch.autograd.Function):
    """Records the autocast state seen by forward and backward (the backward matmuls are policy ops)."""

    seen: ClassVar[list[tuple[str, bool, torch.dtype]]] = []

    @staticmethod
    @custom_fwd
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        out = a @ b
        ScaledMatmul.seen.append(("fwd", is_autocast_enabled(), out.dtype))
        return out

    @staticmethod
    @custom_bwd
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = g @ b.t()
        ScaledMatmul.seen.append(("bwd", is_autocast_enabled(), ga.dtype))
        return ga, a.t() @ g


class Fp32Op(torch.autograd.Function):
    @staticmethod
    @custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b, a.dtype, b.dtype, is_autocast_enabled()

    @staticmethod
    @custom_bwd
    def backward(ctx, g, *_):
        a, b = ctx.saved_tensors
        assert not is_autocast_enabled()
        return g @ b.t(), a.t() @ g


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_custom_bwd_runs_with_the_forwards_policy(low):
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2, requires_grad=True)
    ScaledMatmul.seen.clear()
    with autocast(dtype=low):
        out = ScaledMatmul.apply(a, b)
    out.float().sum().backward()  # backward runs outside the region: custom_bwd restores the forward's policy
    assert ScaledMatmul.seen == [("fwd", True, low), ("bwd", True, low)]
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    # and under a *disabled* forward, the backward runs disabled even inside a region
    ScaledMatmul.seen.clear()
    out = ScaledMatmul.apply(a, b)
    with autocast(dtype=low):
        out.sum().backward()
    assert ScaledMatmul.seen == [("fwd", False, torch.float32), ("bwd", False, torch.float32)]


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_custom_fwd_cast_inputs(low):
    a = torch.randn(3, 4).to(low).requires_grad_()
    b = torch.randn(4, 2, requires_grad=True)
    with autocast(dtype=low):
        out, da, db, enabled = Fp32Op.apply(a, b)
    assert (da, db, enabled) == (torch.float32, torch.float32, False)  # cast, then run with casts disabled
    assert out.dtype == torch.float32
    assert_bitwise_equal(out, a.detach().float() @ b.detach())
    out.sum().backward()
    assert a.grad.dtype == low and b.grad.dtype == torch.float32  # grads in each input's own dtype
    # outside a region: run as called
    out, da, db, enabled = Fp32Op.apply(a.detach(), b.detach().to(low))
    assert (da, db, enabled, out.dtype) == (low, low, False, low)


def test_custom_bwd_without_custom_fwd_and_bad_cast_inputs():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        @custom_bwd
        def backward(ctx, g):
            return g * 2

    a = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="custom_fwd"):
        Bad.apply(a).sum().backward()
    with pytest.raises(ValueError, match="cast_inputs"):
        custom_fwd(cast_inputs=torch.int32)


class KeywordOp(torch.autograd.Function):
    """``b`` and ``pair`` are meant to be passed by keyword (``KeywordOp.apply(a, b=t, pair=[u, v])``)."""

    @staticmethod
    @custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, a, b=None, pair=(), scale=2.0):
        ctx.save_for_backward(a, b)
        return a @ b * scale, (a.dtype, b.dtype, *(t.dtype for t in pair)), is_autocast_enabled()

    @staticmethod
    @custom_bwd
    def backward(ctx, g, *_):
        a, b = ctx.saved_tensors
        return g @ b.t() * 2.0, a.t() @ g * 2.0, None, None


def _apply_takes_keywords() -> bool:
    """torch 2.13's ``Function.apply`` binds keywords to forward's parameters; torch 2.11's takes none."""

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b=None):
            return a

    try:
        Probe.apply(torch.zeros(1), b=None)
    except TypeError:
        return False
    return True


@pytest.mark.skipif(not _apply_takes_keywords(), reason="this torch's Function.apply takes no keyword arguments")
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_custom_fwd_cast_inputs_casts_keyword_tensors(low):
    # a keyword call worked on an undecorated forward but raised "unexpected keyword argument" behind custom_fwd
    a = torch.randn(3, 4).to(low).requires_grad_()
    b = torch.randn(4, 2).to(low).requires_grad_()
    pair = [torch.randn(2).to(low), torch.randn(2)]
    with autocast(dtype=low):
        out, dtypes, enabled = KeywordOp.apply(a, b=b, pair=pair)
        out_pos, dtypes_pos, _ = KeywordOp.apply(a, b, pair)
    assert dtypes == dtypes_pos == (torch.float32,) * 4 and not enabled
    assert_bitwise_equal(out, a.detach().float() @ b.detach().float() * 2.0)
    assert_bitwise_equal(out_pos, out)
    out.sum().backward()
    assert a.grad.dtype == low and b.grad.dtype == low
    # outside a region: as called, keywords included
    _, dtypes, _ = KeywordOp.apply(a.detach(), b=b.detach(), pair=pair, scale=1.0)
    assert dtypes == (low, low, low, torch.float32)
    assert KeywordOp.forward.__name__ == "forward" and KeywordOp.forward.__wrapped__.__name__ == "forward"


@custom_fwd(cast_inputs=torch.float32)
def _kwonly_forward(ctx, a, *, b, **extra):
    return (a.dtype, b.dtype, *(t.dtype for t in extra.values()))


def test_custom_fwd_cast_inputs_casts_keyword_only_tensors_of_a_direct_call():
    # apply cannot pass keyword-only arguments (torch binds keywords to positional names), but a forward called
    # directly (one Function's forward reusing another's) gets them as keywords: they are cast as well
    class Ctx:
        pass

    a, b, c = torch.randn(2).half(), torch.randn(2).half(), torch.randn(2).bfloat16()
    with autocast(dtype=torch.float16):
        assert _kwonly_forward(Ctx(), a, b=b, c=c) == (torch.float32,) * 3
    assert _kwonly_forward(Ctx(), a, b=b, c=c) == (torch.float16, torch.float16, torch.bfloat16)
