"""The checks one multi-process job runs (imported by the spawned ranks; results saved per rank)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fp16kit.optim import FusedAdam, FusedLAMB

# Shapes chosen so that sharding on dim 0 is uneven, and at 4 ranks some shards are empty.
SHAPES = [(7, 5), (3,), (1,), (13, 4, 2), (2, 3), (9,)]
STEPS = 4


def _full_tensors(seed: int, scale: float, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=g) * scale * (1 + i)).to(dtype) for i, s in enumerate(SHAPES)]


def _make(opt_cls, params, cfg):
    groups = [{"params": params[:3]}, {"params": params[3:], "lr": cfg["lr"] * 0.5}]
    return opt_cls(groups, **{k: v for k, v in cfg.items()})


OPT_CASES = {
    # LAMB: decoupled decay (trust ratio on), the clip active (grad norm ~ 10 > 1)
    "lamb": (FusedLAMB, {"lr": 0.02, "weight_decay": 0.01, "max_grad_norm": 1.0}, torch.float32),
    # LAMB, L2 mode and NVLAMB, fp32 masters of bf16 params
    "lamb_l2_bf16": (FusedLAMB, {"lr": 0.02, "weight_decay": 0.05, "adam_w_mode": False, "use_nvlamb": True,
                                 "max_grad_norm": 2.0, "master_weights": True}, torch.bfloat16),
    "adam": (FusedAdam, {"lr": 0.02, "weight_decay": 0.01}, torch.float32),
}


def optimizer_parity(rank: int, world: int) -> dict:
    """Sharded step (DTensor params, Shard(0)) vs the same optimizer on full tensors vs per-shard norms.

    Every rank builds the same full tensors; grads are given exactly (no model), so the only difference
    between the sharded and the full step is how the sums of squares are split and ordered.
    """
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, (cls, cfg, dtype) in OPT_CASES.items():
        init = _full_tensors(0, 1.0, dtype)
        sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
        full = [nn.Parameter(t.clone()) for t in init]
        per_shard = [nn.Parameter(p.to_local().clone()) for p in sharded]
        opts = [_make(cls, ps, cfg) for ps in (sharded, full, per_shard)]
        traj, comm = [[t.clone() for t in init]], []
        for step in range(STEPS):
            grads = _full_tensors(100 + step, 3.0, dtype)
            for ps, gs in ((sharded, [distribute_tensor(g, mesh, [Shard(0)]) for g in grads]), (full, grads)):
                for p, g in zip(ps, gs):
                    p.grad = g
            for p, s in zip(per_shard, sharded):
                p.grad = s.grad.to_local().clone()
            for opt in opts:
                opt.step()
            plan = opts[0]._shard_plan
            comm.append((plan.all_reduces, plan.bytes_reduced))
            traj.append([p.detach().clone() for p in full])
        masters = [opts[i].master_params() for i in range(3)]
        out[name] = {
            "sharded": [m.full_tensor() for m in masters[0]],
            "full": [m.detach().clone() for m in masters[1]],
            # the per-shard run, gathered: what a rank-local norm would have produced
            "per_shard": [_gather_dim0(m.detach(), world) for m in masters[2]],
            "model": [p.full_tensor() for p in sharded],
            "traj": [[t.float() for t in ts] for ts in traj],
            "comm": comm,
            "step": [float(g["step"]) for g in opts[0].param_groups],
        }
    return out


def _gather_dim0(t: torch.Tensor, world: int) -> torch.Tensor:
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([t.shape[0] if t.dim() else 1]))
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])


def zero1_parity(rank: int, world: int) -> dict:
    """ZeroRedundancyOptimizer(FusedLAMB): each rank steps whole params; with process_group the clip uses
    the norm over all ranks' grads (the single-process result), without it each rank clips by its own."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out = {}
    for name, group in (("with_group", dist.group.WORLD), ("without_group", None)):
        init = _full_tensors(0, 1.0)
        params = [nn.Parameter(t.clone()) for t in init]
        ref = [nn.Parameter(t.clone()) for t in init]
        cfg = {"lr": 0.02, "weight_decay": 0.01, "max_grad_norm": 1.0}
        zero = ZeroRedundancyOptimizer(params, optimizer_class=functools.partial(FusedLAMB, process_group=group),
                                       **cfg)
        single = FusedLAMB(ref, **cfg)
        for step in range(STEPS):
            grads = _full_tensors(100 + step, 3.0)  # identical on every rank, as after DDP's all-reduce
            for p, q, g in zip(params, ref, grads):
                p.grad, q.grad = g.clone(), g.clone()
            zero.step()
            single.step()
        out[name] = {"zero": [p.detach().clone() for p in params], "single": [p.detach().clone() for p in ref]}
    return out
