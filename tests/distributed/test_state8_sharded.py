"""8-bit moments on 2 gloo processes (docs/optim.md, "8-bit moments"): ZeRO-1 (whole params per rank, so every
quantization block lies on one rank) and FSDP2 (DTensor, each shard quantized with the whole tensor's blocks) against
one process, the refusal of misaligned FSDP2 shards, and an FSDP2 dcp checkpoint round trip."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import _checks_state8
    import _spawn

    out = tmp_path_factory.mktemp("state8")
    _spawn.run(_checks_state8.job, 2, out, timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_zero1_matches_one_process(ranks):
    for r in ranks:
        adam, lamb = r["zero1"]["adam"], r["zero1"]["lamb"]
        # Adam is elementwise: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(adam["zero"], adam["single"]))
        # LAMB: the moments (codes, absmax) bit for bit; params within the per-tensor norms' rounding
        for res in (adam, lamb):
            assert res["state"] and res["state"].keys() == res["want"].keys()
            for i, entry in res["state"].items():
                for key, value in entry.items():
                    assert torch.equal(value, res["want"][i][key]), (i, key)
        for a, b in zip(lamb["zero"], lamb["single"]):
            torch.testing.assert_close(a, b, rtol=2**-16, atol=2**-30)
    for name in ("adam", "lamb"):  # not vacuous: both 8-bit params were stepped by some rank, with 8-bit state
        eight = {i for r in ranks for i, e in r["zero1"][name]["state"].items() if e["exp_avg"].dtype == torch.uint8}
        assert eight == {0, 2}, (name, eight)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, the absmax compared flattened (an FSDP2 "rows" absmax is 2-D, one process's 1-D)."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1), b.reshape(-1))


@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("fsdp2_triton", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("name", ["adam", "lamb_plain", "lamb", "adam_bf16_masters"])
def test_fsdp2_matches_one_process(ranks, name, backend):
    """FSDP2 (Shard(0)) FusedAdam/FusedLAMB(state_bits=8) on 2 ranks == one process: codes and absmax bit for bit
    (every layout: "rows" even, uneven and with an empty shard, "flat"), over 3 steps with one skipped (an inf in
    rank 1's shard skips every rank). ``fsdp2_triton``: the Triton kernels (interpreter) on both sides."""
    import _checks_state8 as C

    n8 = len(C.FSDP_SHAPES) - 1  # the 8-bit params (the last of FSDP_SHAPES is below 4096 elements)
    for r in ranks:
        if backend not in r:
            pytest.skip("the Triton interpreter is not active")
        res = r[backend][name]
        assert res["skips"] == [False, True, False]
        assert res["local_dtypes"] == [torch.uint8] * n8 + [torch.float32, torch.float32]
        assert res["absmax_types"][:n8] == ["DTensor"] * n8
        if name == "adam_bf16_masters":
            pairs = zip(res["state"][:n8 + 1], res["want"][:n8 + 1])  # the last param: fp32 moments here, 8-bit there
            assert all(torch.equal(s["master"], w["master"]) for s, w in pairs)
        for i in range(n8 + 1):
            got, want = res["state"][i], res["want"][i]
            assert got.keys() == want.keys(), i
            for key in got:
                assert _equal(got[key], want[key]), (name, i, key)
        # the param with 2560-element shards keeps fp32 moments under FSDP2 (8-bit in one process)
        assert res["state"][-1]["exp_avg"].dtype == res["state"][-1]["exp_avg_sq"].dtype == torch.float32
        sharded, single = res["sharded"][:n8 + 1], res["single"][:n8 + 1]
        if name == "lamb":
            # the trust ratio's norms are all-reduced partial sums, whose last bits may differ from one process's:
            # per step the update moves by <= 2^-18 of its size (tests/distributed/test_distributed.py derives
            # it) plus one ulp of p; two steps were taken (the third skipped)
            init = C._grads(0, [*C.FSDP_SHAPES, C.SMALL_SHARD])
            for a, b, p0 in zip(sharded, single, init):
                moved = float((b - p0).abs().max())
                torch.testing.assert_close(a, b, rtol=2**-22, atol=2 * 2**-18 * moved)
            assert any(not torch.equal(a, b) for a, b in zip(sharded, single))  # the budget is not vacuous
        else:  # elementwise: bit for bit
            assert all(torch.equal(a, b) for a, b in zip(sharded, single)), name


def test_fsdp2_misaligned_shard_is_refused_with_the_fix(ranks):
    for r in ranks:  # every rank raises the same error (a verdict from the global shape: no rank left waiting)
        msg = r["misaligned"]
        assert "param_groups[0]['params'][1] of shape (100, 96)" in msg, msg
        assert "starts at element 4800" in msg and "multiple of 256" in msg and "state_bits=32" in msg, msg


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_fsdp2_checkpoint_round_trip(ranks, name):
    """dcp.save/dcp.load + set_state_dict of an FSDP2 model with 8-bit moments: the resumed run is bit-identical
    (params, codes, absmax) to the uninterrupted one; the absmax is saved as its own DTensor entry."""
    for r in ranks:
        res = r["checkpoint"][name]
        assert res["keys"] == [f"optim.state.0.weight.{k}" for k in
                               ("exp_avg", "exp_avg_absmax", "exp_avg_sq", "exp_avg_sq_absmax")]
        assert res["dtypes"]["exp_avg"] == "torch.uint8"
        (p0, s0), (p1, s1) = res["finals"]
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))
        for a, b in zip(s0, s1):
            assert a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
