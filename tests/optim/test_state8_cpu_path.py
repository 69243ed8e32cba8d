"""The CPU path of the 8-bit torch implementation (``fp16kit/kernels/state8/fallback.py``: 8-bit rows chunk by
chunk, the skip read on the host) against the masked sequence it replaces there (still the path off the CPU, and on
the CPU under ``masked_commits()``): params, model copies, codes and absmax bit for bit, with tensors of several
chunks and ragged tails; and the quantizer's table look-up against ``torch.searchsorted`` at every threshold, its
fp32 neighbours and every end of the table's intervals."""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import use_backend
from fp16kit.kernels.fallback.step import masked_commits
from fp16kit.kernels.state8 import rule as s8
from fp16kit.kernels.state8.fallback import _CHUNK
from fp16kit.optim import FusedAdam, FusedLAMB

SHAPES = [(3 * _CHUNK + 1000,), (2 * _CHUNK // 256, 256), (s8.SMALL_NUMEL + 300,), (300,)]
CASES = {
    "adam": (FusedAdam, {"lr": 0.02, "weight_decay": 0.01}),
    "adam_l2": (FusedAdam, {"lr": 0.02, "weight_decay": 0.01, "adam_w_mode": False}),
    "lamb": (FusedLAMB, {"lr": 0.02, "weight_decay": 0.01}),
    "lamb_l2_nvlamb": (FusedLAMB, {"lr": 0.02, "weight_decay": 0.01, "adam_w_mode": False, "use_nvlamb": True}),
}


def _run(cls, cfg, dtype, masked: bool, skip_step: int | None = 1):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    opt = cls(params, state_bits=8, master_weights=dtype != torch.float32, on_nonfinite="skip", **cfg)
    for step in range(3):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 3).to(dtype)
        if step == skip_step:
            params[0].grad.view(-1)[-1] = float("inf")
        with use_backend("torch"):
            if masked:
                with masked_commits():
                    opt.step()
            else:
                opt.step()
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_path_is_the_masked_sequence_bit_for_bit(name, dtype):
    cls, cfg = CASES[name]
    got_p, got = _run(cls, cfg, dtype, masked=False)
    want_p, want = _run(cls, cfg, dtype, masked=True)
    for a, b in zip(got_p, want_p):
        assert torch.equal(a, b)
        sa, sb = got.state[a], want.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key].view(torch.uint8), sb[key].view(torch.uint8)), (name, key)
    assert got.state[got_p[0]]["exp_avg"].dtype == torch.uint8


@pytest.mark.parametrize("signed", [True, False])
def test_table_lookup_is_searchsorted(signed):
    thr = s8.book(torch.device("cpu"))[s8._offset(signed) + 256 : s8._offset(signed) + 511]
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    h = torch.arange(1 << 16, dtype=torch.int64)
    ends = torch.cat([h << 16, (h << 16) | 0xFFFF]).to(torch.int64)
    ends = torch.where(ends >= 1 << 31, ends - (1 << 32), ends).to(torch.int32).view(torch.float32)
    y = torch.cat([thr, torch.nextafter(thr, up), torch.nextafter(thr, down), -thr, ends,
                   torch.rand(1 << 16) * 2 - 1, torch.tensor([0.0, -0.0, 1.0, -1.0])])
    y = y[y.abs() <= 1].contiguous()  # the quotients x / absmax of a block
    want = torch.searchsorted(thr, y, right=True, out_int32=True)
    assert torch.equal(s8._codes(y, signed).int(), want)
    assert torch.equal(s8._codes(torch.full((3,), float("nan")), signed), torch.zeros(3, dtype=torch.uint8))


def test_high_halves_both_ways(monkeypatch):
    """The CPU's uint16 view and the shift-and-mask used off the CPU give the same table index (the second branch
    taken here by reporting a big-endian host: the function reads ``sys.byteorder`` at each call)."""
    import sys

    y = torch.cat([torch.rand(1 << 12) * 2 - 1, torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan"), -3e38, 1e-40])])
    shifted = torch.bitwise_right_shift(y.view(torch.int32), 16).bitwise_and_(0xFFFF)
    little = s8._high_halves(y)
    monkeypatch.setattr(sys, "byteorder", "big")
    other = s8._high_halves(y)
    assert little.dtype == other.dtype == torch.int32
    assert torch.equal(little, shifted) and torch.equal(other, shifted)
