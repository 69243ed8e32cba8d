"""Single-process pieces of the distributed support (no process group needed)."""

from __future__ import annotations

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
