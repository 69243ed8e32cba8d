"""ZeRO-1 (``ZeroRedundancyOptimizer`` with ``process_group=``) with ``master_weights="split"``: each rank steps its
own whole bf16 params; the reassembled masters equal those of the same ZeRO-1 run with ``master_weights=True`` bit
for bit (the global grad norm and the inf flag are all-reduced, so LAMB clips by the norm over all ranks and an inf
seen by one rank skips every rank; that run matches one process within tests/distributed's LAMB budget). FSDP2
(DTensor) shards in split mode: the same, shard by shard. 2 gloo processes with a hard timeout (``_spawn.py``).
FusedLAMB's split and both optimizers' stochastic mode on FSDP2 shards: ``test_bf16_fsdp2.py``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 4
INF_STEP = 2


def _job(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from fp16kit.kernels import split_halves
    from fp16kit.optim import FusedAdam, FusedLAMB

    out = {}
    for name, cls, cfg in (("adam", FusedAdam, {"lr": 1e-2, "weight_decay": 0.01}),
                           ("lamb", FusedLAMB, {"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 1.0})):
        g = torch.Generator().manual_seed(0)
        init = [torch.randn(n, generator=g).bfloat16() for n in (300, 17, 64, 5)]
        params = [torch.nn.Parameter(t.clone()) for t in init]
        ref = [torch.nn.Parameter(t.clone()) for t in init]
        zero, single = (ZeroRedundancyOptimizer(
            ps, optimizer_class=functools.partial(cls, process_group=dist.group.WORLD, master_weights=mode,
                                                  on_nonfinite="skip"), **cfg) for ps, mode in ((params, "split"),
                                                                                                (ref, True)))
        for step in range(STEPS):
            gg = torch.Generator().manual_seed(100 + step)
            grads = [(torch.randn(t.shape, generator=gg) * 3.0).bfloat16() for t in init]
            if step == INF_STEP:
                grads[0][1] = float("inf")  # param 0's owner alone sees it
            for p, q, gr in zip(params, ref, grads):
                p.grad, q.grad = gr.clone(), gr.clone()
            zero.step()
            single.step()
        local = zero.optim
        owned = [p for grp in local.param_groups for p in grp["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        out[name] = {
            "owned": [index[id(p)] for p in owned],
            "masters": local.split_masters(),
            "ref_masters": [single.optim.state[ref[index[id(p)]]]["master"] for p in owned],
            "params": [p.detach().clone() for p in params],  # after ZeRO's broadcast: every param, every rank
            "ref_hi": [split_halves(m)[0] for m in _gather_masters(single, ref)],
            "step": [float(grp["step"]) for grp in local.param_groups],
        }
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def _gather_masters(zero, params: list) -> list[torch.Tensor]:
    """Every param's fp32 master, from its owner rank (broadcast)."""
    out = []
    for p in params:
        state = zero.optim.state.get(p, {})
        owner = torch.tensor([dist.get_rank() if "master" in state else -1])
        dist.all_reduce(owner, op=dist.ReduceOp.MAX)
        m = state["master"].clone() if "master" in state else torch.empty(p.shape, dtype=torch.float32)
        dist.broadcast(m, int(owner))
        out.append(m)
    return out


def test_zero1_split_equals_fp32_masters(tmp_path):
    import _spawn

    _spawn.run(_job, 2, tmp_path, timeout=150)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name in ("adam", "lamb"):
        owned = sorted(i for r in ranks for i in r[name]["owned"])
        assert owned == [0, 1, 2, 3], owned  # the params are partitioned over the ranks
        for r in ranks:
            res = r[name]
            assert res["step"] == [STEPS - 1.0]  # the inf on one rank skipped the step on both
            for a, b in zip(res["masters"], res["ref_masters"]):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
            for a, b in zip(res["params"], res["ref_hi"]):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def _fsdp_job(rank: int, world: int, out_dir: str) -> None:
    """FSDP2 (a bf16 MLP, fully_shard per layer and at the root): the same sharded gradients stepped with
    ``master_weights="split"`` and with ``master_weights=True``; every step's local masters, and the local bf16
    params against the master's split high halves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp16kit.kernels import split_halves
    from fp16kit.optim import FusedAdam

    mesh = init_device_mesh("cpu", (world,))

    def fsdp_model():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).bfloat16()
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    out = {}
    for name, cls, cfg in (("adam", FusedAdam, {"lr": 1e-2, "weight_decay": 0.01}),):
        split_model, ref_model = fsdp_model(), fsdp_model()
        split_opt = cls(split_model.parameters(), master_weights="split", on_nonfinite="skip", **cfg)
        ref_opt = cls(ref_model.parameters(), master_weights=True, on_nonfinite="skip", **cfg)
        same = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randn(8, 8, generator=g).bfloat16()[rank * 4:(rank + 1) * 4]
            split_model(x).float().pow(2).sum().backward()
            for p, q in zip(split_model.parameters(), ref_model.parameters()):
                q.grad = p.grad.clone()  # the same sharded gradients for both
            if step == INF_STEP and rank == 1:
                next(iter(split_model.parameters())).grad.to_local()[0, 0] = float("inf")
                next(iter(ref_model.parameters())).grad.to_local()[0, 0] = float("inf")
            split_opt.step()
            ref_opt.step()
            split_opt.zero_grad()
            ref_opt.zero_grad()
            masters = split_opt.split_masters()
            refs = [ref_opt.state[q]["master"].to_local() for q in ref_model.parameters()]
            same.append(all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(masters, refs)))
        out[name] = {
            "same_masters_every_step": same,
            "hi_is_split": all(torch.equal(p.to_local().view(torch.int16),
                                           split_halves(ref_opt.state[q]["master"].to_local())[0].view(torch.int16))
                               for p, q in zip(split_model.parameters(), ref_model.parameters())),
            "step": [float(grp["step"]) for grp in split_opt.param_groups],
        }
    torch.save(out, f"{out_dir}/rank{rank}.pt")


def test_fsdp2_split_equals_fp32_masters(tmp_path):
    """FSDP2 shards in split mode (FusedAdam): the masters are bit for bit those of ``master_weights=True`` on the
    same shards every step (an inf on one rank skips both ranks). FusedLAMB: ``test_bf16_fsdp2.py``."""
    import _spawn

    _spawn.run(_fsdp_job, 2, tmp_path, timeout=150)
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for name in ("adam",):
            assert res[name]["same_masters_every_step"] == [True] * STEPS, (r, name)
            assert res[name]["hi_is_split"], (r, name)
            assert res[name]["step"] == [STEPS - 1.0], (r, name)


def test_fsdp2_params_are_refused_in_a_mode_the_class_does_not_list():
    """FusedAdam and FusedLAMB step FSDP2 shards in both bf16 modes; the refusal in ``step()`` stays for an optimizer
    whose sharded step lacks a mode's epilogue (``_fsdp2_bf16_modes``), naming what fits."""
    import fp16kit.optim
    import fp16kit.optim._base as base

    class SplitOnly(fp16kit.optim.FusedAdam):
        _fsdp2_bf16_modes = ("split",)

    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = SplitOnly([p], master_weights="stochastic")
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    original = base.is_dtensor
    base.is_dtensor = lambda t: t is p
    try:
        opt._step_cache["rows_dtensors"] = True
        with pytest.raises(NotImplementedError, match=r"FSDP2.*'split' or True"):
            opt.step()
    finally:
        base.is_dtensor = original
