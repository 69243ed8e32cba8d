"""scripts/mutation.py on a tiny synthetic package: mutants are generated, applied to a private copy, judged
(killed, survived, timeout), stored and resumed, and the checkout is never modified."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("mutation_script", Path(__file__).parents[1] / "scripts" / "mutation.py")
mutation = importlib.util.module_from_spec(_SPEC)
sys.modules["mutation_script"] = mutation  # dataclasses resolve the module by name
_SPEC.loader.exec_module(mutation)

MODULE = '''"""A module docstring: never mutated."""


def add(a, b):
    """The sum: never mutated (docstring)."""
    if a < 0:
        raise ValueError(f"negative {a + 1}")  # the message: never mutated
    return a + b


def halve(n):
    while n > 0:
        n = n // 2
    return n
'''

TESTS = '''from tinypkg.mod import add, halve


def test_add():
    assert add(2, 3) == 5


def test_halve():
    assert halve(5) == 0
'''


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "tinypkg").mkdir(parents=True)
    (root / "tinypkg" / "__init__.py").write_text("")
    (root / "tinypkg" / "mod.py").write_text(MODULE)
    (root / "tests").mkdir()
    (root / "tests" / "test_mod.py").write_text(TESTS)
    return root


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()


def test_generation_skips_docstrings_messages_and_strings(tmp_path):
    root = _checkout(tmp_path)
    ms = mutation.generate("t", "tinypkg/mod.py", ("add", "halve"), root)
    ops = {(m.function, m.original.strip(), m.operator) for m in ms}
    assert ("add", "a < 0", "cmp_boundary_Lt") in ops and ("add", "a < 0", "cmp_negate_Lt") in ops
    assert ("add", "a + b", "binop_Add") in ops and ("halve", "n // 2", "binop_FloorDiv") in ops
    assert ("add", "return a + b", "return_none") in ops
    assert not [m for m in ms if "ValueError" in m.original or "negative" in m.original or '"""' in m.original]
    assert len({m.id for m in ms}) == len(ms)  # deterministic, unique ids file:line:col:operator
    assert [m.id for m in ms] == [m.id for m in mutation.generate("t", "tinypkg/mod.py", ("add", "halve"), root)]
    m = next(m for m in ms if m.operator == "binop_Add")
    assert m.id == "tinypkg/mod.py:8:11:binop_Add"
    assert "return (a - b)" in mutation.apply(m, MODULE)


def test_run_kills_reports_survivors_resumes_and_leaves_the_checkout_alone(tmp_path, capsys):
    root = _checkout(tmp_path)
    before = _digest(root)
    out = tmp_path / "out"
    args = ["--only", "tinypkg/mod.py:add@tests/test_mod.py::test_add", "--only",
            "tinypkg/mod.py:halve@tests/test_mod.py::test_halve",
            "--root", str(root), "--out", str(out), "--min-timeout", "3", "-j", "2", "--ids",
            *(f"tinypkg/mod.py:{i}" for i in ("8:11:binop_Add", "6:7:cmp_boundary_Lt", "12:10:cmp_boundary_Gt"))]
    assert mutation.main(args) == 0
    assert _digest(root) == before  # every mutant lived in a private copy
    stored = json.loads((out / "results.json").read_text())["mutants"]
    by_op = {(r["function"], r["operator"]): r for r in stored.values()}
    assert by_op["add", "binop_Add"]["status"] == "killed"
    assert len(stored) == 3  # --ids: only those
    assert by_op["add", "cmp_boundary_Lt"]["status"] == "survived"  # a < 0 vs a <= 0: no test has a == 0
    assert by_op["halve", "cmp_boundary_Gt"]["how"] == "timeout"  # n >= 0 never ends: a timeout kills
    assert by_op["halve", "cmp_boundary_Gt"]["status"] == "killed"
    table = capsys.readouterr().out
    assert "tinypkg/mod.py:6:7:cmp_boundary_Lt" in table and "**survived**" in table
    # an explanation turns a survivor into an equivalent mutant; a re-run resumes (runs nothing new)
    lt = by_op["add", "cmp_boundary_Lt"]
    (out / "equivalent.json").write_text(json.dumps([{"key": mutation._key(lt), "id": lt["id"], "why": "no a == 0"}]))
    assert mutation.main(args) == 0
    table = capsys.readouterr().out
    assert "0 mutants to run" in table and "equivalent: no a == 0" in table and "100.0%" in table
    assert _digest(root) == before


def test_a_mutant_that_is_not_python_fails_loudly(tmp_path):
    root = _checkout(tmp_path)
    m = mutation.generate("t", "tinypkg/mod.py", ("add",), root)[0]
    m.replacement = "(a +"
    with pytest.raises(SyntaxError):
        mutation.apply(m, MODULE)
