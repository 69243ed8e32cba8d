"""ZeRO-1 (``ZeroRedundancyOptimizer`` with ``process_group=``) with ``master_weights="split"``: each rank steps its
own whole bf16 params; the reassembled masters equal those of the same ZeRO-1 run with ``master_weights=True`` bit
for bit (the global grad norm and the inf flag are all-reduced, so LAMB clips by the norm over all ranks and an inf
seen by one rank skips every rank; that run matches one process within tests/distributed's LAMB budget).
2 gloo processes with a hard timeout (``_spawn.py``). FSDP2 (DTensor) params are refused in the bf16 modes
(docs/optim.md)."""

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


def test_fsdp2_params_are_refused_in_the_bf16_modes():
    from fp16kit.optim import FusedAdam

    p = torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)
    opt = FusedAdam([p], master_weights="split")
    p.grad = torch.ones(3, dtype=torch.bfloat16)
    import fp16kit.optim._base as base

    original = base.is_dtensor
    base.is_dtensor = lambda t: t is p
    try:
        opt._step_cache["rows_dtensors"] = True
        with pytest.raises(NotImplementedError, match="FSDP2"):
            opt.step()
    finally:
        base.is_dtensor = original
