"""timm's optimizer factory through fp16kit's apex aliases (``fp16kit.compat``), when timm can be imported.

``timm.optim.create_optimizer_v2(model, "fusedlamb", ...)`` imports ``apex.optimizers.FusedLAMB``; with the aliases
installed (what ``python -m fp16kit run train.py`` does) that is fp16kit's optimizer. Checked: the class each apex
name resolves to, the arguments and param groups timm passes (its no-weight-decay group for biases and norms, its
per-name defaults), one step equal bit for bit to the same optimizer built by hand, and timm's refusal without CUDA
(``assert torch.cuda.is_available()`` before it imports an apex class; docs/ecosystem.md says what to do on a CPU).

timm is not in the ``testing`` extra: it needs torchvision, whose PyPI wheels are CUDA builds that do not import next
to a CPU torch (docs/ecosystem.md); the test skips where ``import timm`` fails.
"""

from __future__ import annotations

import pytest
import torch

try:
    import timm.optim
except Exception as exc:  # absent, or its torchvision import fails (a CUDA torchvision next to a CPU torch)
    pytest.skip(f"timm cannot be imported here: {exc!r}", allow_module_level=True)

from fp16kit import compat
from fp16kit.optim import FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

# timm name -> (fp16kit class, the keywords timm passes on top of lr and weight_decay)
NAMES = {
    "fusedlamb": (FusedLAMB, {}),
    "fusedadam": (FusedAdam, {"adam_w_mode": False}),
    "fusedadamw": (FusedAdam, {"adam_w_mode": True}),
    "fusedsgd": (FusedSGD, {"nesterov": True, "momentum": 0.9}),
    "fusednovograd": (FusedNovoGrad, {"betas": (0.95, 0.98)}),
}


@pytest.fixture
def aliases():
    compat.install_apex()
    yield
    compat.uninstall_apex()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(NAMES))
def test_timm_factory_builds_fp16kit_optimizers(name, aliases, monkeypatch) -> None:
    cls, extra = NAMES[name]
    model = _model()
    with monkeypatch.context() as m:  # timm's factory asserts CUDA before importing an apex class: a GPU machine
        m.setattr(torch.cuda, "is_available", lambda: True)
        opt = timm.optim.create_optimizer_v2(model, name, lr=1e-2, weight_decay=0.05)
    assert isinstance(opt, cls) and type(opt).__module__ == "apex.optimizers"
    decay = [p for p in model.parameters() if p.ndim > 1]  # timm: no weight decay for biases and norm weights
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    by_wd = {g["weight_decay"]: [id(p) for p in g["params"]] for g in opt.param_groups}
    assert by_wd == {0.0: [id(p) for p in no_decay], 0.05: [id(p) for p in decay]}
    for key, value in extra.items():
        got = getattr(opt, key, None) if key == "adam_w_mode" else opt.param_groups[0][key]
        assert got == value, f"{name}: {key}={got!r}, timm passes {value!r}"

    ref_model = _model()
    groups = [{"params": [p for p in ref_model.parameters() if p.ndim <= 1], "weight_decay": 0.0},
              {"params": [p for p in ref_model.parameters() if p.ndim > 1], "weight_decay": 0.05}]
    ref = cls(groups, lr=1e-2, **extra)
    for a, b in zip(_step(model, opt), _step(ref_model, ref)):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="timm's refusal is for machines without CUDA")
def test_timm_factory_refuses_apex_names_without_cuda(aliases) -> None:
    with pytest.raises(AssertionError, match="CUDA required for APEX optimizers"):
        timm.optim.create_optimizer_v2(_model(), "fusedlamb", lr=1e-2)
