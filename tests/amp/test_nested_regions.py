"""Nested regions of different dtypes, and fp16kit regions inside and around ``torch.autocast`` (docs/autocast.md,
"Nesting"): one behaviour, the same under both engines.

* fp16kit inside fp16kit: the innermost region wins (dtype, or nothing cast with ``enabled=False``);
* an fp16kit region inside ``torch.autocast`` wins inside it: its table, its dtype, or nothing cast;
* ``torch.autocast`` inside an enabled fp16kit region: one that enables the region's own dtype changes nothing;
  one that disables autocast or asks for another dtype takes over: torch's table for that device, in its dtype
  (``enabled=False``: nothing cast, the pattern of Hugging Face rotary embeddings).

A weight used in regions of two dtypes is cast for each (torch's weight-cast cache is keyed by tensor, not dtype:
the dispatcher engine raised torch's "mat1 and mat2 must have the same dtype" before regions of another dtype
skipped it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp16kit import amp
from fp16kit.amp import autocast_mode

ENGINES = ("dispatch", "mode")
F16, B16, F32 = torch.float16, torch.bfloat16, torch.float32


def _probe(lin: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A LOW row (linear, where torch's CPU table agrees) and an FP32 row torch's CPU table leaves as called."""
    h = lin(x)
    return h, h.softmax(-1)


#: outer region, inner region, (linear, softmax) dtypes inside the inner one. Outside the inner region the outer
#: region's own dtypes hold (checked by the test).
CASES = {
    "fp16 > bf16": (lambda: amp.autocast(dtype=F16), lambda: amp.autocast(dtype=B16), (B16, F32)),
    "bf16 > fp16": (lambda: amp.autocast(dtype=B16), lambda: amp.autocast(dtype=F16), (F16, F32)),
    "fp16 > disabled": (lambda: amp.autocast(dtype=F16), lambda: amp.autocast(enabled=False), (F32, F32)),
    "fp16 > disable_casts": (lambda: amp.autocast(dtype=F16), amp.disable_casts, (F32, F32)),
    "torch fp16 > bf16": (lambda: torch.autocast("cpu", dtype=F16), lambda: amp.autocast(dtype=B16), (B16, F32)),
    "torch bf16 > fp16": (lambda: torch.autocast("cpu", dtype=B16), lambda: amp.autocast(dtype=F16), (F16, F32)),
    "torch bf16 > disabled": (lambda: torch.autocast("cpu", dtype=B16), lambda: amp.autocast(enabled=False),
                              (F32, F32)),
    "fp16 > torch bf16": (lambda: amp.autocast(dtype=F16), lambda: torch.autocast("cpu", dtype=B16), (B16, B16)),
    "fp16 > torch disabled": (lambda: amp.autocast(dtype=F16), lambda: torch.autocast("cpu", enabled=False),
                              (F32, F32)),
    "bf16 > torch bf16": (lambda: amp.autocast(dtype=B16), lambda: torch.autocast("cpu", dtype=B16), (B16, F32)),
}


def _outer_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    if name.startswith("torch"):
        return (F16 if "fp16" in name.split(">")[0] else B16,) * 2  # torch's CPU table: softmax as called
    return (F16 if name.startswith("fp16") else B16, F32)


def _run_case(name: str) -> list[torch.Tensor]:
    outer, inner, _ = CASES[name]
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    outs = []
    with outer():
        outs += _probe(lin, x)
        with inner():
            outs += _probe(lin, x)
        outs += _probe(lin, x)
    sum(o.float().sum() for o in outs).backward()
    return [*outs, x.grad, lin.weight.grad, lin.bias.grad]


@pytest.mark.parametrize("name", list(CASES))
def test_nesting_is_the_documented_one_and_the_same_under_both_engines(name):
    results = {}
    for engine in ENGINES:
        with autocast_mode.use_engine(engine):
            results[engine] = _run_case(name)
        outs = results[engine][:6]
        before, inside, after = outs[0:2], outs[2:4], outs[4:6]
        assert tuple(t.dtype for t in inside) == CASES[name][2], (engine, name)
        assert tuple(t.dtype for t in before) == tuple(t.dtype for t in after) == _outer_dtypes(name), (engine, name)
        assert all(t.isfinite().all() for t in results[engine]), (engine, name)
    for a, b in zip(results["dispatch"], results["mode"], strict=True):  # the engines agree, bit for bit
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_weight_in_regions_of_two_dtypes_is_cast_for_each():
    """fp16 -> bf16 -> fp16 regions on one weight, forward and backward, equal the same casts made by hand."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def by_hand() -> list[torch.Tensor]:
        w, b = lin.weight, lin.bias
        outs = [F.linear(x.to(d), w.to(d), b.to(d)) for d in (F16, B16, F16)]
        sum(o.float().sum() for o in outs).backward()
        return [*outs, lin.weight.grad.clone(), lin.bias.grad.clone()]

    ref = by_hand()
    for engine in ENGINES:
        lin.zero_grad()
        with autocast_mode.use_engine(engine):
            with amp.autocast(dtype=F16):
                outs = [lin(x)]
                with amp.autocast(dtype=B16):
                    outs.append(lin(x))
                outs.append(lin(x))
            sum(o.float().sum() for o in outs).backward()
        got = [*outs, lin.weight.grad, lin.bias.grad]
        for a, b in zip(ref, got, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), engine


def test_hf_rotary_pattern_torch_autocast_disabled_inside_a_region():
    """Hugging Face rotary embeddings compute ``inv_freq.float() @ positions.float()`` inside
    ``torch.autocast(device_type, enabled=False)``: fp32 under both engines, as under torch.autocast."""
    inv_freq = torch.rand(1, 4, 1)
    pos = torch.arange(6.0).view(1, 1, 6)
    ref = inv_freq @ pos
    for engine in ENGINES:
        with autocast_mode.use_engine(engine), amp.autocast(dtype=B16):
            with torch.autocast("cpu", enabled=False):
                got = inv_freq.float() @ pos.float()
                assert not amp.is_autocast_enabled()
            assert amp.is_autocast_enabled()
            assert (inv_freq @ pos).dtype == B16
        assert got.dtype == F32 and torch.equal(got, ref), engine
