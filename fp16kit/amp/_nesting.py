"""``torch.autocast`` regions inside fp16kit regions: one documented behaviour under both engines.

fp16kit's region sets state torch's ``autocast`` does not know (the dispatcher engine's marker, the mode engine's
``TorchFunctionMode``), and torch's ``autocast`` sets state that fp16kit's kernels and mode would otherwise either
ignore (the mode engine kept casting inside ``torch.autocast(enabled=False)``) or trip over (torch's weight-cast
cache is keyed by tensor, not dtype: a weight cached in fp16 is handed to a bf16 matmul inside a nested
``torch.autocast(dtype=torch.bfloat16)``, torch's "mat1 and mat2 must have the same dtype").

:func:`install` wraps ``torch.amp.autocast_mode.autocast.__enter__`` / ``__exit__`` (the class behind
``torch.autocast``, ``torch.amp.autocast`` and the deprecated ``torch.cpu/cuda.amp.autocast``) so that, on entry, a
callback from ``autocast_mode`` decides what the torch region does to an enclosing fp16kit region
(``autocast_mode.torch_region_enter``: it takes over, or changes nothing) and whether it may use torch's cache, or
re-enters the region around the backward of a ``torch.amp.custom_fwd`` Function whose forward ran in one
(``_torch_custom_fn``); on exit the enclosing region is restored. Outside fp16kit regions the wrapper costs plain
``torch.autocast`` code one Python call and a thread-local read per region entry and exit, nothing per op. Under
``torch.compile`` Dynamo traces ``torch.autocast`` itself and the callback does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["install", "installed"]

_HOOKS: list[tuple[Callable[..., Any], Callable[[Any], None]]] = []


def install(on_enter: Callable[[str, bool, torch.dtype], Any], on_exit: Callable[[Any], None]) -> None:
    """Wrap ``torch.autocast``'s ``__enter__``/``__exit__`` (once). ``on_enter(device, enabled, dtype)`` returns
    a token ``(takes_over, cache_off, ...)`` or None; ``on_exit(token)`` undoes it (also when torch's own
    ``__enter__`` raises after it)."""
    if _HOOKS:
        return
    from torch.amp import autocast_mode as torch_autocast_mode

    cls = torch_autocast_mode.autocast
    enter, exit_ = cls.__enter__, cls.__exit__
    _HOOKS.append((on_enter, on_exit))

    @functools.wraps(enter)
    def __enter__(self: Any) -> Any:
        token = on_enter(self.device, self._enabled, self.fast_dtype) if hasattr(self, "device") else None
        if token is None:
            return enter(self)
        try:
            if token[1]:
                cache, self._cache_enabled = self._cache_enabled, False
                try:
                    out = enter(self)
                finally:
                    self._cache_enabled = cache
            else:
                out = enter(self)
        except BaseException:
            on_exit(token)
            raise
        self._fp16kit_token = token  # torch keeps its own restore state on the instance the same way
        return out

    @functools.wraps(exit_)
    def __exit__(self: Any, *exc: Any) -> Any:
        out = exit_(self, *exc)
        token = self.__dict__.pop("_fp16kit_token", None)
        if token is not None:
            on_exit(token)
        return out

    __enter__.__fp16kit_wrapped__ = enter  # type: ignore[attr-defined]
    __exit__.__fp16kit_wrapped__ = exit_  # type: ignore[attr-defined]
    cls.__enter__ = __enter__
    cls.__exit__ = __exit__


def installed() -> bool:
    """True once :func:`install` wrapped ``torch.autocast``."""
    return bool(_HOOKS)
