"""autocast under ``torch.compile(fullgraph=True)`` (cast-policy.md: "the policy should trace without graph
breaks"). fullgraph=True turns any graph break into an error, so these tests fail on a break."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16kit.amp import autocast
from fp16kit.numerics.assertions import assert_bitwise_equal

LOW = (torch.float16, torch.bfloat16)
IDS = ["fp16", "bf16"]


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.fc1(x)  # LOW
        a = F.softplus(h)  # FP32
        y = self.fc2(a)  # LOW
        r = y + x  # PROMOTE (low + fp32 -> fp32)
        p = torch.softmax(self.norm(r), -1)  # FP32, FP32
        return h, a, y, r, p, torch.cat([y, h[:, :16]])  # cat: PROMOTE, both low -> low


def _dtypes(outs):
    return [t.dtype for t in outs]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_compiled_model_fullgraph_bitwise_as_eager(low):
    """aot_eager runs the traced aten graph without codegen: the traced policy must equal eager's bit for bit."""
    torch.manual_seed(0)
    model, x = Small(), torch.randn(8, 16)
    with autocast(dtype=low):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert _dtypes(eager) == [low, torch.float32, low, torch.float32, torch.float32, low]
    for c, e in zip(compiled, eager):
        assert_bitwise_equal(c, e)
    compiled[-2].float().sum().backward()  # gradients through the compiled graph, in each parameter's dtype
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_compiled_model_fullgraph_inductor(low):
    """The default backend (Inductor). It fuses pointwise chains and may keep low-precision intermediates in fp32
    registers, so values are compared within the low format's resolution: |diff| <= 4 eps(low) (|eager| + 1)."""
    torch.manual_seed(0)
    model, x = Small(), torch.randn(8, 16)
    with torch.no_grad(), autocast(dtype=low):  # inference graph only: one compile, no joint graph
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    assert _dtypes(compiled) == _dtypes(eager)
    for c, e in zip(compiled, eager):
        tol = 4 * torch.finfo(low).eps * (e.float().abs() + 1)
        assert bool(((c.float() - e.float()).abs() <= tol).all())


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_region_entered_inside_compiled_function(low):
    torch.manual_seed(0)
    model, x = Small(), torch.randn(8, 16)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(inp):
        with autocast(dtype=low):
            outs = model(inp)
        return outs, F.linear(inp, model.fc1.weight)  # after the region: fp32 again

    outs, after = step(x)
    assert _dtypes(outs) == [low, torch.float32, low, torch.float32, torch.float32, low]
    assert after.dtype == torch.float32
    with autocast(dtype=low):
        eager = model(x)
    for c, e in zip(outs, eager):  # aot_eager runs the same aten ops as eager: bit-identical
        assert_bitwise_equal(c, e)


def test_transformer_block_fullgraph():
    """nn.TransformerEncoderLayer: F.multi_head_attention_forward is absent from the table and is traced through
    (its inner linears are LOW); Tensor.unflatten inside it needs the compile redirect (torch 2.13)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 16)
    with autocast(dtype=torch.bfloat16):
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    assert eager.dtype == compiled.dtype == torch.float32  # the last op is layer_norm: FP32
    assert_bitwise_equal(compiled, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_compiled_model_fullgraph_cuda(low):
    torch.manual_seed(0)
    model, x = Small().cuda(), torch.randn(8, 16, device="cuda")
    with autocast(dtype=low):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
        inductor = torch.compile(model, fullgraph=True)(x)
    assert _dtypes(eager) == _dtypes(compiled) == _dtypes(inductor)
    for c, e in zip(compiled, eager):
        assert_bitwise_equal(c, e)
