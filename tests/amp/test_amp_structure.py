"""The shape of ``fp16kit.amp`` (issue 10, item 8): no import circle, no borrowed private names.

* Every module of the package imports alone, in an interpreter where nothing of fp16kit was imported before.
* The imports between the package's modules (module level and inside functions) form no cycle: the policy table
  is data with a listener hook (``policy.add_listener``), ``autocast_mode`` is the one mechanism applying it.
* No module imports a ``_private`` name from a sibling module or reads one off it (``policy._NAMES``): siblings
  talk through public names. The package's own private *modules* (``_torch_lists``, ``_bytecode``) are modules
  with one job each and may be imported; a private name inside another module may not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG_DIR = ROOT / "fp16kit" / "amp"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PKG_DIR.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if _is_package(importer) else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every import statement in the module (any depth)."""
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, node.level, node.module)
            out.extend((mod, alias.name, node.lineno) for alias in node.names)
    return out


def _amp_edges(name: str) -> set[str]:
    """The modules of fp16kit.amp that ``name`` imports (``from . import x`` counts as importing ``x``)."""
    edges = set()
    for mod, attr, _line in _imports(name):
        target = f"{mod}.{attr}" if attr is not None and f"{mod}.{attr}" in MODULES else mod
        if target in MODULES and target != name and not _is_package(target):
            edges.add(target)
    return edges


def _private_uses(name: str) -> list[str]:
    """``from .sibling import _x`` and ``sibling._x`` in ``name``, where sibling is another module of the package."""
    problems = []
    bound: dict[str, str] = {}  # local name -> sibling module it is bound to
    for mod, attr, line in _imports(name):
        if mod not in MODULES or attr is None:
            continue
        full = f"{mod}.{attr}"
        if full in MODULES:
            bound[attr] = full  # a module object: its private attributes are checked below
        elif attr.startswith("_") and mod != name:
            problems.append(f"{name}:{line}: from {mod} import {attr}")
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not (node.attr.startswith("__") and node.attr.endswith("__"))
        ):
            problems.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif state[nxt] == 0:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            visit(node, [node])
    return found


def test_the_scan_sees_the_package():
    assert {"fp16kit.amp.policy", "fp16kit.amp.autocast_mode", "fp16kit.amp.functions"} <= set(MODULES)
    assert "fp16kit.amp.policy" in _amp_edges("fp16kit.amp.autocast_mode")
    assert "fp16kit.amp._bytecode" in _amp_edges("fp16kit.amp.autocast_mode")


def test_no_import_cycle_in_amp():
    graph = {name: _amp_edges(name) for name in MODULES if not _is_package(name)}
    assert _cycles(graph) == []


def test_cycle_finder_finds_the_old_circle():
    # the circle issue 10 named: autocast_mode -> policy -> functions (a function-level import) -> autocast_mode
    old = {"autocast_mode": {"policy"}, "policy": {"functions"}, "functions": {"autocast_mode", "policy"}}
    assert _cycles(old) == [
        ["autocast_mode", "policy", "functions", "autocast_mode"],
        ["policy", "functions", "policy"],
    ]


def test_policy_imports_no_mechanism():
    assert _amp_edges("fp16kit.amp.policy") <= {"fp16kit.amp._torch_lists"}


@pytest.mark.parametrize("name", [n for n in MODULES if not _is_package(n)])
def test_no_private_name_from_a_sibling(name: str):
    assert _private_uses(name) == []


def test_private_scan_catches_the_old_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    src = "from . import policy\nfrom .autocast_mode import _active, autocast\npolicy._LISTENERS.append(f)\n"
    monkeypatch.setitem(MODULES, "fp16kit.amp.fake_functions", tmp_path / "fake_functions.py")
    (tmp_path / "fake_functions.py").write_text(src)
    assert _private_uses("fp16kit.amp.fake_functions") == [
        "fp16kit.amp.fake_functions:2: from fp16kit.amp.autocast_mode import _active",
        "fp16kit.amp.fake_functions:3: policy._LISTENERS (fp16kit.amp.policy)",
    ]


_IMPORT_EACH_ALONE = r"""
import importlib, os, sys, traceback
import torch  # the expensive part, once; each module is then imported in a forked child with no fp16kit loaded
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            assert not any(m == "fp16kit" or m.startswith("fp16kit.") for m in sys.modules)
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status != 0:
        failed.append(name)
print("FAILED", failed)
sys.exit(1 if failed else 0)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_each_amp_module_imports_alone():
    names = sorted(MODULES)
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_ALONE, *names],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "FAILED []" in proc.stdout
