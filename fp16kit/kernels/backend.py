"""Which implementation runs a kernel call: compiled Triton, the Triton interpreter, or torch.

Rules, in order:

1. A forced choice: ``fp16kit.kernels.use_backend(...)`` (innermost wins), else the environment
   variable ``FP16KIT_BACKEND=triton|torch``. Forcing ``triton`` where Triton cannot run is an error
   that says why, never a silent fallback.
2. CUDA tensors with Triton importable (and the interpreter off): compiled Triton kernels.
3. CPU tensors with ``TRITON_INTERPRET=1`` set *before triton was imported*: the same Triton kernels,
   run by Triton's interpreter (this is how CI exercises the real kernels without a GPU).
4. Everything else: the torch fallback (``torch._foreach_*`` and friends).

Triton decides interpreter mode once, when ``triton`` is first imported (its ``tl.*`` helpers are
themselves jitted then), so the mode is process-wide. fp16kit therefore reads it from Triton after
import and reports a mismatch (the variable set too late) instead of crashing inside the interpreter.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "Backend",
    "BackendChoice",
    "interpreter_active",
    "select_backend",
    "triton_available",
    "use_backend",
]

ENV_BACKEND = "FP16KIT_BACKEND"


class Backend(str, enum.Enum):
    """The three ways a kernel call can run."""

    TRITON = "triton"
    INTERPRETER = "triton interpreter"
    TORCH = "torch fallback"


@dataclass(frozen=True)
class BackendChoice:
    """A backend and the one-line reason it was chosen (shown by ``python -m fp16kit info``)."""

    backend: Backend
    reason: str


_local = threading.local()


def _forced_stack() -> list[str]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force ``"triton"`` or ``"torch"`` for kernel calls in this block (this thread only).

    ``"auto"`` restores automatic selection inside an outer forced block.
    """
    if name not in ("triton", "torch", "auto"):
        raise ValueError(f"use_backend: unknown backend {name!r}; choose 'triton', 'torch' or 'auto'.")
    stack = _forced_stack()
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def _forced() -> str | None:
    stack = _forced_stack()
    if stack and stack[-1] != "auto":
        return stack[-1]
    if stack and stack[-1] == "auto":
        return None
    env = os.environ.get(ENV_BACKEND, "").strip().lower()
    if env in ("", "auto"):
        return None
    if env not in ("triton", "torch"):
        raise ValueError(f"{ENV_BACKEND}={env!r} is not understood; set it to 'triton', 'torch' or unset it.")
    return env


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` can work on this platform (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when the environment asks for Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def interpreter_active() -> bool:
    """True when Triton runs in interpreter mode in this process.

    Before triton is imported this is what the environment asks for (importing triton then honours
    it). After import, it is what triton actually did: its ``tl.zeros`` helper is an interpreted
    function exactly when interpreter mode was on at import time.
    """
    if not triton_available():
        return False
    if "triton.language" not in sys.modules:
        return interpreter_requested()
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def _interpreter_mismatch() -> bool:
    return interpreter_requested() and not interpreter_active() and triton_available()


def select_backend(device: torch.device) -> BackendChoice:
    """Choose the backend for tensors on ``device`` (see the module docstring for the rules)."""
    forced = _forced()
    if forced == "torch":
        return _FORCED_TORCH
    # The automatic choice depends only on the device type and on what Triton did at import, both fixed once triton
    # is imported: cached on them (this runs on every kernel call; uncached it cost ~4 us per call).
    key = (device.type, os.environ.get("TRITON_INTERPRET"), "triton.language" in sys.modules)
    choice = _AUTOMATIC.get(key)
    if choice is None:
        choice = _AUTOMATIC[key] = _automatic(device)
    if forced == "triton" and choice.backend is Backend.TORCH:
        raise RuntimeError(
            f"The triton backend was forced (FP16KIT_BACKEND=triton or use_backend('triton')) but Triton "
            f"cannot run for {device.type} tensors here: {choice.reason}. Unset FP16KIT_BACKEND to use the "
            f"torch fallback, or run on a CUDA device / with TRITON_INTERPRET=1 set before importing triton."
        )
    return choice


_AUTOMATIC: dict[tuple, BackendChoice] = {}
_FORCED_TORCH = BackendChoice(Backend.TORCH, "forced by FP16KIT_BACKEND=torch / use_backend('torch')")


def _automatic(device: torch.device) -> BackendChoice:
    if not triton_available():
        return BackendChoice(Backend.TORCH, "triton is not installed (it is Linux-only)")
    if device.type == "cuda":
        if interpreter_active():
            return BackendChoice(
                Backend.TORCH, "TRITON_INTERPRET=1 puts Triton in interpreter mode, which cannot run CUDA tensors"
            )
        if torch.version.hip is not None:
            return BackendChoice(Backend.TRITON, "ROCm device with triton importable")
        return BackendChoice(Backend.TRITON, "CUDA device with triton importable")
    if device.type == "cpu":
        if interpreter_active():
            return BackendChoice(Backend.INTERPRETER, "TRITON_INTERPRET=1: Triton kernels run on CPU tensors")
        if _interpreter_mismatch():
            return BackendChoice(
                Backend.TORCH,
                "TRITON_INTERPRET=1 was set after triton was imported, so triton is not in interpreter mode "
                "(set it before the first import)",
            )
        return BackendChoice(Backend.TORCH, "CPU tensors (set TRITON_INTERPRET=1 to run the Triton kernels)")
    return BackendChoice(Backend.TORCH, f"no Triton kernels for {device.type} tensors")


def _keep_dynamo_out_of_the_interpreter() -> None:
    """Under Triton's interpreter, a kernel launch that ``torch.compile`` reaches runs instead of being traced.

    The interpreter runs a kernel as Python over numpy arrays, pointers as uint64 (``create_addptr``). Dynamo
    reaches a launch whenever an eager fp16kit function runs inside a compiled region (a pass with no dispatcher op,
    or any call from a frame Dynamo resumed after a graph break), traces that Python, and fails on the uint64
    arithmetic (``KeyError(torch.uint64)`` in fake tensors). ``torch.compiler.disable`` on the interpreter's launch
    makes it a graph break: the kernel runs as it does eagerly, with the eager bits. Process-wide (the interpreter
    is; no Dynamo trace of an interpreted kernel that touches memory can succeed); compiled Triton is untouched."""
    from triton.runtime.interpreter import InterpretedFunction

    if not getattr(InterpretedFunction.run, "_fp16kit_eager", False):
        run = torch.compiler.disable(InterpretedFunction.run)
        run._fp16kit_eager = True
        InterpretedFunction.run = run


if interpreter_requested() and triton_available():
    _keep_dynamo_out_of_the_interpreter()
