"""The 8-bit-moment checks of one 2-process job (``test_state8_sharded.py``): ZeRO-1 and FSDP2 against one process,
the FSDP2 refusal of misaligned shards, and an FSDP2 checkpoint round trip (dcp). Imported by the spawned ranks;
results saved per rank."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fp16kit.kernels import use_backend
from fp16kit.kernels.backend import interpreter_active, triton_available
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


# FSDP2 (DTensor, Shard(0)) on 2 ranks. Layouts (fp16kit/optim/_state8_dtensor.py): "rows" (row size a multiple of
# 256, an uneven split, and one with an empty shard on rank 1), "flat" (a 1-D param), fp32 moments where a shard
# is below 4096 elements, and a small (fp32) param.
FSDP_SHAPES = [(64, 256), (17, 512), (1, 8192), (16384,), (33,)]
SMALL_SHARD = (64, 80)  # 8-bit in one process, but 2560-element shards: fp32 moments under FSDP2
MISALIGNED = (100, 96)  # shards of 50 rows x 96 = 4800 elements: rank 1 starts at 4800
INF_STEP = 1  # the step whose grad holds an inf on rank 1's shard only (skipped everywhere)
FSDP_CASES = {
    "adam": (FusedAdam, {"lr": 0.02, "weight_decay": 0.01}),
    # no trust ratio: elementwise, bit for bit
    "lamb_plain": (FusedLAMB, {"lr": 0.02, "weight_decay": 0.0, "max_grad_norm": 0.0}),
    # trust ratio from all-reduced partial norms (their last bits may differ from one process's)
    "lamb": (FusedLAMB, {"lr": 0.02, "weight_decay": 0.01, "max_grad_norm": 0.0}),
    # bf16 params with fp32 masters (DTensors too)
    "adam_bf16_masters": (FusedAdam, {"lr": 0.02, "weight_decay": 0.01, "master_weights": True}),
}


def _grads(seed: int, shapes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 3.0 for s in shapes]


def _full_state(opt, params) -> list[dict]:
    out = []
    for p in params:
        entry = {}
        for k, v in opt.state[p].items():
            entry[k] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
        out.append(entry)
    return out


def fsdp2_parity(rank: int, world: int) -> dict:
    """FSDP2 FusedAdam/FusedLAMB(state_bits=8) against one process over STEPS steps (one skipped): final params
    and state (codes, absmax), every rank gathering the full tensors."""
    mesh = init_device_mesh("cpu", (world,))
    shapes = [*FSDP_SHAPES, SMALL_SHARD]
    out = {}
    for name, (cls, cfg) in FSDP_CASES.items():
        init = _grads(0, shapes)
        if cfg.get("master_weights"):
            init = [t.bfloat16() for t in init]
        sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
        single = [nn.Parameter(t.clone()) for t in init]
        opt, ref = cls(sharded, state_bits=8, **cfg), cls(single, state_bits=8, **cfg)
        skips = []
        for step in range(STEPS):
            grads = _grads(100 + step, shapes)
            if step == INF_STEP:
                grads[0][-1, -1] = float("inf")  # the last row: rank 1's shard
            for p, q, g in zip(sharded, single, grads):
                g = g.to(p.dtype)
                p.grad, q.grad = distribute_tensor(g.clone(), mesh, [Shard(0)]), g.clone()
            before = [p.full_tensor() for p in sharded]
            opt.step()
            ref.step()
            skips.append(all(torch.equal(a, p.full_tensor()) for a, p in zip(before, sharded)))
        out[name] = {
            "sharded": [p.full_tensor() for p in sharded], "single": [p.detach().clone() for p in single],
            "state": _full_state(opt, sharded), "want": _full_state(ref, single), "skips": skips,
            "local_dtypes": [opt.state[p]["exp_avg"].to_local().dtype for p in sharded],
            "absmax_types": [type(opt.state[p].get("exp_avg_absmax")).__name__ for p in sharded],
        }
    return out


def fsdp2_misaligned(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.randn(MISALIGNED), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.randn(MISALIGNED), mesh, [Shard(0)])
    opt = FusedLAMB([torch.zeros(4, requires_grad=True), p], state_bits=8)
    try:
        opt.step()
    except ValueError as e:
        return str(e)
    return "no error"


CKPT_STEPS = 2


def _mlp(seed: int, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 256))  # weights: "rows" and "flat"
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model, opt, rank: int, world: int, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(500 + step)
        x = torch.randn(8, 256, generator=g)
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        opt.zero_grad()
        model(x[rows]).square().mean().backward()
        opt.step()


def fsdp2_checkpoint(rank: int, world: int, out_dir: str) -> dict:
    """CKPT_STEPS steps, dcp.save (model, optimizer), CKPT_STEPS more; versus a fresh model and optimizer (another
    init) restored with dcp.load + set_state_dict, CKPT_STEPS steps: bit-identical params and 8-bit state."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, cls in (("adam", FusedAdam), ("lamb", FusedLAMB)):
        path = os.path.join(out_dir, f"ckpt8_{name}")
        model = _mlp(0, mesh)
        opt = cls(model.parameters(), lr=0.01, weight_decay=0.01, state_bits=8)
        _train(model, opt, rank, world, 0, CKPT_STEPS)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        keys = sorted(k for k in saved if k.startswith("optim.state.0.weight"))
        _train(model, opt, rank, world, CKPT_STEPS, CKPT_STEPS)
        finals = [([p.full_tensor() for p in model.parameters()], _full_state(opt, list(model.parameters())))]

        model = _mlp(1, mesh)
        opt = cls(model.parameters(), lr=0.01, weight_decay=0.01, state_bits=8)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _train(model, opt, rank, world, CKPT_STEPS, CKPT_STEPS)
        finals.append(([p.full_tensor() for p in model.parameters()], _full_state(opt, list(model.parameters()))))
        out[name] = {"finals": finals, "keys": keys,
                     "dtypes": {k: str(opt.state[p][k].dtype) for p in model.parameters() for k in opt.state[p]
                                if p.numel() >= 4096}}
    return out


def job(rank: int, world: int, out_dir: str) -> None:
    with use_backend("torch"):
        res = {"zero1": zero1(rank, world), "fsdp2": fsdp2_parity(rank, world),
               "misaligned": fsdp2_misaligned(rank, world), "checkpoint": fsdp2_checkpoint(rank, world, out_dir)}
    if triton_available() and interpreter_active():
        # the Triton Adam kernel and LAMB stage kernels on the shards (interpreter on CPU tensors)
        with use_backend("auto"):
            res["fsdp2_triton"] = fsdp2_parity(rank, world)
    torch.save(res, f"{out_dir}/rank{rank}.pt")
