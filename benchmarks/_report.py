"""What the benchmark scripts share: writing a result page."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def write_report(lines: Iterable[str], out: Path | str) -> str:
    """The Markdown ``lines`` as one page: printed, and written to ``out`` (its folder created). Returns the text."""
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text
