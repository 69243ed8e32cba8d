"""Every Markdown file a docstring or comment of the package cites exists in the repository.

Citations are written relative to the repository root (``docs/specs/lamb.md``). A bare ``lamb.md`` or a
``specs/lamb.md`` pointed at files the repository did not ship (issue 10), so any ``*.md`` mention that is not
a ``docs/`` path fails here too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fp16kit"
_MD = re.compile(r"(?<![\w/.-])([\w./-]+\.md)\b")


def _citations() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            out.extend((str(path.relative_to(ROOT)), lineno, m.group(1)) for m in _MD.finditer(line))
    return out


CITATIONS = _citations()


def test_the_package_cites_docs():
    assert len(CITATIONS) >= 20, "the citation scan found too little: is the regex broken?"
    assert any(c[2] == "docs/specs/cast-policy.md" for c in CITATIONS)


@pytest.mark.parametrize("where, lineno, cited", CITATIONS, ids=[f"{w}:{n}" for w, n, _ in CITATIONS])
def test_cited_markdown_exists(where: str, lineno: int, cited: str) -> None:
    assert cited.startswith(("docs/", "benchmarks/")), (
        f"{where}:{lineno} cites {cited!r}: write the path from the repo root (docs/... or benchmarks/...)"
    )
    assert (ROOT / cited).is_file(), f"{where}:{lineno} cites {cited}, which is not in the repository"


def test_the_scan_catches_bare_and_missing_names(tmp_path: Path) -> None:
    line = "see cast-policy.md and specs/lamb.md and docs/specs/kernels.md and docs/nope.md"
    assert [m.group(1) for m in _MD.finditer(line)] == [
        "cast-policy.md",
        "specs/lamb.md",
        "docs/specs/kernels.md",
        "docs/nope.md",
    ]
    assert not (ROOT / "docs/nope.md").exists()


# ---------------------------------------------------------------------------------------------------------------
# docs/guarantees.md: every promise names its tests, and every test it names exists

GUARANTEES = ROOT / "docs" / "guarantees.md"
_FULL = re.compile(r"(?<![\w/])(tests/[\w/]+\.py)(?:::(\w+))?")  # tests/x/test_y.py[::test_z]
_REL = re.compile(r"(?<![\w/])(test_\w+\.py)(?:::(\w+))?")  # test_y.py[::test_z]: the one file of that name
_CONT = re.compile(r"(?<![\w/.])::(\w+)")  # ::test_z: in the file cited last
_BARE = re.compile(r"(?<![\w/.:])(test_\w+)(?![\w.])")  # test_z: defined in some test file
_PROMISE = re.compile(r"^(\d+\. \*\*|#{2,3} )")


def _definitions() -> dict[str, set[str]]:
    """Every function and class defined in tests/, by name: the files that define it."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for m in re.finditer(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", path.read_text(encoding="utf-8"), re.M):
            out.setdefault(m.group(1), set()).add(rel)
    return out


def guarantee_citations(text: str, defs: dict[str, set[str]], root: Path = ROOT) -> tuple[int, list[str]]:
    """The test citations of ``text`` (guarantees.md's forms: ``tests/a/test_b.py::test_c``, ``::test_c`` after
    such a citation, ``test_b.py::test_c`` for the one file of that name, a bare ``test_c``, a file alone):
    ``(count, problems)``, a problem per citation whose file or test does not exist."""
    count, problems, last = 0, [], None
    for n, line in enumerate(text.splitlines(), 1):
        spans: list[tuple[int, int, str, str | None, str | None]] = []
        for kind, pattern in (("full", _FULL), ("rel", _REL), ("cont", _CONT), ("bare", _BARE)):
            for m in pattern.finditer(line):  # each later pattern only outside the earlier ones' matches
                if any(s <= m.start() < e for s, e, *_ in spans):
                    continue
                file, name = (m.group(1), m.group(2)) if kind in ("full", "rel") else (None, m.group(1))
                spans.append((m.start(), m.end(), kind, file, name))
        for _, _, kind, file, name in sorted(spans):
            count += 1
            if kind == "full" and not (root / file).is_file():
                problems.append(f"line {n}: {file} does not exist")
                continue
            if kind == "rel":
                found = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob(file))
                if len(found) != 1:
                    problems.append(f"line {n}: {file} names {len(found)} files ({found}): write its path")
                    continue
                file = found[0]
            if kind in ("full", "rel"):
                last = file
            if kind == "cont":
                file = last
            if name is None:
                continue
            if kind == "bare":
                if name not in defs:
                    problems.append(f"line {n}: {name} is not defined in tests/")
            elif file is None or file not in defs.get(name, ()):
                problems.append(f"line {n}: {file}::{name} is not defined there")
    return count, problems


def uncited_promises(text: str) -> list[str]:
    """The numbered promises (``N. **...**``) whose text (up to the next promise or heading) cites no test."""
    out, block = [], None
    cite = re.compile(f"{_FULL.pattern}|{_CONT.pattern}|{_BARE.pattern}")
    for line in [*text.splitlines(), "## end"]:
        if _PROMISE.match(line):
            if block and block[0][0].isdigit() and not cite.search("\n".join(block)):
                out.append(block[0][:90])
            block = [line]
        elif block is not None:
            block.append(line)
    return out


def test_every_test_guarantees_md_cites_exists():
    count, problems = guarantee_citations(GUARANTEES.read_text(encoding="utf-8"), _definitions())
    assert count >= 200, f"the scan found {count} citations: is a pattern broken?"
    assert not problems, "docs/guarantees.md cites tests that do not exist:\n" + "\n".join(problems)


def test_every_numbered_promise_in_guarantees_md_names_a_test():
    assert not uncited_promises(GUARANTEES.read_text(encoding="utf-8"))


def test_the_guarantees_scan_catches_missing_tests_and_uncited_promises():
    defs = {"test_here": {"tests/test_doc_citations.py"}, "test_there": {"tests/kernels/test_x.py"}}
    text = ("1. **kept** tests/test_doc_citations.py::test_here, ::test_gone, test_there, test_nowhere,\n"
            "   tests/nope.py, test_doc_citations.py::test_here\n"
            "2. **a promise without a test**\n## next\n")
    count, problems = guarantee_citations(text, defs)
    assert count == 6
    assert [p.split(": ", 1)[1] for p in problems] == [
        "tests/test_doc_citations.py::test_gone is not defined there",
        "test_nowhere is not defined in tests/",
        "tests/nope.py does not exist",
    ]
    assert uncited_promises(text) == ["2. **a promise without a test**"]
