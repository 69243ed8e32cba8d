"""The doctor's view under the optimizer modes that keep fewer bytes per parameter (issue 26, item 4): bf16 weights
with split masters or stochastic rounding, and 8-bit moments. The doctor reads the gradients the backward pass
produces; these modes change only how the optimizer keeps weights and moments, so watching must work unchanged:
the first step's histograms equal those of the fp32-master run (same weights, same batch, same grads), every
parameter's gradient is counted, and watching changes no bit of training in any mode.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fp16kit import doctor
from fp16kit.optim import FusedAdam, FusedLAMB

MODES = {
    "fp32 masters": {"master_weights": True},
    "split": {"master_weights": "split"},
    "stochastic": {"master_weights": "stochastic", "rounding_seed": 7},
    "split + 8-bit moments": {"master_weights": "split", "state_bits": 8},
    "stochastic + 8-bit moments": {"master_weights": "stochastic", "rounding_seed": 7, "state_bits": 8},
}


def bf16_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4)).bfloat16()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, gen: torch.Generator) -> None:
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=gen).bfloat16(), torch.randint(0, 4, (16,), generator=gen)
        loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB])
def test_watching_every_weight_mode(cls):
    first = {}
    for name, options in MODES.items():
        model = bf16_mlp()
        opt = cls(model.parameters(), lr=1e-3, **options)
        assert opt.state_bits == options.get("state_bits", 32)
        gen = torch.Generator().manual_seed(1)
        with doctor.watch(model, every=1) as w:
            train(model, opt, 1, gen)
            first[name] = w.histograms().clone()
            train(model, opt, 2, gen)
        report = w.report()
        assert w.samples == 3
        assert sum(e.values for e in report.entries) == 3 * sum(p.numel() for p in model.parameters())
        unwatched = bf16_mlp()
        train(unwatched, cls(unwatched.parameters(), lr=1e-3, **options), 3, torch.Generator().manual_seed(1))
        for a, b in zip(model.parameters(), unwatched.parameters()):
            assert torch.equal(a, b), f"{name}: watching changed training"
    reference = first.pop("fp32 masters")
    assert reference.sum() > 0
    for name, hist in first.items():
        assert torch.equal(hist, reference), f"{name}: the first step's gradients read differently"
