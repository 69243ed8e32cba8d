"""fp16kit.optim: FusedLAMB (apex-exact) and FusedAdam on multi-tensor Triton kernels.

Names resolve lazily to their defining module.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FusedLAMB": ".lamb",
    "FusedAdam": ".adam",
    "lamb_step_": ".functional",
    "adam_step_": ".functional",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fp16kit.optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
