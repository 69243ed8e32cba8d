"""torch.distributed's activation checkpointing (``apply_activation_checkpointing`` with ``checkpoint_wrapper``)
composed with FSDP2 (``fully_shard``) under fp16kit's autocast, on 2 gloo processes (``tests/distributed/_spawn.py``):
the sharded gradients, gathered, equal those of the same FSDP2 model without checkpointing bit for bit, under both
engines, fp16 and bf16 regions, fp32 and bf16 parameters (docs/autocast.md, "Activation checkpointing"). Slow: two
spawned processes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed")]


def _grads(engine: str, pdtype: torch.dtype, low: torch.dtype, checkpointing: bool) -> list[torch.Tensor]:
    from test_checkpointing import Block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp16kit import amp
    from fp16kit.amp import autocast_mode

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), Block()).to(pdtype)
    if checkpointing:
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, Block))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(1 + dist.get_rank())  # each rank its own batch: the reduce-scatter matters
    x = torch.randn(4, 16, dtype=pdtype, requires_grad=True)
    with autocast_mode.use_engine(engine):
        with amp.autocast(dtype=low):
            loss = model(x).float().square().mean()
        loss.backward()
    return [loss.detach(), x.grad, *(p.grad.full_tensor() for p in model.parameters())]


def _ranks(rank: int, world: int, out_dir: str) -> None:
    for engine in ("dispatch", "mode"):
        for pdtype, low in ((torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                            (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float16)):
            ref = _grads(engine, pdtype, low, False)
            got = _grads(engine, pdtype, low, True)
            assert all(t.isfinite().all() for t in ref), (engine, pdtype, low)
            for i, (a, b) in enumerate(zip(ref, got, strict=True)):
                assert a.dtype == b.dtype and torch.equal(a, b), (engine, pdtype, low, i)
    Path(out_dir, f"ok{rank}").write_text("ok")


def test_checkpoint_wrapper_with_fsdp2_gives_the_uncheckpointed_gradients(tmp_path):
    import _spawn

    _spawn.run(_ranks, 2, tmp_path, timeout=300)
    assert all(Path(tmp_path, f"ok{r}").exists() for r in range(2))
