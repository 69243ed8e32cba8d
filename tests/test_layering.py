"""Layering: ``fp16kit.optim`` and ``fp16kit.amp`` reach the kernels only through the package ``fp16kit.kernels``.

Issue 10 (item 3): ``optim/`` imported ``kernels._checks``, ``kernels._table``, the launchers and the fallbacks, and
rebuilt the planner. Every module under ``fp16kit/optim`` and ``fp16kit/amp`` (and the apex shims ``amp_C.py``,
``multi_tensor_apply.py``) is parsed here; any import of a kernels submodule other than the public ones fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fp16kit

ROOT = Path(fp16kit.__file__).parent
#: Submodules of fp16kit.kernels that other layers may import (the package's public faces).
PUBLIC_SUBMODULES = {"ops", "optimizers", "found_inf", "histogram", "library"}


def _modules() -> list[Path]:
    files = sorted((ROOT / "optim").rglob("*.py")) + sorted((ROOT / "amp").rglob("*.py"))
    return [*files, ROOT / "amp_C.py", ROOT / "multi_tensor_apply.py"]


def _kernel_imports(source: str, package: str) -> list[tuple[int, str]]:
    """``(line, dotted target)`` of every import in ``source`` (a module of ``package``) that reaches into
    ``fp16kit.kernels``, absolute or relative."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("fp16kit.kernels")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "fp16kit.kernels":
                found += [(node.lineno, f"{module}.{a.name}") for a in node.names]
            elif module.startswith("fp16kit.kernels."):
                found.append((node.lineno, module))
    return found


def _violation(target: str) -> bool:
    """A kernels submodule that is private (``_table``), a launcher (``*_kernel``), a fallback or the backend
    machinery; names imported from the package itself are fine unless they are such a submodule."""
    import importlib

    parts = target.split(".")
    if len(parts) < 3:
        return False
    name = parts[2]
    if len(parts) == 3:  # from fp16kit.kernels import <name>: a function, or a submodule imported by name
        obj = getattr(importlib.import_module("fp16kit.kernels"), name, None)
        is_module = obj is None or type(obj).__name__ == "module"
        if not is_module:
            return False
    return name not in PUBLIC_SUBMODULES


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_public_kernel_imports(path):
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    bad = [(line, target) for line, target in _kernel_imports(path.read_text(), package) if _violation(target)]
    assert not bad, f"{path.relative_to(ROOT)} imports kernel internals: {bad}; use names from fp16kit.kernels"


def test_the_check_catches_private_imports():
    """Not vacuous: the imports issue 10 found are reported, public names are not."""
    bad = [
        "from fp16kit.kernels._checks import common_device",
        "from fp16kit.kernels import cpu_native as _cpu_native",
        "from fp16kit.kernels import optim_fallback",
        "from ..kernels.lamb_kernel import launch_lamb",
        "from ..kernels import _table",
        "import fp16kit.kernels.backend",
    ]
    for source in bad:
        assert any(_violation(t) for _, t in _kernel_imports(source, "fp16kit.optim")), source
    good = "from fp16kit.kernels import l2norm, lamb_update\nfrom ...kernels import copy_\n"
    assert _kernel_imports(good, "fp16kit.amp._frontend")
    assert not any(_violation(t) for _, t in _kernel_imports(good, "fp16kit.amp._frontend"))
