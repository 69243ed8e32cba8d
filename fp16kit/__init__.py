"""fp16kit: mixed-precision training for PyTorch on Triton kernels, installed with pip alone.

``from fp16kit import amp`` gives apex-style ``amp.initialize`` / ``amp.scale_loss`` and torch-style
``autocast`` / ``GradScaler``; ``fp16kit.optim`` has ``FusedLAMB`` and ``FusedAdam``;
``fp16kit.kernels`` the fused multi-tensor kernels; ``fp16kit.numerics`` the float64 references,
format facts, Hypothesis strategies and ulp assertions used to test them.
Importing fp16kit needs neither a GPU nor Triton nor Hypothesis. It warns once when torch or Triton is outside
the tested range (``fp16kit._versions``, docs/compat.md).

May import: ``fp16kit._versions`` at import time; the subpackages load lazily on first use. The import directions
between the subpackages are the table of ``tests/test_layering.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _versions

_versions.check_installed()

__version__ = "0.1.0"

_SUBMODULES = ("amp", "amp_C", "compat", "doctor", "kernels", "multi_tensor_apply", "numerics", "optim", "parallel")

__all__ = ["__version__", *_SUBMODULES]


def __getattr__(name: str) -> Any:
    # Submodules load on first use, so `import fp16kit` stays cheap.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fp16kit' has no attribute {name!r}")
