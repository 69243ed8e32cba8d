"""Backend dispatch rules, forced choices, and `python -m fp16kit info`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from fp16kit.kernels import Backend, select_backend, use_backend

CPU = torch.device("cpu")


def run_py(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FP16KIT_BACKEND")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


@pytest.mark.interpreter
def test_cpu_under_interpreter_uses_triton_kernels():
    assert select_backend(CPU).backend is Backend.INTERPRETER


def test_forced_torch_wins():
    with use_backend("torch"):
        choice = select_backend(CPU)
    assert choice.backend is Backend.TORCH and "forced" in choice.reason


def test_use_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="choose 'triton', 'torch' or 'auto'"), use_backend("cuda"):
        pass


def in_fresh_thread(fn):
    """Run ``fn`` where no use_backend() block is active (the forced-choice stack is thread-local)."""
    result = {}

    def target():
        try:
            result["value"] = fn()
        except Exception as err:
            result["error"] = err

    t = threading.Thread(target=target)
    t.start()
    t.join()
    return result


def test_env_var_is_read_per_call(monkeypatch):
    monkeypatch.setenv("FP16KIT_BACKEND", "bogus")
    err = in_fresh_thread(lambda: select_backend(CPU))["error"]
    assert isinstance(err, ValueError) and "FP16KIT_BACKEND='bogus' is not understood" in str(err)
    monkeypatch.setenv("FP16KIT_BACKEND", "torch")
    assert in_fresh_thread(lambda: select_backend(CPU))["value"].backend is Backend.TORCH


def test_cpu_without_interpreter_uses_fallback_and_forcing_triton_errors():
    code = (
        "import torch\nfrom fp16kit.kernels import select_backend, unscale_and_check\n"
        "print(select_backend(torch.device('cpu')).backend.value)\n"
        "import os; os.environ['FP16KIT_BACKEND'] = 'triton'\n"
        "try:\n    unscale_and_check([torch.ones(3)], 1.0, torch.zeros(1))\n"
        "except RuntimeError as e:\n    print('ERR', e)\n"
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "torch fallback"
    assert "ERR The triton backend was forced" in out.stdout and "Unset FP16KIT_BACKEND" in out.stdout


def test_interpreter_requested_too_late_is_reported():
    code = (
        "import os, torch, triton\nos.environ['TRITON_INTERPRET'] = '1'\n"
        "from fp16kit.kernels import select_backend\nprint(select_backend(torch.device('cpu')).reason)\n"
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert "set after triton was imported" in out.stdout


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_info_command_names_the_backend(interpret):
    out = subprocess.run(
        [sys.executable, "-m", "fp16kit", "info"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRITON_INTERPRET": interpret, "FP16KIT_BACKEND": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "backend" in out.stdout and "torch" in out.stdout and "fp16kit" in out.stdout
    expected = "triton interpreter" if interpret == "1" else "torch fallback"
    assert f"backend = {expected}" in out.stdout
