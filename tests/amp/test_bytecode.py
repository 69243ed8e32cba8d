"""The bytecode tooling behind autocast (``fp16kit.amp._bytecode``) and its torch-version check.

On a torch outside ``SUPPORTED_TORCH`` the pass-through copies of torch's Python composites are not made: one
``UnsupportedTorchWarning`` says so and what it changes, and autocast keeps applying every row of the table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fp16kit.amp import _bytecode
from fp16kit.amp import policy as P

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "2.13.0a0+git1234abc", "2.12.1"])
def test_supported_versions(version: str):
    assert _bytecode.torch_version_problem(version) is None


@pytest.mark.parametrize(
    "version", ["2.3.1", "2.10.1+cu126", "1.13.0", "2.14.0", "2.14.0.dev20261101", "3.0.0", "nightly"]
)
def test_unsupported_versions_are_named(version: str):
    problem = _bytecode.torch_version_problem(version)
    assert problem is not None and version in problem


def test_installed_torch_is_supported():
    # the suite's torch must be one the tooling was checked against, or the tests below prove nothing
    assert _bytecode.torch_version_problem() is None and _bytecode.enabled()


def test_unsupported_torch_disables_with_one_clear_warning(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FP16KIT_AMP_BYTECODE", raising=False)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.warns(_bytecode.UnsupportedTorchWarning, match=r"torch 2\.99\.0 is outside.*FP16KIT_AMP_BYTECODE"):
        copies = _bytecode.passthrough_copies(P.overridable())
    assert copies == {}


def test_missing_torch_function_hook_disables(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delattr(torch.overrides, "has_torch_function_variadic")
    assert "has_torch_function_variadic" in (_bytecode.torch_version_problem() or "")


def test_environment_forces_or_disables(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setenv("FP16KIT_AMP_BYTECODE", "force")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _bytecode.enabled()
        assert F.multi_head_attention_forward in _bytecode.passthrough_copies(P.overridable())
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    monkeypatch.setenv("FP16KIT_AMP_BYTECODE", "off")
    assert not _bytecode.enabled() and _bytecode.passthrough_copies(P.overridable()) == {}


def test_copies_on_a_supported_torch():
    copies = _bytecode.passthrough_copies([F.multi_head_attention_forward, F.relu, torch.exp, torch.Tensor.unflatten])
    assert set(copies) <= {F.multi_head_attention_forward, F.relu}
    assert F.multi_head_attention_forward in copies
    names, binop = _bytecode.reach(F.multi_head_attention_forward)
    assert "linear" in names and binop
    assert _bytecode.super_redirects().get("unflatten") is torch.unflatten


_UNSUPPORTED_RUN = r"""
import warnings
import torch
torch.__version__ = "2.3.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import fp16kit.amp.autocast_mode as M
    import fp16kit.kernels, fp16kit.optim  # noqa: E401
import torch.nn.functional as F
from fp16kit.amp import _bytecode, autocast
# one warning, at import of fp16kit (fp16kit/_versions.py), naming the version and the fix
assert [w.category for w in caught] == [_bytecode.UnsupportedTorchWarning], caught
assert "torch 2.3.0 is outside" in str(caught[0].message) and "pip install" in str(caught[0].message)
assert id(F.multi_head_attention_forward) not in M._DISPATCH
x, w = torch.randn(2, 4), torch.randn(3, 4)
with autocast(dtype=torch.bfloat16):
    assert F.linear(x, w).dtype == torch.bfloat16  # table rows still apply
    assert torch.softmax(x.bfloat16(), -1).dtype == torch.float32
print("OK")
"""


def test_autocast_imports_and_works_on_an_unsupported_torch():
    env = {k: v for k, v in os.environ.items() if k != "FP16KIT_AMP_BYTECODE"}
    proc = subprocess.run(
        [sys.executable, "-c", _UNSUPPORTED_RUN],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
