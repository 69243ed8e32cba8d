"""Layering: ``fp16kit.optim`` and ``fp16kit.amp`` reach the kernels only through the package ``fp16kit.kernels``.

Issue 10 (item 3): ``optim/`` imported ``kernels._checks``, ``kernels._table``, the launchers and the fallbacks, and
rebuilt the planner. Every module under ``fp16kit/optim`` and ``fp16kit/amp`` (and the apex shims ``amp_C.py``,
``multi_tensor_apply.py``) is parsed here; any import of a kernels submodule other than the public ones fails.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import fp16kit

ROOT = Path(fp16kit.__file__).parent
#: Submodules of fp16kit.kernels that other layers may import (the package's public faces).
PUBLIC_SUBMODULES = {"ops", "optimizers", "found_inf", "histogram", "library"}


def _modules() -> list[Path]:
    files = sorted((ROOT / "optim").rglob("*.py")) + sorted((ROOT / "amp").rglob("*.py"))
    return [*files, ROOT / "amp_C.py", ROOT / "multi_tensor_apply.py"]


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module ``from <dots><module> import ...`` names, written in a module of ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _kernel_imports(source: str, package: str) -> list[tuple[int, str]]:
    """``(line, dotted target)`` of every import in ``source`` (a module of ``package``) that reaches into
    ``fp16kit.kernels``, absolute or relative."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("fp16kit.kernels")]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
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
        "from fp16kit.kernels.engine.checks import common_device",
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


# --- The import directions of the whole package -------------------------------------------------------------------
#
# Every module of fp16kit belongs to a room: a folder (``fp16kit/optim``), one of the kernels' folders
# (``kernels.engine``, ``kernels.triton``, ...; ``kernels`` is its public modules, ``kernels.backend`` the backend
# choice, which the engine reads), a top-level module (``amp_C``), or an entry point (``__main__``, ``doctor.cli``:
# the command lines, which may run the demo). ALLOWED is every room's list of rooms it may import (imports at any
# depth: module level and inside functions; an import under ``if TYPE_CHECKING:`` is never executed and is left
# out). The table has no cycle, and neither do the modules themselves.

PACKAGE = "fp16kit"
_KERNEL_ROOMS = {"engine", "triton", "fallback", "state8", "bf16_weights"}
_ENTRY_POINTS = {"fp16kit.__main__": "__main__", "fp16kit.doctor.cli": "doctor.cli"}

ALLOWED: dict[str, set[str]] = {
    "__main__": {"_info", "compat", "demo", "doctor", "doctor.cli"},
    "doctor.cli": {"demo", "doctor", "amp", "kernels", "numerics"},
    "demo": {"amp", "doctor", "optim", "kernels", "numerics", "_versions", "fp16kit"},
    "compat": {"amp", "amp_C", "fp16_utils", "multi_tensor_apply", "parallel", "optim", "_versions"},
    "integrations": {"amp", "optim", "_versions", "_lazy"},
    "doctor": {"amp", "kernels", "numerics", "_versions"},
    "fp16_utils": {"amp", "kernels", "_versions"},
    "amp": {"kernels", "optim", "amp_C", "distributed", "numerics", "_versions", "_lazy"},
    "amp_C": {"kernels", "optim", "multi_tensor_apply"},
    "multi_tensor_apply": {"kernels"},
    "optim": {"kernels", "distributed", "numerics", "_versions", "_lazy"},
    "parallel": {"distributed", "optim", "_versions", "_lazy"},  # optim: LARC, by name on first use
    "distributed": {"_versions", "_lazy"},
    "_info": {"fp16kit", "kernels", "kernels.backend", "_versions"},
    "kernels": {"kernels.engine", "kernels.triton", "kernels.fallback", "kernels.state8", "kernels.bf16_weights",
                "kernels.backend", "_versions"},
    "kernels.triton": {"kernels.engine", "kernels.state8", "kernels.bf16_weights", "_versions"},
    "kernels.state8": {"kernels.engine", "kernels.fallback"},
    "kernels.bf16_weights": {"kernels.engine", "kernels.fallback"},
    "kernels.fallback": {"kernels.engine"},
    "kernels.engine": {"kernels.backend", "_versions"},
    "kernels.backend": set(),
    "numerics": set(),
    "fp16kit": {"_versions", "_lazy"},
    "_lazy": set(),
    "_versions": set(),
}

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines of the statements under ``if TYPE_CHECKING:`` (type-only imports, never run)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def module_imports(name: str) -> set[str]:
    """The fp16kit modules ``name`` imports, at any depth (``from . import x`` imports ``x``); its own ancestor
    packages are left out (Python has them half-initialized already when the module runs)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, package)
            for a in node.names:
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module)
    return {m for m in found if m in MODULES and m != name and not name.startswith(m + ".")}


def room(module: str) -> str:
    if module in _ENTRY_POINTS:
        return _ENTRY_POINTS[module]
    parts = module.split(".")
    if len(parts) == 1:
        return PACKAGE
    if parts[1] == "kernels" and len(parts) > 2 and (parts[2] in _KERNEL_ROOMS or parts[2] == "backend"):
        return f"kernels.{parts[2]}"
    return parts[1]


@functools.cache
def _edges() -> dict[str, set[str]]:
    return {m: module_imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_every_room_is_in_the_table():
    assert {room(m) for m in MODULES} <= set(ALLOWED), {room(m) for m in MODULES} - set(ALLOWED)


def test_imports_follow_the_table():
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in _edges().items()
        for t in targets
        if room(m) != room(t) and room(t) not in ALLOWED[room(m)]
    )
    assert not bad, "imports against the directions of tests/test_layering.py's ALLOWED table:\n" + "\n".join(bad)


def test_the_table_has_no_cycle():
    assert not _cycles(ALLOWED), _cycles(ALLOWED)


def test_no_import_circles():
    assert not _cycles(_edges()), f"import circles: {_cycles(_edges())}"


def test_the_checks_catch_a_circle_and_a_wrong_direction():
    """Not vacuous: a two-module circle and a three-room one are found; an engine module importing a twin is a
    wrong direction."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [{"x", "y", "z"}]
    assert room("fp16kit.kernels.engine.plan") == "kernels.engine"
    assert room("fp16kit.kernels.fallback.adam") not in ALLOWED["kernels.engine"]
    assert room("fp16kit.kernels.triton.adam") not in ALLOWED["kernels.fallback"]
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import os\nimport sys\n"
    assert _type_checking_lines(ast.parse(src)) == {3}


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_every_folder_says_what_it_holds_and_may_import(package):
    doc = ast.get_docstring(ast.parse(MODULES[package].read_text(encoding="utf-8"))) or ""
    assert len(doc) > 80 and "May import:" in doc, f"{package}: say what the folder holds, then 'May import: ...'"
