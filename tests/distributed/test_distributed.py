"""fp16kit on torch.distributed: FSDP2 (DTensor), ZeRO-1, sharded loss scaling, sharded checkpoints.

One spawned job per world size (2 and 4 processes, gloo on 127.0.0.1, a hard timeout) runs every check in
``_checks.py`` and saves each rank's results; the tests below only read them (process start-up dominates the
cost, so everything shares one start).

The ulp budget for sharded LAMB vs one process (same gradients; u = 2^-24, fp32 unit roundoff). The two
runs differ only in how sums of squares are split and ordered: the global grad norm (per-shard fp32 norms,
summed over ranks), and each param's ||p|| and ||u|| (partial sums, all-reduced). A norm of n <= 128
elements summed pairwise in fp32 is within ~log2(n)+1 <= 8u of the exact value, so two evaluations differ by
<= 16u. Per step that moves: the clip factor by <= 16u; each element of u by <= 16u (the rescaled gradient
runs through ~8 roundings in each run; Adam's u is scale-invariant up to eps, so a relative change of g
changes u by at most as much); the trust ratio lr ||p||/||u|| by <= 16u + 16u + 1u. The update Δ = ratio·u is
therefore within 65u ≈ 2^-18 relative of the single-process one, and the rounding of p - Δ can land on
either neighbour of the exact result: one ulp of the new p. Errors in p carry over additively, so after K
steps, per element::

    |p_sharded - p_single| <= sum_k ulp32(p_k) + 2^-18 * sum_k |p_k - p_(k-1)|      (p_k: the single-process run)

(second-order terms, e.g. the carried error entering wd·p and ||p||, are ~2^-18 of these and ignored).
Per-shard norms (each rank's own ||p||, ||u|| and clip) change the trust ratio by O(1): they must exceed the
same budget by orders of magnitude, which the test asserts too.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from fp16kit.numerics.formats import ulp, ulp_distance

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

JOB_TIMEOUT_S = {2: 150, 4: 240}


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request, tmp_path_factory):
    """Per-rank results of one spawned job (see ``_checks.job``)."""
    import _checks
    import _spawn

    world = request.param
    out = tmp_path_factory.mktemp(f"world{world}")
    _spawn.run(_checks.job, world, out, timeout=JOB_TIMEOUT_S[world])
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _budget(traj: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The derived budget (module docstring) along the single-process trajectory ``traj[k][i]``."""
    out = []
    for i in range(len(traj[0])):
        path = [step[i].double() for step in traj]
        out.append(sum(ulp(b, torch.float32) + 2.0**-18 * (b - a).abs() for a, b in itertools.pairwise(path)))
    return out


def _worst(got: list[torch.Tensor], want: list[torch.Tensor], bound: list[torch.Tensor]) -> float:
    """max |got - want| / bound over every element of every tensor."""
    return max(float(((g.detach().double() - w.double()).abs() / b).max()) for g, w, b in zip(got, want, bound))


def _check_parity(results: dict, name: str) -> None:
    res = results[name]
    bound = _budget(res["traj"])
    worst = _worst(res["sharded"], res["full"], bound)
    assert worst <= 1.0, f"{name}: sharded step off by {worst:.3g}x the ulp budget"
    if name.startswith("lamb"):
        # not vacuous: rank-local norms break the same budget by orders of magnitude
        assert res["per_shard"] is None or _worst(res["per_shard"], res["full"], bound) > 1e3
        # one all-reduce per norm stage: [sum g^2, inf flag] and [sum p^2, sum u^2 per param] (float64)
        assert res["comm"] == [(2, 8 * (2 + 2 * len(res["full"])))] * len(res["comm"])
    else:
        assert res["comm"] == [(1, 16)] * len(res["comm"])  # the flag (and the unused norm): one all-reduce
    for m, p in zip(res["sharded"], res["model"]):
        assert torch.equal(m.to(p.dtype), p)  # the model copy is the rounded master
    assert res["step"] == [4.0, 4.0]


@pytest.mark.parametrize("name", ["lamb", "lamb_l2_bf16", "adam"])
def test_sharded_optimizer_matches_single_process(ranks, name):
    for r in ranks:  # every rank gathered the same full tensors
        _check_parity(r["optimizer_parity"], name)
    if name == "adam":  # no norms at all: elementwise on the shards, bit for bit
        res = ranks[0]["optimizer_parity"]["adam"]
        assert all(torch.equal(a, b) for a, b in zip(res["sharded"], res["full"]))


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["lamb", "lamb_l2_bf16"])
def test_sharded_lamb_on_triton_stage_kernels(ranks, name):
    if len(ranks) != 2:
        pytest.skip("the Triton-interpreter run is part of the 2-process job only")
    _check_parity(ranks[0]["optimizer_parity_triton"], name)


def _check_apex_parity(res: dict, name: str) -> None:
    case = res[name]
    # elementwise updates on the shards: bit for bit the single-process step, state included
    assert all(torch.equal(a, b) for a, b in zip(case["sharded"], case["full"])), name
    assert len(case["state"]) == len(case["state_full"])
    for a, b in zip(case["state"], case["state_full"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    # the overflow in one rank's shard skipped the step on every rank, as in the single process
    assert case["skips"] == case["skips_full"] == 1, name
    assert case["comm"] == (1, 16)  # the flag: one all-reduce, as FusedAdam
    for p in case["sharded"]:
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("name", ["sgd", "sgd_nesterov", "adagrad", "adagrad_w"])
def test_sharded_apex_optimizers_match_single_process(ranks, name):
    """Issue 22, item 5: FusedSGD and FusedAdagrad step FSDP2 shards (they raised AttributeError in
    ``_sharding.localize``), with the single-process result and the skip agreed over all ranks."""
    for r in ranks:
        _check_apex_parity(r["apex_parity"], name)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_sharded_apex_optimizers_on_triton_kernels(ranks, name):
    if len(ranks) != 2:
        pytest.skip("the Triton-interpreter run is part of the 2-process job only")
    for r in ranks:
        _check_apex_parity(r["apex_parity_triton"], name)


def test_novograd_and_larc_refuse_dtensor_params_at_construction(ranks):
    """NovoGrad's per-tensor second moment and LARC's per-param norms need whole tensors: a clear error at
    construction (they failed mid-step with an AttributeError or a bare AssertionError)."""
    for r in ranks:
        for label, message in r["apex_parity"]["refusals"].items():
            assert message is not None and "does not support FSDP2/DTensor parameters" in message, label
            assert label.split(".")[0] in message


def test_zero1_lamb_clips_by_the_norm_over_all_ranks(ranks):
    for r in ranks:
        with_group, without = r["zero1_parity"]["with_group"], r["zero1_parity"]["without_group"]
        # the same budget as FSDP2 (only the global grad norm is split here)
        assert _worst(with_group["zero"], with_group["single"], _budget(with_group["traj"])) <= 1.0
        # each rank clipped by its own norm: far outside it
        assert _worst(without["zero"], without["single"], _budget(without["traj"])) > 1e3


def test_grad_scaler_matches_sharded_grad_scaler(ranks):
    """fp16kit GradScaler + AdamW == ShardedGradScaler + AdamW on the same FSDP2 run (inf on rank 1 only)."""
    for r in ranks:
        runs = r["scaler_parity"]
        ref = runs["torch"]
        assert ref["skipped"] == [2]  # the inject reached the decision
        for name in ("fp16kit", "fp16kit_fused"):
            assert runs[name]["scales"] == ref["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0]
            assert runs[name]["skipped"] == ref["skipped"]
            # fp16kit combines the flag itself; DTensor's implicit replication (its warning) is not involved
            assert runs[name]["warnings"] == []
        # fp16kit's GradScaler with AdamW's own foreach step: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(runs["fp16kit"]["params"], ref["params"]))
        # FusedAdam's CPU path is torch's fused Adam kernel (docs/optim.md), which rounds its few operations in
        # another order than AdamW's foreach sequence: at most 2 fp32 ulp per step, over the 5 steps taken
        # (the skipped step changes nothing, bit for bit)
        for a, b in zip(runs["fp16kit_fused"]["params"], ref["params"]):
            distance = int(ulp_distance(a, b).max()) if a.numel() else 0
            assert distance <= 2 * 5, f"FusedAdam vs AdamW: {distance} ulp (measured: 2)"


def test_grad_scaler_process_group_combines_found_inf(ranks):
    for rank, r in enumerate(ranks):
        assert r["zero_scaler"]["with_group"] == {"scale": 4.0, "stepped": False}
        assert r["zero_scaler"]["fused_with_group"] == {"scale": 4.0, "stepped": False}
        # without the group only rank 1 (holding the inf) skips: the failure the group prevents
        want = {"scale": 4.0, "stepped": False} if rank == 1 else {"scale": 8.0, "stepped": True}
        assert r["zero_scaler"]["without_group"] == want


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_fsdp2_mixed_precision_lamb_with_grad_scaler(ranks, dtype):
    for r in ranks:
        res = r["fsdp_mixed_precision"][dtype]
        assert res["skipped"] == [2] and res["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
        # same grads fed to a one-process FusedLAMB: within the derived budget
        assert _worst(res["sharded"], res["full"], _budget(res["traj"])) <= 1.0


def test_fsdp2_training_matches_one_process_on_the_global_batch(ranks):
    if len(ranks) != 2:
        pytest.skip("at 4 ranks the reduce-scatter's sum order differs from any one-process order")
    for r in ranks:
        res = r["fsdp_vs_single_process"]
        # the premise: at equal params FSDP2's gradient is bit for bit the one-process gradient (step 0); later
        # gradients are taken at params that differ within the budget, a second-order effect the budget absorbs
        assert res["grads_equal"][0]
        assert _worst(res["sharded"], res["full"], _budget(res["traj"])) <= 1.0


@pytest.mark.parametrize("name", ["lamb_bf16_masters", "adam"])
def test_checkpoint_resume_is_bit_identical(ranks, name):
    for r in ranks:
        cont, resumed = r["checkpoint_resume"][name]["finals"]
        runs = r["checkpoint_resume"][name]["runs"]
        assert runs[0] == runs[1]
        assert all(torch.equal(a, b) for a, b in zip(cont["params"], resumed["params"]))
        for a, b in zip(cont["state"], resumed["state"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert "master" in cont["state"][0] if name.startswith("lamb") else "master" not in cont["state"][0]
        assert [float(s) for s in cont["steps"]] == [float(s) for s in resumed["steps"]] == [5.0]
        assert cont["scaler"] == resumed["scaler"]
        # stored sharded: the first layer's weight (16 x 8) and its state, one chunk written by each rank
        layout = r["checkpoint_resume"][name]["layout"]
        wanted = ["exp_avg", "exp_avg_sq", "master"] if name.startswith("lamb") else ["exp_avg", "exp_avg_sq"]
        for key in wanted:
            assert [v for k, v in layout.items() if k.endswith(f"0.weight.{key}")] == [((16, 8), len(ranks))], layout


def test_inf_on_one_rank_skips_every_rank_without_a_scaler(ranks):
    for r in ranks:
        for name in ("FusedLAMB", "FusedAdam"):
            assert r["edge_cases"][name] == {"unchanged": True, "step": 0.0}


def test_process_group_other_than_the_mesh_is_refused(ranks):
    for r in ranks:
        assert "process_group spans other ranks than the device mesh" in r["edge_cases"]["error"]

