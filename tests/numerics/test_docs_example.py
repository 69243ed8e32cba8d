"""docs/numerics.md runs: every ``python`` block is executed, in order, in one namespace; every ``test_*`` it
defines is run; and each expected output it shows (a ``text`` block starting with ``AssertionError``) is what
the block before it really raises, Hypothesis's shrunk falsifying example included. A line of an expected
output may end in ``...`` (the rest of that line is not compared) or be just ``...`` (any lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import settings

try:
    from builtins import BaseExceptionGroup  # Python >= 3.11
except ImportError:  # the backport Hypothesis itself depends on before 3.11
    from exceptiongroup import BaseExceptionGroup

DOC = Path(__file__).resolve().parents[2] / "docs" / "numerics.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, str, int]]:
    text = DOC.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def output_matches(expected: str, actual: str) -> bool:
    """Every expected line appears in order in ``actual`` (``...`` as described in the module docstring)."""
    pattern = []
    for line in expected.strip().splitlines():
        if line.strip() == "...":
            pattern.append(r"(?:.*\n)*?")
            continue
        body = line[:-3] if line.endswith("...") else line
        pattern.append(re.escape(body.strip()) + (r".*" if line.endswith("...") else r"\s*") + r"\n")
    return re.search("".join(pattern), "\n".join(s.strip() for s in actual.splitlines()) + "\n") is not None


def failure_text(err: BaseException) -> str:
    if isinstance(err, BaseExceptionGroup):  # Hypothesis found several distinct failures
        return "\n".join(failure_text(e) for e in err.exceptions)
    notes = "\n".join(getattr(err, "__notes__", []))
    return f"{type(err).__name__}: {err}\n{notes}"


def run_doc() -> list[str]:
    """Runs the page; returns what was checked (for the test below to assert on)."""
    namespace: dict = {"__name__": "numerics_doc"}
    checked, pending = [], None  # pending: (what failed, its output text, line)
    for lang, body, line in blocks():
        if lang == "text" and body.startswith("AssertionError"):
            assert pending is not None, f"docs/numerics.md:{line}: an expected failure with no failing block before it"
            what, text, at = pending
            assert output_matches(body, text), (
                f"docs/numerics.md:{line}: {what} (line {at}) fails differently from what the page shows.\n"
                f"--- page ---\n{body}--- real ---\n{text}"
            )
            checked.append(what)
            pending = None
            continue
        if lang != "python":
            continue
        assert pending is None, f"docs/numerics.md:{pending[2]}: {pending[0]} failed and the page shows no output"
        before = set(namespace)
        try:
            exec(compile(body, f"docs/numerics.md:{line}", "exec"), namespace)
        except AssertionError as err:
            pending = (f"the block at line {line}", failure_text(err), line)
            continue
        for name in [n for n in namespace if n not in before and n.startswith("test_")]:
            try:
                namespace[name]()
            except (AssertionError, BaseExceptionGroup) as err:  # several distinct failures come as a group
                pending = (name, failure_text(err), line)
            else:
                checked.append(name)
    assert pending is None, f"docs/numerics.md:{pending[2]}: {pending[0]} failed and the page shows no output"
    return checked


def test_the_page_runs_and_shows_real_failures():
    # no example database and a fixed seed: the page's shrunk examples cannot come from an earlier local run,
    # and the run takes the same time every time
    before = getattr(settings, "_current_profile", None) or "default"
    settings.register_profile("numerics-doc", database=None, derandomize=True)
    settings.load_profile("numerics-doc")
    try:
        checked = run_doc()
    finally:
        settings.load_profile(before)
    # the worked example: two failures shrunk and shown, two fixes that pass, and the assertion message
    assert {"test_naive_softmax", "test_softmax", "test_naive_rms_norm", "test_rms_norm"} <= set(checked)
    assert any(c.startswith("the block at line") for c in checked)


def test_output_matching_is_strict_enough_to_fail():
    assert output_matches("AssertionError: a\n  b...\n...\nz", "AssertionError: a\n  b c\nx\ny\nz\n")
    assert not output_matches("AssertionError: a\nb", "AssertionError: a\nc\n")
    assert not output_matches("x=tensor([12.])", "x=tensor([13.])\n")


@pytest.mark.parametrize("needle", ["```python", "```text"])
def test_the_page_has_code_to_run(needle):
    assert needle in DOC.read_text()
