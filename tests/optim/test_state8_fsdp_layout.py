"""The FSDP2 layout rule of 8-bit moments (``fp16kit/optim/_state8_dtensor.py``), checked without processes: FSDP2's
dim-0 split is ``torch.chunk``'s, and wherever a param gets 8-bit DTensor state, ``torch.chunk`` of its absmax gives
every rank exactly the blocks of its shard (which start at a multiple of 256); the 2-process runs are in
``tests/distributed/test_state8_sharded.py``."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("torch.distributed.tensor")
from torch.distributed.tensor import Replicate, Shard

from fp16kit.optim._state8_dtensor import _layout, shard_ranges

ROWS = [1, 2, 3, 5, 7, 16, 17, 63, 64, 100, 1001]
COLS = [(), (80,), (96,), (256,), (512,), (3, 128), (4096,)]
WORLDS = [1, 2, 3, 4, 8]


def _chunk_ranges(n: int, world: int) -> list[tuple[int, int]]:
    """``torch.chunk`` of ``range(n)`` into ``world`` pieces (missing pieces empty), as FSDP2 shards dim 0."""
    pieces = torch.arange(n).chunk(world) if n else ()
    out = [(int(c[0]), int(c[-1]) + 1) if c.numel() else (n, n) for c in pieces]
    return out + [(n, n)] * (world - len(out))


@pytest.mark.parametrize("world", WORLDS)
def test_shard_ranges_are_torch_chunk(world):
    for rows, cols in itertools.product(ROWS, COLS):
        row = 1
        for c in cols:
            row *= c
        got = shard_ranges(rows, row, world)
        want = [(a * row, b * row) for a, b in _chunk_ranges(rows, world)]
        assert [(a, b) for a, b in got if b > a] == [(a, b) for a, b in want if b > a], (rows, cols, world)


@pytest.mark.parametrize("world", WORLDS)
def test_absmax_chunks_are_the_shards_blocks(world):
    seen = set()
    for rows, cols in itertools.product(ROWS, COLS):
        shape = (rows, *cols)
        numel = rows
        for c in cols:
            numel *= c
        if numel < 4096:
            continue
        kind, _ = _layout(shape, (Shard(0),), (world,))
        seen.add(kind)
        row = numel // rows
        ranges = shard_ranges(rows, row, world)
        if kind == "fp32":
            assert min(b - a for a, b in ranges if b > a) < 4096
            continue
        if kind == "misaligned":
            assert any(b > a and a % 256 for a, b in ranges)
            continue
        if kind == "unchunkable":
            continue
        assert all(a % 256 == 0 for a, b in ranges if b > a)
        assert min(b - a for a, b in ranges if b > a) >= 4096
        blocks = -(-numel // 256)
        absmax_rows = rows if kind == "rows" else blocks
        per_row = row // 256 if kind == "rows" else 1
        assert absmax_rows * per_row == blocks
        for (a, b), (ca, cb) in zip(ranges, _chunk_ranges(absmax_rows, world)):
            want = (a // 256, -(-b // 256)) if b > a else None
            got = (ca * per_row, cb * per_row) if cb > ca else None
            assert got == want, (shape, world, kind)
    assert "rows" in seen


def test_replicate_and_other_placements():
    assert _layout((64, 256), (Replicate(), Shard(0)), (2, 2))[0] == "rows"
    assert _layout((64, 256), (Replicate(),), (2,))[0] == "rows"
    assert _layout((16384,), (Replicate(),), (2,))[0] == "flat"
    assert _layout((64, 256), (Shard(1),), (2,))[0] == "dim"
    assert _layout((64, 256), (Shard(0), Shard(0)), (2, 2))[0] == "dim"
    assert _layout((100, 96), (Shard(0),), (2,)) == ("misaligned", (1, 4800, 4800))
    assert _layout((64, 80), (Shard(0),), (2,)) == ("fp32", 2560)


def test_a_gathered_rows_absmax_loads_into_one_process():
    """An FSDP2 checkpoint gathered whole (``full_tensor()``) holds the "rows" absmax 2-D, ``(dim0, row / 256)``: a
    single-process 8-bit optimizer loads it exactly."""
    from fp16kit.optim import FusedAdam

    p = torch.nn.Parameter(torch.randn(32, 512))
    p.grad = torch.randn(32, 512)
    opt = FusedAdam([p], state_bits=8)
    opt.step()
    sd = opt.state_dict()
    want = {k: v.clone() for k, v in sd["state"][0].items()}
    for key in ("exp_avg_absmax", "exp_avg_sq_absmax"):
        sd["state"][0][key] = sd["state"][0][key].reshape(32, 2).clone()
    q = torch.nn.Parameter(p.detach().clone())
    other = FusedAdam([q], state_bits=8)
    other.load_state_dict(sd)
    for key, value in want.items():
        assert torch.equal(other.state[q][key].reshape(-1), value.reshape(-1)), key
