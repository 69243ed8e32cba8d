"""The checks one multi-process job runs (imported by the spawned ranks; results saved per rank)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fp16kit.optim import LARC, FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

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


def optimizer_parity(
    rank: int, world: int, names: tuple[str, ...] = tuple(OPT_CASES), per_shard_run: bool = True
) -> dict:
    """Sharded step (DTensor params, Shard(0)) vs the same optimizer on full tensors vs per-shard norms.

    Every rank builds the same full tensors; grads are given exactly (no model), so the only difference
    between the sharded and the full step is how the sums of squares are split and ordered.
    """
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in names:
        cls, cfg, dtype = OPT_CASES[name]
        init = _full_tensors(0, 1.0, dtype)
        sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
        full = [nn.Parameter(t.clone()) for t in init]
        per_shard = [nn.Parameter(p.to_local().clone()) for p in sharded]
        opts = [_make(cls, ps, cfg) for ps in ((sharded, full, per_shard) if per_shard_run else (sharded, full))]
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
        masters = [opt.master_params() for opt in opts]
        out[name] = {
            "sharded": [m.full_tensor() for m in masters[0]],
            "full": [m.detach().clone() for m in masters[1]],
            # the per-shard run, gathered: what a rank-local norm would have produced
            "per_shard": [_gather_dim0(m.detach(), world) for m in masters[2]] if per_shard_run else None,
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
        traj = [[t.clone() for t in init]]
        for step in range(STEPS):
            grads = _full_tensors(100 + step, 3.0)  # identical on every rank, as after DDP's all-reduce
            for p, q, g in zip(params, ref, grads):
                p.grad, q.grad = g.clone(), g.clone()
            zero.step()
            single.step()
            traj.append([p.detach().clone() for p in ref])
        out[name] = {"zero": [p.detach().clone() for p in params], "single": traj[-1], "traj": traj}
    return out


# ---------------------------------------------------------------------------------------------------------
# FSDP2 runs: a small MLP, fully_shard per layer and at the root, a global batch of 16 rows split over ranks

INF_STEP = 2  # the step whose gradients hold an inf on rank 1 only


def _fsdp_model(seed: int, mesh, *, dtype=torch.float32, mp_policy=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
    kw = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    for layer in (model[0], model[2]):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _loss(model: nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    rows = slice(rank * 16 // world, (rank + 1) * 16 // world)
    dtype = next(model.parameters()).dtype
    return nn.functional.mse_loss(model(x[rows].to(dtype)).float(), y[rows])


def _inject(model: nn.Module, step: int, rank: int) -> None:
    if step == INF_STEP and rank == 1:
        model[0].weight.grad.to_local().view(-1)[0] = float("inf")


def _train(model, opt, scaler, rank, world, steps, start=0, before_step=None) -> dict:
    """``steps`` scaled iterations; returns the scale after each and the steps this rank skipped."""
    scales, skipped = [], []
    for step in range(start, start + steps):
        opt.zero_grad()
        scaler.scale(_loss(model, step, rank, world)).backward()
        _inject(model, step, rank)
        if before_step is not None:
            before_step(step)
        old = [p.to_local().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if all(torch.equal(a, p.to_local()) for a, p in zip(old, model.parameters())):
            skipped.append(step)
    return {"scales": scales, "skipped": skipped}


def scaler_parity(rank: int, world: int) -> dict:
    """fp16kit GradScaler vs torch's ShardedGradScaler, both with torch.optim.AdamW on the same FSDP2 run,
    and fp16kit GradScaler + FusedAdam (the optimizer combines the flag inside its step)."""
    import warnings

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fp16kit.amp import GradScaler

    mesh = init_device_mesh("cpu", (world,))
    kw = {"init_scale": 2.0**10, "growth_interval": 2}
    runs = {
        "torch": (lambda: ShardedGradScaler(device="cpu", **kw), torch.optim.AdamW),
        "fp16kit": (lambda: GradScaler(**kw, max_scale=None), torch.optim.AdamW),
        "fp16kit_fused": (lambda: GradScaler(**kw, max_scale=None), FusedAdam),
    }
    out = {}
    for name, (make_scaler, opt_cls) in runs.items():
        model = _fsdp_model(0, mesh)
        opt = opt_cls(model.parameters(), lr=0.01, weight_decay=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = _train(model, opt, make_scaler(), rank, world, steps=6)
        res["params"] = [p.full_tensor() for p in model.parameters()]
        res["warnings"] = [str(w.message) for w in caught if "DTensor" in str(w.message) or "numel=1" in str(w.message)]
        out[name] = res
    return out


def zero_scaler(rank: int, world: int) -> dict:
    """Plain (non-DTensor) grads partitioned over ranks, inf on rank 1 only: with ``process_group`` every
    rank's flag says skip (for torch's SGD and for an fp16kit optimizer without a group of its own);
    without it only rank 1 knows."""
    from fp16kit.amp import GradScaler

    out = {}
    cases = {
        "with_group": (dist.group.WORLD, lambda ps: torch.optim.SGD(ps, lr=0.1)),
        "without_group": (None, lambda ps: torch.optim.SGD(ps, lr=0.1)),
        # an fp16kit optimizer that does not know the group: the scaler checks and combines before its step
        "fused_with_group": (dist.group.WORLD, lambda ps: FusedAdam(ps, lr=0.1)),
    }
    for name, (group, make_opt) in cases.items():
        p = nn.Parameter(torch.ones(4))
        opt = make_opt([p])
        scaler = GradScaler(init_scale=8.0, process_group=group)
        scaler.scale((p * (rank + 1.0)).sum()).backward()
        if rank == 1:
            p.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        out[name] = {"scale": scaler.get_scale(), "stepped": not torch.equal(p.detach(), torch.ones(4))}
    return out


def fsdp_mixed_precision(rank: int, world: int) -> dict:
    """FSDP2 with MixedPrecisionPolicy (bf16/fp16 compute, fp32 reduce) + fp16kit GradScaler + sharded FusedLAMB
    vs FusedLAMB on full tensors fed the same (gathered, unscaled) gradients every step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fp16kit.amp import GradScaler

    mesh = init_device_mesh("cpu", (world,))
    cfg = {"lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 0.5, "on_nonfinite": "skip"}
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        model = _fsdp_model(0, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
        opt = FusedLAMB(model.parameters(), **cfg)
        ref_params = [nn.Parameter(p.full_tensor()) for p in model.parameters()]
        ref = FusedLAMB(ref_params, **cfg)
        scaler = GradScaler(init_scale=2.0**10, growth_interval=2)
        traj = [[p.detach().clone() for p in ref_params]]

        def before_step(step, model=model, opt=opt, scaler=scaler, ref=ref, ref_params=ref_params, traj=traj):
            scaler.unscale_(opt)
            for q, p in zip(ref_params, model.parameters()):
                q.grad = p.grad.full_tensor()
            ref.step()
            traj.append([q.detach().clone() for q in ref_params])

        res = _train(model, opt, scaler, rank, world, steps=5, before_step=before_step)
        res.update(sharded=[p.full_tensor() for p in model.parameters()], full=traj[-1], traj=traj)
        out[str(dtype)] = res
    return out


def fsdp_vs_single_process(rank: int, world: int) -> dict:
    """FSDP2 (fp32) + sharded FusedLAMB vs one process training the same model on the global batch.

    The reference accumulates the per-rank micro-batch gradients (sum over ranks, then divided by the world
    size), which is what FSDP2's reduce-scatter computes; at 2 ranks the two-term sum is the same in either
    order, so at equal params the gradients are bit-identical (recorded every step; true at step 0, later
    steps see params that already differ by the optimizer's rounding) and the optimizer's norms differ.
    """
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    cfg = {"lr": 0.01, "weight_decay": 0.01, "max_grad_norm": 0.5}
    model = _fsdp_model(0, mesh)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt, ref_opt = FusedLAMB(model.parameters(), **cfg), FusedLAMB(ref.parameters(), **cfg)
    traj, grads_equal = [[p.detach().clone() for p in ref.parameters()]], []
    for step in range(5):
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(model, step, rank, world).backward()
        for r in range(world):
            _loss(ref, step, r, world).backward()
        for p in ref.parameters():
            p.grad.div_(world)
        full = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        grads_equal.append(all(torch.equal(a, b.grad) for a, b in zip(full, ref.parameters())))
        opt.step()
        ref_opt.step()
        traj.append([p.detach().clone() for p in ref.parameters()])
    return {"sharded": [p.full_tensor() for p in model.parameters()], "full": traj[-1], "traj": traj,
            "grads_equal": grads_equal}


def checkpoint_resume(rank: int, world: int, out_dir: str) -> dict:
    """N steps, dcp.save (model, FusedLAMB/FusedAdam, GradScaler), M steps; versus a fresh model/optimizer/
    scaler (another init) restored with dcp.load + set_state_dict, M steps: bit-identical."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fp16kit.amp import GradScaler

    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "lamb_bf16_masters": (lambda ps: FusedLAMB(ps, lr=0.01, master_weights=True), torch.bfloat16),
        "adam": (lambda ps: FusedAdam(ps, lr=0.01, weight_decay=0.01), torch.float32),
    }
    out = {}
    n, m = 3, 3  # the inf at INF_STEP = 2 falls before the save: the scale has backed off
    for name, (make_opt, dtype) in cases.items():
        path = os.path.join(out_dir, f"ckpt_{name}")
        model = _fsdp_model(0, mesh, dtype=dtype)
        opt = make_opt(model.parameters())
        scaler = GradScaler(init_scale=2.0**10, growth_interval=2)
        _train(model, opt, scaler, rank, world, steps=n)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "scaler": scaler.state_dict()}, checkpoint_id=path)
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        layout = {k: (tuple(v.size), len(v.chunks)) for k, v in stored.items()
                  if "0.weight" in k and hasattr(v, "chunks")}
        runs = [_train(model, opt, scaler, rank, world, steps=m, start=n)]
        finals = [_snapshot(model, opt, scaler)]

        model = _fsdp_model(1, mesh, dtype=dtype)
        opt = make_opt(model.parameters())
        scaler = GradScaler(init_scale=2.0**3, growth_interval=2)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "scaler": scaler.state_dict()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scaler.load_state_dict(state["scaler"])
        runs.append(_train(model, opt, scaler, rank, world, steps=m, start=n))
        finals.append(_snapshot(model, opt, scaler))
        out[name] = {"runs": runs, "finals": finals, "layout": layout}
    return out


def _snapshot(model, opt, scaler) -> dict:
    state = [{k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in opt.state[p].items()}
             for p in model.parameters()]
    return {"params": [p.full_tensor() for p in model.parameters()], "state": state,
            "steps": [g["step"].clone() for g in opt.param_groups], "scaler": scaler.state_dict()}


def edge_cases(rank: int, world: int) -> dict:
    """(1) Without a scaler, an inf in rank 1's shard makes every rank skip (the flag rides in all-reduce #1),
    so no tensor ends up with shards from different steps. (2) A ``process_group`` that is not the DTensor
    params' mesh group is refused with a clear error, raised before any collective (no rank hangs)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for cls in (FusedLAMB, FusedAdam):
        p = nn.Parameter(distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])
        if rank == 1:
            p.grad.to_local()[0, 0] = float("inf")
        opt = cls([p], lr=0.1, on_nonfinite="skip")
        opt.step()
        out[cls.__name__] = {"unchanged": torch.equal(p.to_local(), torch.ones_like(p.to_local())),
                             "step": float(opt.param_groups[0]["step"])}
    sub = dist.new_group(ranks=[0])
    p = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    try:
        FusedLAMB([p], process_group=sub).step()
        out["error"] = None
    except ValueError as e:
        out["error"] = str(e)
    return out


APEX_CASES = {
    "sgd": (FusedSGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "sgd_nesterov": (FusedSGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "wd_after_momentum": True,
                                "weight_decay": 0.01}),
    "adagrad": (FusedAdagrad, {"lr": 0.05, "weight_decay": 0.01}),
    "adagrad_w": (FusedAdagrad, {"lr": 0.05, "weight_decay": 0.01, "adagrad_w_mode": True}),
}


def apex_parity(rank: int, world: int) -> dict:
    """FusedSGD/FusedAdagrad on DTensor params (Shard(0), uneven and empty shards) vs the same optimizer on the
    full tensors, over STEPS steps, then one step whose finite grads overflow the update in the last rank's shard
    (every rank must skip it: the result check raises the flag before it is shared). And FusedNovoGrad / LARC
    refuse DTensor params at construction with a clear error (issue 22, item 5)."""
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, (cls, cfg) in APEX_CASES.items():
        init = _full_tensors(0, 1.0)
        sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
        full = [nn.Parameter(t.clone()) for t in init]
        opts = [_make(cls, ps, cfg) for ps in (sharded, full)]
        for step in range(STEPS + 1):
            grads = _full_tensors(100 + step, 3.0)
            if step == STEPS:  # finite, but g * g (Adagrad) or lr * g (SGD) overflows: in the last row only
                grads[0][-1] = 3e37 if cls is FusedSGD else 3e19
                for o in opts:
                    for g in o.param_groups:
                        g["lr"] = 1e2 if cls is FusedSGD else g["lr"]
            for ps, gs in ((sharded, [distribute_tensor(g, mesh, [Shard(0)]) for g in grads]), (full, grads)):
                for p, g in zip(ps, gs):
                    p.grad = g
            for o in opts:
                o.on_nonfinite = "skip"
                o.step()
        out[name] = {
            "sharded": [p.full_tensor() for p in sharded],
            "full": [p.detach().clone() for p in full],
            "state": [
                {k: v.full_tensor() for k, v in opts[0].state[p].items()} for p in sharded if opts[0].state[p]
            ],
            "state_full": [{k: v.clone() for k, v in opts[1].state[p].items()} for p in full if opts[1].state[p]],
            "skips": int(opts[0].nonfinite_skips),
            "skips_full": int(opts[1].nonfinite_skips),
            "comm": (opts[0]._shard_plan.all_reduces, opts[0]._shard_plan.bytes_reduced),
        }
    refusals = {}
    p = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    for label, make in (("FusedNovoGrad", lambda: FusedNovoGrad([p], lr=0.1)),
                        ("LARC", lambda: LARC(torch.optim.SGD([p], lr=0.1))),
                        ("LARC.add_param_group", lambda: LARC(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))
                         .add_param_group({"params": [p]}))):
        try:
            make()
            refusals[label] = None
        except ValueError as e:
            refusals[label] = str(e)
    out["refusals"] = refusals
    return out


def ping(rank: int, world: int, out_dir: str) -> None:
    """The smallest job: one all-reduce, its result saved (``tests/distributed/test_local.py``)."""
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    torch.save(float(t), f"{out_dir}/ping{rank}.pt")


def job(rank: int, world: int, out_dir: str) -> None:
    """Everything one spawned job checks (one process start-up for all of it), saved as ``rank{r}.pt``."""
    import time

    from fp16kit.kernels import use_backend
    from fp16kit.kernels.backend import interpreter_active, triton_available

    res, seconds = {}, {}
    with use_backend("torch"):
        checks = [optimizer_parity, zero1_parity, scaler_parity, zero_scaler, fsdp_mixed_precision, edge_cases,
                  apex_parity]
        if world == 2:  # see fsdp_vs_single_process: bit-identical gradients need a two-term sum
            checks.append(fsdp_vs_single_process)
        for fn in checks:
            t = time.perf_counter()
            res[fn.__name__] = fn(rank, world)
            seconds[fn.__name__] = time.perf_counter() - t
        t = time.perf_counter()
        res["checkpoint_resume"] = checkpoint_resume(rank, world, out_dir)
        seconds["checkpoint_resume"] = time.perf_counter() - t
    if world == 2 and triton_available() and interpreter_active():
        # the sharded LAMB on the real Triton stage kernels (interpreter on CPU tensors)
        t = time.perf_counter()
        with use_backend("auto"):
            res["optimizer_parity_triton"] = optimizer_parity(
                rank, world, names=("lamb", "lamb_l2_bf16"), per_shard_run=False
            )
        seconds["optimizer_parity_triton"] = time.perf_counter() - t
        with use_backend("auto"):  # the apex kernels' shard steps (and their result check) on Triton too
            res["apex_parity_triton"] = apex_parity(rank, world)
    res["seconds"] = seconds
    torch.save(res, f"{out_dir}/rank{rank}.pt")
