"""The supported torch/Triton range and every version branch of ``fp16kit/_versions.py`` (docs/compat.md).

Each branch is tested on the installed pair where it can run, and with a stand-in (a version string, a fake
interpreter module) for the other side, so both ends of the range (``scripts/test-compat.sh``) run every test.
"""

from __future__ import annotations

import re
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fp16kit import _versions
from fp16kit.numerics.assertions import assert_bitwise_equal

ROOT = Path(__file__).resolve().parents[1]


def _pyproject_bound(dist: str) -> tuple[tuple[int, int], tuple[int, int]]:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"{dist}>=(\d+)\.(\d+),<(\d+)\.(\d+)[;"]', text)
    assert m is not None, f"pyproject.toml has no {dist}>=a.b,<c.d requirement"
    a, b, c, d = map(int, m.groups())
    return (a, b), (c, d)


@pytest.mark.parametrize("dist", ["torch", "triton"])
def test_pyproject_requires_exactly_the_tested_range(dist):
    assert _pyproject_bound(dist) == _versions._RANGES[dist]


def test_compat_doc_names_the_range_and_the_script():
    doc = (ROOT / "docs" / "compat.md").read_text()
    for dist, (lo, hi) in _versions._RANGES.items():
        assert f"{dist}>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}" in doc
    assert "scripts/test-compat.sh" in doc


def test_the_suite_runs_on_a_supported_pair():
    # otherwise the suite proves nothing about the range
    assert _versions.version_problem("torch") is None
    assert _versions.version_problem("triton") is None


@pytest.mark.parametrize(
    "version,parsed",
    [("2.11.0+cu130", (2, 11)), ("2.13.0", (2, 13)), ("3.6.0", (3, 6)), ("2.14.0.dev20261101", (2, 14)), ("x", None)],
)
def test_parse(version, parsed):
    assert _versions.parse(version) == parsed


@pytest.mark.parametrize(
    "dist,version,ok",
    [
        ("torch", "2.11.0+cu130", True),
        ("torch", "2.13.0+cpu", True),
        ("torch", "2.10.1", False),
        ("torch", "2.14.0", False),
        ("triton", "3.6.0", True),
        ("triton", "3.9.0", True),
        ("triton", "3.5.1", False),
        ("triton", "3.10.0", False),
    ],
)
def test_version_problem_names_the_version_and_the_range(dist, version, ok):
    problem = _versions.version_problem(dist, version)
    if ok:
        assert problem is None
    else:
        assert version in problem and _versions._range_text(dist) in problem


def test_an_absent_triton_is_no_problem(monkeypatch):
    monkeypatch.setattr(_versions, "installed_version", lambda dist: None)
    assert _versions.version_problem("triton") is None


def test_check_installed_warns_once_naming_both_versions_and_the_fix(monkeypatch):
    monkeypatch.setattr(_versions, "WARNED", {})
    fake = {"torch": "2.10.0+cu128", "triton": "3.4.0"}
    monkeypatch.setattr(_versions, "installed_version", fake.get)
    with pytest.warns(_versions.UnsupportedVersionWarning) as caught:
        _versions.check_installed()
    assert len(caught) == 1
    message = str(caught[0].message)
    for text in ("torch 2.10.0+cu128", "triton 3.4.0", "pip install 'torch>=2.11,<2.14' 'triton>=3.6,<3.10'"):
        assert text in message
    assert fake == _versions.WARNED


def test_check_installed_is_silent_in_range(monkeypatch):
    monkeypatch.setattr(_versions, "WARNED", {})
    monkeypatch.setattr(_versions, "installed_version", {"torch": "2.11.0", "triton": "3.6.0"}.get)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _versions.check_installed()


# Importing fp16kit (amp, kernels, optim) on an out-of-range torch gives exactly one warning:
# tests/amp/test_bytecode.py::test_autocast_imports_and_works_on_an_unsupported_torch.


# -- Triton: the interpreter's __index__ ----------------------------------------------------------------------


def _fake_interpreter(index):
    """A stand-in for ``triton.runtime.interpreter`` whose tensor patch installs ``index`` as ``__index__``."""

    class Scope:
        def __init__(self):
            self.changes = []

        def set_attr(self, obj, name, value):
            self.changes.append((obj, name, obj.__dict__.get(name)))
            setattr(obj, name, value)

        def restore(self):
            while self.changes:
                obj, name, old = self.changes.pop()
                if old is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)

    def _patch_lang_tensor(tensor, scope):
        scope.set_attr(tensor, "__index__", index)

    return types.SimpleNamespace(_LangPatchScope=Scope, _patch_lang_tensor=_patch_lang_tensor)


def _index_of_one_element_array(interp) -> int:
    class T:
        pass

    t = T()
    t.handle = types.SimpleNamespace(data=np.array([5], dtype=np.int32))
    scope = interp._LangPatchScope()
    interp._patch_lang_tensor(T, scope)
    try:
        return T.__index__(t)
    finally:
        scope.restore()


def _triton_36_index(self):
    data = self.handle.data
    if data.ndim:  # what NumPy >= 2.4 does for int() of a (1,)-shaped array
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
    return int(data)


def test_an_interpreter_with_triton_36s_index_is_patched():
    interp = _fake_interpreter(_triton_36_index)
    with pytest.raises(TypeError):
        _index_of_one_element_array(interp)
    assert _versions.patch_triton_interpreter(interp)
    assert _index_of_one_element_array(interp) == 5
    assert _versions.patch_triton_interpreter(interp)  # idempotent: patched once


def test_an_interpreter_that_converts_itself_is_left_alone():
    interp = _fake_interpreter(lambda self: int(self.handle.data.squeeze()))
    patch = interp._patch_lang_tensor
    assert not _versions.patch_triton_interpreter(interp)
    assert interp._patch_lang_tensor is patch


@pytest.mark.interpreter
def test_interpreted_kernels_loop_over_programs_on_this_triton():
    """The construct that failed on Triton 3.6 + NumPy 2.4: ``range(pid, n, tl.num_programs(0))``."""
    import triton
    import triton.language as tl

    import fp16kit.kernels.engine.chunks  # noqa: F401  (every kernel module imports it: it applies the patch)

    @triton.jit
    def strided_copy(src, dst, n):
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            tl.store(dst + i, tl.load(src + i))

    src, dst = torch.arange(7, dtype=torch.float32), torch.zeros(7)
    strided_copy[(3,)](src, dst, 7)
    assert_bitwise_equal(dst, src)


# -- torch: Dynamo's id(), and what depends on it -------------------------------------------------------------


@pytest.mark.parametrize("version,traces", [("2.11.0+cu130", False), ("2.12.1", False), ("2.13.0+cpu", True)])
def test_dynamo_traces_any_id_by_version(version, traces):
    assert _versions.dynamo_traces_any_id(version) is traces


@pytest.mark.usefixtures("mode_engine")
def test_autocast_pushes_the_mode_this_torch_needs():
    from fp16kit.amp import autocast_mode as M

    want = M._AutocastMode if _versions.dynamo_traces_any_id() else M._AutocastModeByFn
    assert M._MODE_CLASS is want
    with M.autocast(dtype=torch.bfloat16):
        assert type(M.active_mode()) is want


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)  # LOW
        return h, torch.softmax(h, -1), (h * 2).exp(), h + x  # FP32; FP32 via a sourceless Tensor method; PROMOTE


@pytest.mark.parametrize("mode_class", ["_AutocastMode", "_AutocastModeByFn"])
def test_both_autocast_modes_compile_to_eagers_dtypes_and_bits(monkeypatch, mode_class):
    """Each mode class, whichever this torch uses, traced with fullgraph=True equals eager."""
    from fp16kit.amp import autocast_mode as M

    if mode_class == "_AutocastMode" and not _versions.dynamo_traces_any_id():
        pytest.skip("this torch's Dynamo cannot trace id() of a torch function")
    monkeypatch.setattr(M, "_MODE_CLASS", getattr(M, mode_class))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _Small(), torch.randn(4, 8)
    with M.autocast(dtype=torch.bfloat16):
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert [t.dtype for t in eager] == [torch.bfloat16, torch.float32, torch.float32, torch.float32]
    for c, e in zip(compiled, eager):
        assert_bitwise_equal(c, e)
    torch._dynamo.reset()


def test_compiled_optimizer_step_equals_eager_on_this_torch():
    """Every supported torch traces the step (no id() of a param group while compiling: fp16kit/optim/_base.py)."""
    from fp16kit.optim import FusedAdam
    from fp16kit.optim._base import FusedOptimizer

    assert not getattr(FusedOptimizer.step, "_torchdynamo_disable", False)
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(n)) for n in (5, 9)]
        opt = FusedAdam(params, lr=1e-2, weight_decay=0.01)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            step()
        results.append([p.detach().clone() for p in params])
    for c, e in zip(*results):
        assert_bitwise_equal(c, e)
    torch._dynamo.reset()


def test_ddp_sync_buffers_arg_is_a_ddp_argument():
    import inspect

    arg = _versions.ddp_sync_buffers_arg()
    assert arg in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters


def test_dtensor_class_is_torchs():
    from torch.distributed.tensor import DTensor

    assert _versions.dtensor_class() is DTensor


@pytest.mark.parametrize("version,keyed", [("2.11.0+cu130", False), ("2.12.1", False), ("2.13.0+cpu", True)])
def test_inductor_cache_keys_autocast_dtype_by_version(version, keyed):
    assert _versions.inductor_cache_keys_autocast_dtype(version) is keyed


@pytest.mark.slow
def test_inductor_cache_keys_autocast_dtype_on_this_torch(monkeypatch, tmp_path):
    """The branch against the installed torch: plain ``torch.autocast``, one model compiled under fp16 and then,
    after ``torch._dynamo.reset()``, under bf16, with Inductor's caches on (a fresh cache folder): the bf16 run gets
    a bf16 graph exactly where the branch says the caches key the dtype (slow: two Inductor builds)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", True)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 16), nn.Softplus(), nn.Linear(16, 8)), torch.randn(4, 16)
    dtypes = []
    for low in (torch.float16, torch.bfloat16):
        torch._dynamo.reset()
        with torch.no_grad(), torch.autocast("cpu", dtype=low):
            dtypes.append(torch.compile(model)(x).dtype)
    torch._dynamo.reset()
    assert dtypes[0] == torch.float16
    assert (dtypes[1] == torch.bfloat16) is _versions.inductor_cache_keys_autocast_dtype()
