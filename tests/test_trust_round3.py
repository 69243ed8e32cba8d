"""Trust, round 3 (issue 22, item 8): the smaller promises. ``scripts/setup-venv.sh`` stops on a failed pip
install and writes no done-stamp; the opt-in native CPU build has its own build directory; ``GradScaler``
returns ``init_scale`` as given before the first ``scale()``, as torch does."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from fp16kit.amp import GradScaler
from fp16kit.kernels.fallback import lamb_native as cpu_native

ROOT = Path(__file__).resolve().parents[1]

# A stand-in for the venv's python: "import torch" works, the torch version check passes, pip prints a line and
# exits with $FAKE_PIP_STATUS.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "ERROR: pretend pip output"; echo "WARNING: some option is ignored"
  exit "${FAKE_PIP_STATUS:-0}"
fi
exit 0
"""


def _run_setup(tmp_path: Path, pip_status: int) -> tuple[subprocess.CompletedProcess, list[Path]]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "FP16KIT_VENV": str(venv), "FAKE_PIP_STATUS": str(pip_status)}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup-venv.sh"), "testing"], env=env, capture_output=True, text=True,
        timeout=60,
    )
    return out, list(venv.glob(".fp16kit-installed-*"))


def test_setup_venv_stops_on_a_failed_pip_install_without_the_stamp(tmp_path):
    out, stamps = _run_setup(tmp_path, pip_status=1)
    assert out.returncode == 1, out
    assert not stamps, "a failed install must not be marked done"
    assert "pretend pip output" in out.stdout and "is ignored" not in out.stdout  # the filter still filters


def test_setup_venv_writes_the_stamp_after_a_good_install(tmp_path):
    out, stamps = _run_setup(tmp_path, pip_status=0)
    assert out.returncode == 0, out
    assert len(stamps) == 1


def test_native_cpu_build_uses_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen = {}

    def fake_load_inline(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", fake_load_inline)
    monkeypatch.setitem(cpu_native._build, "error", None)
    cpu_native._compile()
    cpu_native._build["error"] = None
    build = Path(seen["build_directory"])
    assert build.is_dir() and build.parent == tmp_path / "fp16kit" and build.name == cpu_native.build_name()


@pytest.mark.parametrize("init_scale", [1e38, 3.0e-5, 65536.0, 0.1])
def test_get_scale_before_the_first_scale_is_init_scale_as_given(init_scale):
    ours, theirs = GradScaler(init_scale=init_scale), torch.amp.GradScaler("cpu", init_scale=init_scale)
    assert ours.get_scale() == theirs.get_scale() == init_scale
    assert ours.state_dict()["scale"] == theirs.state_dict()["scale"]
    ours.scale(torch.ones(()))
    theirs.scale(torch.ones(()))
    assert ours.get_scale() == theirs.get_scale()  # then both hold the float32 device scale


def test_every_test_docs_guarantees_names_exists():
    """Every promise names the test that proves it: each ``tests/<file>.py::<test>`` in docs/guarantees.md is a
    test function of that file (a renamed or deleted test would leave a promise unproven)."""
    import re

    text = (ROOT / "docs" / "guarantees.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"(tests/[\w/]+\.py)::(test_\w+)", text))
    assert len(cited) > 50
    missing = [
        f"{path}::{name}" for path, name in sorted(cited)
        if not (ROOT / path).is_file() or f"def {name}(" not in (ROOT / path).read_text(encoding="utf-8")
    ]
    assert not missing, missing
