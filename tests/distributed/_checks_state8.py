"""The 8-bit-moment checks of one 2-process job (``test_state8_sharded.py``): ZeRO-1 against one process, and the
FSDP2 refusal. Imported by the spawned ranks; results saved per rank."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdam, FusedLAMB

#: Two 8-bit params (one with a ragged last block) and two small fp32-state ones.
SHAPES = [(64, 80), (300,), (4100,), (33,)]
STEPS = 3
CASES = {
    "adam": (FusedAdam, {"lr": 0.02, "weight_decay": 0.01}),
    # no clip: the clip divisor's norm is summed in another order over ranks (its last bit may differ)
    "lamb": (FusedLAMB, {"lr": 0.02, "weight_decay": 0.01, "max_grad_norm": 0.0}),
}


def _tensors(seed: int, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def zero1(rank: int, world: int) -> dict:
    """ZeroRedundancyOptimizer(FusedAdam/FusedLAMB, state_bits=8) and one process on the same gradients: the final
    params, and the 8-bit state of the params this rank owns, next to the single process's."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out = {}
    for name, (cls, cfg) in CASES.items():
        init = _tensors(0, 1.0)
        params = [nn.Parameter(t.clone()) for t in init]
        ref = [nn.Parameter(t.clone()) for t in init]
        zero = ZeroRedundancyOptimizer(
            params, optimizer_class=functools.partial(cls, process_group=dist.group.WORLD, state_bits=8), **cfg
        )
        single = cls(ref, state_bits=8, **cfg)
        for step in range(STEPS):
            for p, q, g in zip(params, ref, _tensors(100 + step, 3.0)):
                p.grad, q.grad = g.clone(), g.clone()
            zero.step()
            single.step()
        owned = [i for i, p in enumerate(params) if p in zero.optim.state]
        state = {i: {k: v.clone() for k, v in zero.optim.state[params[i]].items()} for i in owned}
        want = {i: {k: v.clone() for k, v in single.state[ref[i]].items()} for i in owned}
        out[name] = {"zero": [p.detach().clone() for p in params], "single": [p.detach().clone() for p in ref],
                     "state": state, "want": want}
    return out


def fsdp2_refused(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.randn(64, 80), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.randn(64, 80), mesh, [Shard(0)])
    opt = FusedLAMB([p], state_bits=8)
    try:
        opt.step()
    except NotImplementedError as e:
        return str(e)
    return "no error"


def job(rank: int, world: int, out_dir: str) -> None:
    with use_backend("torch"):
        res = {"zero1": zero1(rank, world), "fsdp2": fsdp2_refused(rank, world)}
    torch.save(res, f"{out_dir}/rank{rank}.pt")
