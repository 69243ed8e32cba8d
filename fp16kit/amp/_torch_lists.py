"""torch's own CUDA autocast lists for the installed torch, read as data (part of the table: docs/specs/cast-policy.md).

torch ships the op lists its CUDA autocast tests check in ``torch/testing/_internal/autocast_test_lists.py``
(class ``AutocastTestLists``: ``torch_fp16``, ``torch_fp32``, ``nn_fp32``, ...). Importing that module pulls in
torch's test harness (``expecttest``, ``common_utils``), which a library must not need, so the file is *parsed*
(``ast``) and only the op names are taken: the first string of each tuple of each ``self.<list> = [...]``.
A torch that adds an op to its CUDA lists (as it added ``rms_norm``) therefore gives that op torch's CUDA dtype
under fp16kit without a change here. When the file is missing (a stripped torch install) the lists are empty
and the spec's own table (``policy.DEFAULT_TABLE``) still applies.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

__all__ = ["LIST_RULES", "torch_cuda_lists"]

#: list attribute of ``AutocastTestLists`` -> (rule name, how its op names are spelled as table rows)
LIST_RULES: dict[str, tuple[str, str]] = {
    "torch_fp16": ("LOW", "torch"),
    "nn_fp16": ("LOW", "nn"),
    "linalg_fp16": ("LOW", "linalg"),
    "methods_fp16": ("LOW", "method"),
    "torch_fp32": ("FP32", "torch"),
    "nn_fp32": ("FP32", "nn"),
    "methods_fp32": ("FP32", "method"),
    "torch_need_autocast_promote": ("PROMOTE", "torch"),
    "banned": ("BANNED", "nn"),
}


def _source_path() -> Path | None:
    try:
        spec = importlib.util.find_spec("torch.testing._internal.autocast_test_lists")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin)


def parse_lists(source: str, class_name: str = "AutocastTestLists") -> dict[str, list[str]]:
    """``{list attribute: [op names in order, duplicates removed]}`` of class ``class_name`` in ``source``
    (``AutocastTestLists``: CUDA; ``AutocastCPUTestLists``: CPU)."""
    out: dict[str, list[str]] = {}
    for cls in ast.parse(source).body:
        if not (isinstance(cls, ast.ClassDef) and cls.name == class_name):
            continue
        for fn in cls.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "__init__"):
                continue
            for stmt in ast.walk(fn):
                if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.List)):
                    continue
                for target in stmt.targets:
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                        names = [
                            elt.elts[0].value
                            for elt in stmt.value.elts
                            if isinstance(elt, ast.Tuple)
                            and elt.elts
                            and isinstance(elt.elts[0], ast.Constant)
                            and isinstance(elt.elts[0].value, str)
                        ]
                        out[target.attr] = list(dict.fromkeys(names))
    return out


@functools.cache
def torch_cuda_lists(class_name: str = "AutocastTestLists") -> dict[str, list[str]]:
    """The installed torch's CUDA autocast lists (``{}`` when its test-lists file is not installed); with
    ``class_name="AutocastCPUTestLists"``, its CPU lists."""
    path = _source_path()
    if path is None or not path.is_file():
        return {}
    try:
        return parse_lists(path.read_text(encoding="utf-8"), class_name)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}


def row_name(op: str, spelling: str) -> str:
    """A list's op name as a row of fp16kit's table: ``linalg_vecdot`` -> ``linalg.vecdot``, ``__pow__`` ->
    ``Tensor.__pow__``; ``nn`` names (``torch._C._nn.<op>``) and ``torch`` names are rows by their bare name."""
    if spelling == "linalg" and op.startswith("linalg_"):
        return "linalg." + op[len("linalg_") :]
    if spelling == "method":
        return "Tensor." + op
    return op
