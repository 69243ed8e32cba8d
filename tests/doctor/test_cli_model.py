"""``python -m fp16kit doctor --model MODULE:FACTORY`` on a tiny model module written in a tmp dir, run as a
subprocess (with a timeout); a saved ``doctor.json`` read back with ``--model FILE.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp16kit.__main__ import main as cli_main

ROOT = Path(__file__).parents[2]

TINY = textwrap.dedent('''
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.body(x) * 1e-4, y)  # small logits: small gradients


    def make():
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        batches = [(torch.randn(32, 8, generator=gen), torch.randint(0, 4, (32,), generator=gen)) for _ in range(3)]
        return Net(), batches


    def with_loss_fn():
        model, batches = make()
        return model, batches, lambda m, b: m(*b) * 2.0


    def not_a_model():
        return 3
''')


def run_cli(args, cwd, timeout=240):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("TRITON_INTERPRET", None)  # the model is on the CPU: the torch kernels serve it
    return subprocess.run([sys.executable, "-m", "fp16kit", "doctor", *args], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True)


def test_own_model_from_the_command_line(tmp_path):
    (tmp_path / "tinymodel.py").write_text(TINY)
    done = run_cli(["--model", "tinymodel:make", "--steps", "6", "--every", "2", "--out", "out"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "fp16kit doctor on tinymodel:make: Net (212 parameters), fp32, 6 steps, cpu" in done.stdout
    assert "recommended for float16, no scaler watched" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()[2:]) <= 100
    data = json.loads((tmp_path / "out" / "doctor.json").read_text())
    assert data["samples"] == 3 and data["steps"] == 6 and data["loss_scale_basis"] == "recommended"
    names = [e["name"] for e in data["entries"]]
    assert "body.0.weight" in names and "body.2" in names  # parameters and module outputs
    assert data["consumers"]["body.0"] == ["body.1"]
    if (tmp_path / "out" / "doctor.png").exists() or "matplotlib is missing" not in done.stderr:
        assert (tmp_path / "out" / "doctor.png").read_bytes()[:4] == b"\x89PNG"

    # a file path works as MODULE too, with a loss_fn, under autocast with a scaler
    done = run_cli(["--model", str(tmp_path / "tinymodel.py") + ":with_loss_fn", "--steps", "4", "--every", "2",
                    "--autocast", "bfloat16", "--scaler", "dynamic", "--out", "bf16"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "autocast bfloat16, GradScaler" in done.stdout
    assert "bf16 gradients with a loss scaler" in done.stdout  # the misuse, in one line of advice

    # the saved report, judged again at another scale
    done = run_cli(["--model", "out/doctor.json", "--loss-scale", "1", "--out", "again"], tmp_path)
    assert done.returncode == 0, done.stderr
    again = json.loads((tmp_path / "again" / "doctor.json").read_text())
    assert again["loss_scale"] == 1.0 and again["entries"] == data["entries"]


def test_bad_models_are_reported(tmp_path, capsys, monkeypatch):
    (tmp_path / "tinymodel.py").write_text(TINY)
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, message in [("tinymodel", "expected MODULE:FACTORY"), ("tinymodel:nothing", "no callable"),
                          ("tinymodel:not_a_model", "the factory returned int"),
                          ("no_such_module_xyz:f", "No module named"), (str(tmp_path / "x.json"), "x.json")]:
        assert cli_main(["doctor", "--model", spec, "--out", str(tmp_path / "o")]) == 2, spec
        assert message in capsys.readouterr().err, spec


def test_the_help_names_the_model_option():
    with pytest.raises(SystemExit):
        cli_main(["doctor", "--help"])
