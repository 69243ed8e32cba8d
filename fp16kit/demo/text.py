"""The language-model demo's data: the Python standard library's own source files, as bytes.

Every Python installation has them (``sysconfig.get_paths()["stdlib"]``), so nothing is downloaded. The corpus is
every ``*.py`` file under that directory except installed packages (``site-packages``, ``dist-packages``) and test
suites (directories named ``test``, ``tests`` or ``idle_test``: some distributions ship them separately, so leaving
them out keeps the corpus the same whether they are installed or not).

The train/validation split is by file and deterministic: a file is in validation when the first 8 hex digits of the
SHA-256 of its path relative to the stdlib directory (POSIX separators), read as an integer, are 0 modulo
``1 / val_fraction`` (10 by default). A file's side depends on its name alone, not on which other files exist, so
two installations of the same Python version split identically, and another version moves only the files it adds
or removes. ``Corpus.fingerprint`` (a SHA-256 over the sorted ``path<TAB>size`` lines of both sides) names the exact
corpus a run saw; the demo prints it with the file counts and sizes.

Training batches are random windows of the concatenated training files (a ``torch.Generator`` seeded by the run);
validation is a fixed set of windows spaced evenly over the concatenated validation files, the same for every mode.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "is_validation", "list_sources", "load_corpus"]

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[str]:
    """The corpus files under ``root``: POSIX paths relative to it, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def is_validation(relpath: str, val_fraction: float = 0.1) -> bool:
    """The split rule (see the module docstring): a function of the relative path alone."""
    modulus = round(1 / val_fraction)
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % modulus == 0


@dataclass
class Corpus:
    root: str
    train: torch.Tensor  # uint8, the training files concatenated in path order
    val: torch.Tensor  # uint8, the validation files likewise
    train_files: int
    val_files: int
    fingerprint: str  # SHA-256 of the sorted "path<TAB>size" lines, "train"/"val" sides marked

    def describe(self) -> str:
        return (f"Python stdlib sources at {self.root}: train {self.train_files} files / {_mb(self.train)}, "
                f"validation {self.val_files} files / {_mb(self.val)} (split by file; list sha256 "
                f"{self.fingerprint[:16]})")

    def batch(self, gen: torch.Generator, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch`` random training windows: inputs and next-byte targets, int64 ``[batch, seq_len]``."""
        starts = torch.randint(0, self.train.numel() - seq_len - 1, (batch,), generator=gen)
        return _windows(self.train, starts, seq_len)

    def validation(self, windows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``windows`` fixed validation windows spaced evenly over the validation bytes."""
        last = self.val.numel() - seq_len - 1
        if last < windows:
            raise ValueError(f"the validation files hold {self.val.numel()} bytes: too few for {windows} windows "
                             f"of {seq_len}.")
        return _windows(self.val, torch.linspace(0, last, windows).long(), seq_len)


def _mb(t: torch.Tensor) -> str:
    return f"{t.numel() / 1e6:.2f} MB"


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def load_corpus(root: Path | None = None, val_fraction: float = 0.1) -> Corpus:
    """Read the corpus under ``root`` (default: this interpreter's stdlib) and split it by file."""
    root = stdlib_dir() if root is None else Path(root)
    files = list_sources(root)
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    lines = []
    for rel in files:
        data = (root / rel).read_bytes()
        val = is_validation(rel, val_fraction)
        parts[val].append(data)
        lines.append(f"{'val' if val else 'train'}\t{rel}\t{len(data)}")
    if not parts[False] or not parts[True]:
        raise ValueError(f"no Python sources for both sides of the split under {root} (found {len(files)} files).")

    def cat(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

    fingerprint = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return Corpus(str(root), cat(parts[False]), cat(parts[True]), len(parts[False]), len(parts[True]), fingerprint)
