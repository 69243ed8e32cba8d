"""8-bit moments on 2 gloo processes (docs/optim.md, "8-bit moments"): ZeRO-1 (whole params per rank, so every
quantization block lies on one rank) against one process, and FSDP2 (DTensor) params refused with the reason."""

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
    _spawn.run(_checks_state8.job, 2, out, timeout=150)
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


def test_fsdp2_params_are_refused_with_the_reason(ranks):
    for r in ranks:
        assert "FSDP2 (DTensor) params is not supported yet" in r["fsdp2"]
