"""apex's own L0 tests as an acceptance suite for fp16kit (never committed here: point at an apex checkout).

    FP16KIT_APEX_TESTS=/path/to/apex  PYTHONPATH=$PWD  python -m pytest -q tests/apex_suite -p no:cacheprovider

``/path/to/apex`` holds ``tests/L0/run_amp`` and ``tests/L0/run_optimizers`` (an apex clone at commit
e13873debc4699d39c6861074b9a3b2a02327f92, the last one with ``apex/amp``; see docs/migrating-from-apex.md
for the extraction commands and the recorded results). Without the variable only this plugin's own checks
run (tests/apex_suite/test_cuda_mapping.py).

What this conftest does when the variable is set:

* collects ``run_amp`` and ``run_optimizers`` from the checkout under this directory's node, with their own
  directories on ``sys.path`` (apex runs them from there: ``from utils import ...``);
* installs the import aliases (``fp16kit.compat.install_apex``): ``apex``, ``amp_C``, ``apex_C``;
* maps CUDA to the CPU (``cuda_mapping.py``) while those tests are imported and run;
* stands in for ``expecttest`` when it is not installed (torch's internal test helpers import it);
* runs fp16kit's kernels with the torch fallback (``FP16KIT_APEX_BACKEND`` picks another, e.g. ``auto``);
* ``FP16KIT_APEX_FILES=test_adam.py,test_lamb.py`` restricts the run to those files.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
import unittest
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from cuda_mapping import cuda_on_cpu, patch_cuda_module  # noqa: E402

ROOT_ENV = "FP16KIT_APEX_TESTS"
SUITES = ("run_amp", "run_optimizers")


def _suite_dirs() -> list[Path]:
    root = os.environ.get(ROOT_ENV)
    if not root:
        return []
    base = Path(root).expanduser().resolve()
    dirs = [base / "tests" / "L0" / s for s in SUITES]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise pytest.UsageError(f"{ROOT_ENV}={root}: expected apex's test folders {', '.join(missing)}. Point it at "
                                "an apex checkout (commit e13873de..., see docs/migrating-from-apex.md).")
    return dirs


_APEX_DIRS = _suite_dirs()
_unpatch = None


def pytest_configure(config: pytest.Config) -> None:
    global _unpatch
    if not _APEX_DIRS:
        return
    from fp16kit.compat import install_apex

    install_apex()
    _unpatch = patch_cuda_module()
    if importlib.util.find_spec("expecttest") is None:
        # torch.testing._internal (imported by apex's test_adam.py) needs it only to define its TestCase base
        sys.modules["expecttest"] = types.SimpleNamespace(TestCase=unittest.TestCase)  # type: ignore[assignment]
    for d in _APEX_DIRS:
        sys.path.insert(0, str(d))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _unpatch is not None:
        _unpatch()


class _ApexModule(pytest.Module):
    """An apex test module, imported with CUDA mapped to the CPU (its module-level code runs at import)."""

    def _getobj(self):  # type: ignore[no-untyped-def]
        with cuda_on_cpu():
            return super()._getobj()


class _ApexSuite(pytest.File):
    """apex's test files, collected as modules below this conftest's node (they live outside the repo);
    ``FP16KIT_APEX_FILES=test_adam.py,test_lamb.py`` restricts the run to those files."""

    def collect(self):  # type: ignore[override]
        only = [n for n in os.environ.get("FP16KIT_APEX_FILES", "").split(",") if n]
        for d in _APEX_DIRS:
            for path in sorted(d.glob("test_*.py")):
                if not only or path.name in only:
                    yield _ApexModule.from_parent(self, path=path)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if _APEX_DIRS and file_path == HERE / "conftest.py":
        return _ApexSuite.from_parent(parent, path=file_path)
    return None


#: apex tests sized for a GPU: each makes hundreds of calls over lists of up to 5 * 10^7 elements (1 to 15+ minutes
#: each on a shared CPU). Skipped unless FP16KIT_APEX_ALL=1; tests/apex_compat/test_amp_C.py covers the same ops.
GPU_SIZED = {
    ("test_multi_tensor_scale.py", "test_fuzz"),
    ("test_multi_tensor_axpby.py", "test_fuzz"),
    ("test_multi_tensor_axpby.py", "test_fuzz_nhwc"),
    ("test_multi_tensor_l2norm.py", "test_fuzz"),
    ("test_multi_tensor_unscale_l2norm.py", "test_fuzz"),
}


def _is_apex(item: pytest.Item) -> bool:
    return any(Path(str(item.path)).is_relative_to(d) for d in _APEX_DIRS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _APEX_DIRS or os.environ.get("FP16KIT_APEX_ALL") == "1":
        return
    skip = pytest.mark.skip(reason="GPU-sized fuzz test (lists of up to 5e7 elements, hundreds of calls: minutes on a "
                                   "CPU); FP16KIT_APEX_ALL=1 runs it")
    for item in items:
        if _is_apex(item) and (Path(str(item.path)).name, item.name) in GPU_SIZED:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _apex_on_cpu(request: pytest.FixtureRequest):
    """apex's tests run with CUDA mapped to the CPU and fp16kit's torch fallback (FP16KIT_APEX_BACKEND)."""
    if not _is_apex(request.node):
        yield
        return
    import torch.backends

    from fp16kit.kernels import use_backend

    # torch's internal test helpers (imported by apex's test_adam.py) freeze torch.backends flags for the whole
    # process; apex runs each folder in its own process, where test_checkpointing may still set cudnn flags
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    with use_backend(os.environ.get("FP16KIT_APEX_BACKEND", "torch")), cuda_on_cpu():
        yield
