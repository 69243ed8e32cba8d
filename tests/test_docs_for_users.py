"""The user documentation (README.md and docs/*.md) is written for users, and what it points at exists.

- No internal tracker references or work notes: a user cannot look up "issue 11", "round 3" or "#26", and "no GPU in
  this session" or "have not been run yet" describe a work session, not the software. Each such sentence states the
  fact without its history; dated measurement runs live in benchmarks/results/history/.
- Every relative link resolves: the file exists and a ``#anchor`` names a heading of it (GitHub's slug rule).
- Every ``docs/<page>.md, "Section"`` citation in the package, tests, benchmarks and scripts names a heading (or a
  bold run-in heading) of that page, so restructuring a page cannot orphan the code's pointers into it.
- Every repository file and every ``tests/<file>.py::<test>`` the docs name exists.
- The constructor signatures the docs show are the classes' own: every argument, its default, and where the
  keyword-only ones begin.
- docs/README.md is the map: it links every page.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]
#: Pages another change is rewriting at the same time; their phrase check is expected to fail until it lands.
ELSEWHERE: set[str] = set()

#: Phrases that cite the project's internal tracker or narrate a work session. Upstream references such as
#: ``pytorch#48049`` are fine (a word character before the ``#``).
FORBIDDEN = [
    (re.compile(r"\bissues? \d+", re.I), "an internal issue number"),
    (re.compile(r"(?<![-\w])rounds? \d+\b", re.I), "an internal work round"),
    (re.compile(r"\bsessions? \d+\b", re.I), "an internal work session"),
    (re.compile(r"\bitems? \d+(/\d+)?\b", re.I), "an item of an internal issue"),
    (re.compile(r"(?<![\w/&])#\d+(?![\w-])"), "a '#N' tracker reference"),
    (re.compile(r"\b(this|that|in a|the previous|the next|a later|an earlier) (session|round)\b", re.I), "a work note"),
    (re.compile(r"\bthis change\b", re.I), "a work note"),
    (re.compile(r"\bno GPU (in|on|was) (this|that|available)", re.I), "a work note"),
    (re.compile(r"\b(have|has) not been (run|measured|made|taken)\b", re.I), "a work note"),
    (re.compile(r"\bnot yet (run|measured)\b|\b(run|measured|tested|merged|written|made) yet\b|\bGPU yet\b|"
                r"\bno GPU figures yet\b", re.I), "a work note"),
    (re.compile(r"\banother branch\b|\bthe lead\b|\bearlier notes\b", re.I), "a work note"),
    (re.compile(r"\b(TODO|FIXME|XXX)\b"), "a work note"),
]


def _without_code_blocks(text: str) -> str:
    """The text with fenced code blocks blanked (line numbers kept): code and program output are not prose."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def _hits(text: str) -> list[str]:
    out = []
    for lineno, line in enumerate(_without_code_blocks(text).splitlines(), 1):
        out.extend(f"line {lineno}: {why}: {m.group(0)!r} in: {line.strip()[:140]}"
                   for pattern, why in FORBIDDEN for m in pattern.finditer(line))
    return out


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.xfail(reason="rewritten by another change", strict=False))
    if str(p.relative_to(ROOT)) in ELSEWHERE else p for p in PAGES], ids=PAGE_IDS)
def test_no_tracker_numbers_or_work_notes(page: Path) -> None:
    hits = _hits(page.read_text(encoding="utf-8"))
    assert not hits, f"{page.relative_to(ROOT)}: state the fact without its history:\n" + "\n".join(hits)


def test_the_phrase_check_can_fail() -> None:
    bad = ("Fixed in issue 11. Measured in round 3, session 2 (#26, items 1/2, another branch).\n"
           "GPU timings have not been taken (no GPU in this session); the lead reruns it.\n"
           "Nothing has run on a GPU yet; the checkpoint cannot be written yet.\n")
    assert len(_hits(bad)) >= 10
    assert _hits("see [8-bit moments](#8-bit-moments); python bench.py --rounds 12") == []
    good = ("torch grows the cache under no_grad (pytorch#48049). All-reduce 1 carries the flag.\n"
            "```\nall-reduce #1 in a code block\n```\nmin over 9 interleaved rounds of 20 steps.\n")
    assert _hits(good) == []


# -- links -------------------------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> set[str]:
    text = _without_code_blocks(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(text):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = _without_code_blocks(page.read_text(encoding="utf-8"))
        out.extend((str(page.relative_to(ROOT)), m.group(1)) for m in _LINK.finditer(text)
                   if not m.group(1).startswith(("http://", "https://", "mailto:")))
    return out


LINKS = _links()


def test_the_link_scan_finds_links() -> None:
    assert len(LINKS) >= 50
    assert slug("Nesting, `disable_casts`, threads") == "nesting-disable_casts-threads"
    assert slug("autocast default engine (`benchmarks/bench_autocast_default.py`)") == \
        "autocast-default-engine-benchmarksbench_autocast_defaultpy"


def test_relative_links_resolve() -> None:
    broken = []
    for page, target in LINKS:
        path, _, anchor = target.partition("#")
        where = (ROOT / page).parent / path if path else ROOT / page
        if not where.exists():
            broken.append(f"{page} links {target}, which does not exist")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{page} links {target}: no heading of {path or page} has that anchor")
    assert not broken, "\n".join(broken)


_FILE = re.compile(r"(?<![\w/.-])((?:fp16kit|tests|benchmarks|scripts|docs)/[\w./-]+\.(?:py|md|sh|txt|json|png|csv))")


def test_cited_files_exist() -> None:
    """Every repository path a page names (``fp16kit/kernels/_table.py``, ``tests/optim/test_sgd.py``) exists; a
    file that moves takes its citations with it."""
    cited = [(str(page.relative_to(ROOT)), m.group(1)) for page in PAGES
             for m in _FILE.finditer(page.read_text(encoding="utf-8"))]
    assert len(cited) >= 300, "the path scan found too little"
    missing = sorted({f"{page} names {path}" for page, path in cited if not (ROOT / path).exists()})
    assert not missing, "\n".join(missing)


# -- section citations from code ----------------------------------------------------------------------------------

_CITE = re.compile(r'(docs/[\w/-]+\.md)`?,?\s*\(?\\?"([^"\\]{2,80})\\?"')


@functools.cache
def _headings(path: Path) -> set[str]:
    text = _without_code_blocks(path.read_text(encoding="utf-8"))
    heads = {re.sub(r"[`*]", "", m.group(1)).strip() for m in _HEADING.finditer(text)}
    heads |= {m.group(1).rstrip(".:").strip() for m in re.finditer(r"\*\*([^*]{2,80})\*\*", text)}
    return heads


def _section_citations() -> list[tuple[str, str, str]]:
    out = []
    for folder in ("fp16kit", "tests", "benchmarks", "scripts"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh") or path.name == Path(__file__).name:
                continue
            text = path.read_text(encoding="utf-8")
            for m in _CITE.finditer(text):
                page, title = m.group(1), re.sub(r"\s*\n\s*(#:?\s*)?", " ", m.group(2))
                if page.startswith("docs/specs/") or page == "docs/nope.md":
                    continue
                out.append((str(path.relative_to(ROOT)), page, title))
    return out


SECTION_CITATIONS = _section_citations()


def test_the_citation_scan_finds_citations() -> None:
    assert len(SECTION_CITATIONS) >= 30
    assert any(c[1:] == ("docs/optim.md", "8-bit moments") for c in SECTION_CITATIONS)


def _cited_section_missing(page: str, title: str) -> bool:
    path = ROOT / page
    if not path.is_file():
        return True
    heads = {re.sub(r"[`*]", "", h) for h in _headings(path)}
    clean = re.sub(r"[`*]", "", title).strip()
    if "(" in clean and not any(h.startswith(clean) for h in heads):
        clean = re.sub(r"\s*\([^)]*\)$", "", clean)  # a trailing "(qualifier)" in a citation is not the heading's
    return not any(h.startswith(clean) for h in heads)


def test_cited_sections_exist() -> None:
    missing = [f"{where} cites {page}, {title!r}" for where, page, title in SECTION_CITATIONS
               if _cited_section_missing(page, title)]
    assert not missing, ("no heading of the page starts so (keep the heading, or update the citation):\n"
                         + "\n".join(missing))


def test_the_section_check_can_fail() -> None:
    assert _cited_section_missing("docs/optim.md", "No such section")
    assert not _cited_section_missing("docs/optim.md", "8-bit moments")


# -- tests the docs name ------------------------------------------------------------------------------------------

_TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _test_refs() -> list[tuple[str, str, str]]:
    out = []
    for page in PAGES:
        for m in _TEST_REF.finditer(page.read_text(encoding="utf-8")):
            out.append((str(page.relative_to(ROOT)), m.group(1), m.group(2)))
    return sorted(set(out))


def test_named_tests_exist() -> None:
    refs = _test_refs()
    assert len(refs) >= 20, "the scan for tests/<file>.py::<test> found too little"
    missing = []
    for page, file, name in refs:
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{page} names {file}::{name}; {file} does not exist")
        elif not re.search(rf"^\s*(async )?def {name}\(|^class {name}\b", path.read_text(encoding="utf-8"), re.M):
            missing.append(f"{page} names {file}::{name}, which {file} does not define")
    assert not missing, "\n".join(missing)


# -- constructor signatures -----------------------------------------------------------------------------------------

CLASSES = ["FusedAdam", "FusedLAMB", "FusedSGD", "FusedNovoGrad", "FusedAdagrad", "FusedMixedPrecisionLamb", "LARC"]
FUNCTIONS = ["adam_step_", "lamb_step_"]


def _documented_signature(name: str) -> ast.arguments:
    """The ``name(...)`` signature block of docs/optim.md or docs/optim-apex.md, parsed as a ``def``."""
    for page in ("optim.md", "optim-apex.md"):
        text = (DOCS / page).read_text(encoding="utf-8")
        for block in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M):
            m = re.search(rf"^{name}\((.*?)\)(?:\s*->.*)?$", block, re.S | re.M)
            if m is None:
                continue
            tree = ast.parse(f"def {name}({m.group(1)}): pass")
            return tree.body[0].args
    raise AssertionError(f"no ```python block of docs/optim.md or docs/optim-apex.md shows {name}(...)")


@functools.cache
def _code_signatures() -> dict[str, ast.arguments]:
    """Each public class's ``__init__`` arguments (``self`` dropped) and each function's arguments, read from the
    source of fp16kit/optim/ (no import: importing the optimizers loads the kernels)."""
    out = {}
    for path in sorted((ROOT / "fp16kit" / "optim").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
                if init is not None:
                    init.args.args = init.args.args[1:]
                    out[node.name] = init.args
            elif isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                out[node.name] = node.args
    return out


def _code_signature(name: str) -> ast.arguments:
    assert name in _code_signatures(), f"fp16kit/optim/ defines no {name}"
    return _code_signatures()[name]


def _shape(args: ast.arguments) -> tuple[list, list]:
    """(positional (name, default), keyword-only (name, default)); a required argument's default is None (also
    torch's ``required`` sentinel, which the docs show as no default)."""
    def value(node: ast.expr | None) -> object:
        if node is None or (isinstance(node, ast.Name) and node.id == "required"):
            return None
        return ast.literal_eval(node)

    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    return ([(a.arg, value(d)) for a, d in zip(positional, defaults)],
            [(a.arg, value(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)])


@pytest.mark.parametrize("name", CLASSES + FUNCTIONS)
def test_documented_signatures_are_complete(name: str) -> None:
    doc_pos, doc_kw = _shape(_documented_signature(name))
    code_pos, code_kw = _shape(_code_signature(name))
    assert doc_pos == code_pos, f"docs: {name}'s positional arguments differ from the code"
    assert doc_kw == code_kw, f"docs: {name}'s keyword-only arguments (after *) differ from the code"


def test_the_signature_check_can_fail() -> None:
    doc = ast.parse("def f(params, lr=1e-3, *, state_bits=32): pass").body[0].args
    code = ast.parse("def f(params, lr=1e-3, *, state_bits=32, capturable=False): pass").body[0].args
    assert _shape(doc) != _shape(code)
    assert _shape(_code_signature("FusedSGD"))[0][1] == ("lr", None)  # torch's `required`


@pytest.mark.parametrize("name", CLASSES + FUNCTIONS)
def test_every_argument_has_a_meaning(name: str) -> None:
    """Each argument of the signature is named in an argument table of the docs (a row starting with it)."""
    pos, kw = _shape(_code_signature(name))
    params = [a for a, _ in pos + kw if a not in ("params", "optimizer")]
    text = (DOCS / "optim.md").read_text(encoding="utf-8") + (DOCS / "optim-apex.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\|\s*`(\w+)`", text, re.M))
    missing = [p for p in params if p not in rows]
    assert not missing, f"{name}: no argument-table row (| `name` | ...) for {missing}"


# -- the map ------------------------------------------------------------------------------------------------------

def test_the_docs_readme_maps_every_page() -> None:
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]*)?\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"
    assert "docs/README.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_measurement_history_is_linked_from_the_docs() -> None:
    history = sorted((ROOT / "benchmarks" / "results" / "history").glob("*.md"))
    assert history, "benchmarks/results/history/ holds the dated measurement runs"
    text = "".join(p.read_text(encoding="utf-8") for p in PAGES)
    for path in history:
        assert f"results/history/{path.name}" in text, f"no page links {path.relative_to(ROOT)}"
