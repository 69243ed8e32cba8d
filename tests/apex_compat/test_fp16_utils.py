"""``apex.fp16_utils`` (``fp16kit.fp16_utils``): the helpers scripts still import, reachable through the aliases."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from apex_models import batches, classifier
from torch import nn

from fp16kit import amp, compat
from fp16kit import fp16_utils as fu


def _net() -> nn.Module:
    return classifier(nn.BatchNorm1d)


def _data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(n, size=7, seed=3)


def test_imagenet_example_import_line_and_to_python_float(tmp_path) -> None:
    """apex's examples/imagenet/main_amp.py: its import block, run unmodified through ``python -m fp16kit run``."""
    script = tmp_path / "main_amp_imports.py"
    script.write_text(textwrap.dedent("""
        import torch
        try:
            from apex.parallel import DistributedDataParallel as DDP
            from apex.fp16_utils import *
            from apex import amp, optimizers
            from apex.multi_tensor_apply import multi_tensor_applier
        except ImportError:
            raise ImportError("Please install apex from https://www.github.com/nvidia/apex to run this example.")

        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        loss = model(torch.randn(3, 4)).float().pow(2).mean()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        reduced_loss = loss.data
        print("loss", to_python_float(reduced_loss) == loss.item(), type(to_python_float(reduced_loss)).__name__)
        print("names", all(name in globals() for name in ("network_to_half", "FP16_Optimizer", "BN_convert_float")))
    """))
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo, "FP16KIT_BACKEND": "torch"}
    out = subprocess.run([sys.executable, "-m", "fp16kit", "run", str(script)], capture_output=True, text=True,
                         timeout=300, env=env, cwd=repo)
    assert out.returncode == 0, out.stderr
    assert "loss True float" in out.stdout and "names True" in out.stdout


def test_reachable_as_apex_fp16_utils_through_the_aliases() -> None:
    compat.install_apex()
    try:
        import apex
        import apex.fp16_utils as apex_fu

        assert apex_fu is fu and apex.fp16_utils is fu
        assert apex_fu.to_python_float(torch.tensor(2.5)) == 2.5 and apex_fu.to_python_float([1.5]) == 1.5
        with pytest.raises(AttributeError, match="weight_norm"):
            apex_fu.Fused_Weight_Norm  # noqa: B018
    finally:
        compat.uninstall_apex()


def test_network_to_half_bn_convert_float_and_convert_network() -> None:
    half = fu.network_to_half(_net())
    assert isinstance(half[0], fu.tofp16)
    net = half[1]
    assert net[0].weight.dtype == torch.float16 and net[1].weight.dtype == torch.float32
    assert net[1].running_mean.dtype == torch.float32
    assert half(torch.randn(4, 6)).dtype == torch.float16
    conv = fu.convert_network(_net(), torch.float16)
    assert conv[0].weight.dtype == torch.float16 and conv[1].weight.dtype == torch.float32
    model = fu.FP16Model(_net())
    assert model(torch.randn(4, 6)).dtype == torch.float16
    wrapped = fu.FP16_Module(nn.Linear(3, 2))
    assert wrapped(torch.randn(2, 3)).dtype == torch.float32
    assert fu.fp16_to_fp32([torch.ones(1, dtype=torch.float16), 3])[0].dtype == torch.float32


@pytest.mark.parametrize("flat", [False, True])
def test_manual_master_lists(flat) -> None:
    model = _net().half()
    fu.BN_convert_float(model) if not flat else None
    model_params, masters = fu.prep_param_lists(model, flat_master=flat)
    assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)
    x = torch.randn(5, 6, dtype=torch.float16)
    model(x).float().sum().backward()
    fu.model_grads_to_master_grads(model_params, masters, flat_master=flat)
    grads = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    got = masters[0].grad if flat else torch.cat([m.grad.reshape(-1) for m in masters])
    assert torch.equal(got, grads)
    with torch.no_grad():
        for m in masters:
            m.add_(1.0)
    fu.master_params_to_model_params(model_params, masters, flat_master=flat)
    values = masters[0] if flat else torch.cat([m.reshape(-1) for m in masters])
    assert torch.equal(torch.cat([p.float().reshape(-1) for p in model_params]),
                       torch.cat([v.to(p.dtype).float().reshape(-1) for v, p in zip(
                           torch.split(values.detach(), [p.numel() for p in model_params]), model_params)]))


def test_flat_master_refuses_mixed_dtypes() -> None:
    with pytest.raises(TypeError, match="several dtypes"):
        fu.prep_param_lists(fu.BN_convert_float(_net().half()), flat_master=True)


def _fp16_optimizer_run(steps: int, poison: set[int], resume_at: int | None = None) -> tuple[list, dict]:
    model = fu.BN_convert_float(_net().half())
    opt = fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                            verbose=False)
    data = _data(steps)
    for i, (x, y) in enumerate(data):
        if resume_at is not None and i == resume_at:
            ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
            model = fu.BN_convert_float(_net().half())
            opt = fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    dynamic_loss_scale=True, verbose=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.half()).float(), y)
        opt.backward(loss * float("inf") if i in poison else loss)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def test_fp16_optimizer_matches_amp_o2_and_skips_overflows() -> None:
    poison = {1, 4}
    params, state = _fp16_optimizer_run(6, poison)
    # amp O2 from the same fp16-rounded start: the same bits
    model = fu.BN_convert_float(_net().half()).float()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for i, (x, y) in enumerate(_data(6)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss * float("inf") if i in poison else loss, opt) as scaled:
            scaled.backward()
        opt.step()
    for a, b in zip(params, model.parameters()):
        assert torch.equal(a, b.detach())
    assert state["loss_scaler"]["scale"] == amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**14


def test_fp16_optimizer_resumes_bit_for_bit() -> None:
    straight, s1 = _fp16_optimizer_run(6, {2})
    resumed, s2 = _fp16_optimizer_run(6, {2}, resume_at=3)
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
    assert s1["loss_scaler"] == s2["loss_scaler"]
    for g1, g2 in zip(s1["fp32_from_fp16"], s2["fp32_from_fp16"]):
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_fp16_optimizer_static_scale_clip_and_messages(capsys) -> None:
    model = fu.network_to_half(_net())
    opt = fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0)
    printed = capsys.readouterr().out
    assert "FP16_Optimizer processing param group 0:" in printed
    assert opt.loss_scale == 128.0 and opt.param_groups is opt.optimizer.param_groups
    opt.backward(model(torch.randn(4, 6)).float().pow(2).mean())
    norm = opt.clip_master_grads(1e-3)
    assert float(norm) > 1e-3
    total = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for g in opt.param_groups for p in g["params"]]))
    assert float(total) == pytest.approx(1e-3, rel=1e-3)
    opt.step()
    with pytest.raises(RuntimeError, match="state_dict"):
        import pickle

        pickle.dumps(opt)
    dyn = fu.FP16_Optimizer(torch.optim.SGD(_net().half().parameters(), lr=0.1), dynamic_loss_scale=True,
                            dynamic_loss_args={"init_scale": 1024.0, "scale_window": 10}, verbose=False)
    assert dyn.loss_scale == 1024.0 and dyn.loss_scaler.growth_interval == 10
    with pytest.raises(TypeError, match="closure"):
        dyn.step(lambda: None)


def test_legacy_dynamic_loss_scaler() -> None:
    s = fu.DynamicLossScaler(init_scale=8.0, scale_window=2)
    s.update_scale(False)  # (0 - -1) % 2 != 0
    s.update_scale(False)  # (1 - -1) % 2 == 0: grow
    assert s.loss_scale == 16.0
    s.update_scale(True)
    assert s.loss_scale == 8.0 and s.last_overflow_iter == 2
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("nan")])
    assert s.has_overflow([p]) and not fu.LossScaler(4.0).has_overflow([p])
