"""Single-process pieces of the distributed support (no process group needed)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fp16kit.distributed import is_dtensor, is_sharded, local, shard_group
from fp16kit.optim import FusedAdam, FusedLAMB


@pytest.mark.parametrize("cls", [FusedLAMB, FusedAdam])
def test_empty_param_with_a_grad_steps(cls):
    """A rank's empty FSDP2 shard, seen in one process: an empty tensor adds nothing to the grad norm
    (it used to raise: "_foreach_norm cannot compute the infinity norm on an empty tensor")."""
    empty, full = nn.Parameter(torch.empty(0, 3)), nn.Parameter(torch.ones(4))
    empty.grad, full.grad = torch.empty(0, 3), torch.full((4,), 0.5)
    ref = nn.Parameter(torch.ones(4))
    ref.grad = torch.full((4,), 0.5)
    opt, ref_opt = cls([empty, full], lr=0.1), cls([ref], lr=0.1)
    opt.step()
    ref_opt.step()
    assert torch.equal(full, ref) and not torch.equal(full, torch.ones(4))
    assert empty.shape == (0, 3)


def test_plain_tensors_are_not_sharded():
    t = torch.ones(3)
    assert local(t) is t and not is_dtensor(t) and not is_sharded(t)
    assert shard_group("test", [t, torch.zeros(2)]) == (False, None)


def test_single_process_step_plans_no_collectives():
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = FusedLAMB([p])
    opt.step()
    assert opt._shard_plan is None and opt.process_group is None


def test_spawned_ranks_meet_without_a_tcp_port(tmp_path, monkeypatch):
    """Issue 22, item 9: the ranks of every multi-process test meet through a ``file://`` store, so a port
    another process takes first cannot kill a run (rank 1 died with SIGABRT on a busy machine). Here a
    neighbour already listens on the port a "bind port 0, close, reuse" helper is made to pick; the run must
    not care."""
    import _checks
    import _spawn

    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    port = thief.getsockname()[1]

    class Stolen(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", port)

    fake = SimpleNamespace(socket=Stolen, AF_INET=socket.AF_INET, SOCK_STREAM=socket.SOCK_STREAM)
    monkeypatch.setattr(_spawn, "socket", fake, raising=False)
    try:
        _spawn.run(_checks.ping, 2, tmp_path, timeout=60)
    finally:
        thief.close()
    assert [torch.load(tmp_path / f"ping{r}.pt") for r in range(2)] == [3.0, 3.0]
