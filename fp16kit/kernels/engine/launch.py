"""Recorded launches: a device step's Triton launches captured once and replayed while their arguments stand.

A steady device step (``fp16kit/optim/_device_step.py``, "replay") issues the very same launches every step: the same
kernels, grids, address tables, flags, counters and host scalars (its rows' addresses and metadata and the groups'
hyper-parameters unchanged). :class:`Recording` captures them at the kernels themselves (every ``@triton.jit``
function of ``fp16kit.kernels`` carries a pass-through hook, :func:`install`), together with a check that nothing
else happened in between (any torch op other than a view makes the recording unusable), so a replay can skip the
Python that derived them: planning, table lookups, argument packing.

Each :class:`Launch` replays its kernel as the launcher called it (``kernel[grid](*args, **kwargs)``). On CUDA it
can also skip Triton's own Python launcher (``JITFunction.run``: argument binding, specialization key, cache
lookup): the recording's first run returns the ``CompiledKernel``, whose C launcher ``CompiledKernel.run`` is then
called with the arguments bound once (:attr:`Launch.bound`: every parameter in signature order, as Triton's binder
orders them) and the current stream read at each replay (so a side stream of CUDA-graph capture is honoured). That path
is taken only with ``FP16KIT_BOUND_LAUNCH=1`` (:func:`bound_launches`) and no Triton launch hook installed, until a
GPU run has checked it bit for bit (``benchmarks/gpu_suite.sh``, step ``bound``).
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Launch", "Recording", "bound_launches", "install", "stats"]

#: Counters read by tests and benchmarks: launches replayed, and of those through the bound C launcher.
stats = {"replayed": 0, "bound": 0}

_local = threading.local()


def bound_launches() -> bool:
    """Replayed CUDA launches call the compiled kernel's C launcher directly (``FP16KIT_BOUND_LAUNCH=1``)."""
    return os.environ.get("FP16KIT_BOUND_LAUNCH", "0") == "1"


def _hooks_installed() -> bool:
    """Has anyone installed a Triton launch hook (a profiler)? Then launches take Triton's own launcher, which
    calls it. (Triton 3.9 keeps an empty ``HookChain`` where older versions keep None.)"""
    try:
        from triton import knobs
    except ImportError:  # an older Triton without knobs: no hooks to honour
        return False
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _bound_now() -> bool:
    """Do replayed launches take the bound C launcher now (switched on, and no launch hook to honour)?"""
    return bound_launches() and not _hooks_installed()


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


class Launch:
    """One recorded launch: ``kernel[grid](*args, **kwargs)``, replayable by :meth:`__call__`."""

    __slots__ = ("args", "bound", "compiled", "device", "grid", "kernel", "kwargs")

    def __init__(self, kernel: Any, grid: tuple, args: tuple, kwargs: dict, result: Any, device: torch.device) -> None:
        self.kernel, self.grid, self.args, self.kwargs, self.device = kernel, grid, args, kwargs, device
        self.compiled = result if _is_compiled(result) else None
        self.bound = _bind(kernel, args, kwargs) if self.compiled is not None else None

    def __call__(self, bound: bool | None = None, stream: int | None = None) -> None:
        """Replay the launch. ``bound``: take the bound C launcher (:func:`replay` decides it once for all its
        launches; None: decided here); ``stream``: the current stream's handle on the launch's device, if known."""
        stats["replayed"] += 1
        compiled = self.compiled
        if compiled is not None and (_bound_now() if bound is None else bound):
            stats["bound"] += 1
            g = self.grid
            compiled.run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1,
                         _stream(self.device) if stream is None else stream,
                         compiled.function, compiled.packed_metadata, None, None, None, *self.bound)
            return
        type(self.kernel).run(self.kernel, *self.args, grid=self.grid, warmup=False, **self.kwargs)


def _is_compiled(result: Any) -> bool:
    """A ``CompiledKernel`` (what ``JITFunction.run`` returns; the interpreter returns None)."""
    return result is not None and hasattr(result, "packed_metadata") and hasattr(result, "function")


def _bind(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """Every parameter of ``kernel`` in signature order, constexprs and defaults included: what Triton's binder
    hands the C launcher (``bound_args.values()``); launch options (``num_warps``...) are not parameters."""
    sig = inspect.signature(kernel.fn)
    call = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    call.apply_defaults()
    return tuple(call.arguments.values())


class _Ops(TorchDispatchMode):
    """Flags any torch op other than a view while a recording is open (paused inside the kernels' own runs)."""

    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.recording.paused and not getattr(func, "is_view", False):
            self.recording.ok = False
            self.recording.why = str(func)
        return func(*args, **(kwargs or {}))


class Recording:
    """``with Recording(device) as rec:`` every fp16kit Triton launch of this thread is captured into
    ``rec.launches``; ``rec.ok`` stays True only if nothing but launches and views ran inside."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.launches: list[Launch] = []
        self.ok = True
        self.why = ""
        self.paused = False
        self._mode = _Ops(self)

    def __enter__(self) -> Recording:
        install()
        self._prev = getattr(_local, "recording", None)
        _local.recording = self
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        _local.recording = self._prev
        if exc and exc[0] is not None:
            self.ok = False

    def fail(self, why: str) -> None:
        """Mark the recording unusable (a path a replay would not reproduce)."""
        self.ok, self.why = False, why


def current() -> Recording | None:
    """The recording open in this thread, if any."""
    return getattr(_local, "recording", None)


class _Hook:
    """The pass-through ``run`` of one kernel: the class's ``run`` (looked up per call, so a patched class method
    still applies), recorded when this thread has a :class:`Recording` open."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __call__(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = self.kernel
        rec = getattr(_local, "recording", None)
        if rec is None or warmup:
            return type(kernel).run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        rec.paused = True
        try:
            result = type(kernel).run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            rec.paused = False
        if callable(grid):
            rec.fail("a grid given as a function")
        else:
            rec.launches.append(Launch(kernel, tuple(grid), args, kwargs, result, rec.device))
        return result


_installed: set[int] = set()


def install() -> None:
    """Give every ``@triton.jit`` kernel of the ``fp16kit.kernels`` modules loaded so far its recording hook (an
    instance attribute ``run``; idempotent)."""
    from triton.runtime.jit import KernelInterface

    for name, mod in list(sys.modules.items()):
        if not name.startswith("fp16kit.kernels.") or mod is None:
            continue
        for value in list(vars(mod).values()):
            if isinstance(value, KernelInterface) and id(value) not in _installed:
                value.run = _Hook(value)
                _installed.add(id(value))


def replay(launches: list[Launch]) -> None:
    """Run recorded launches in order: whether they take the bound C launcher, and the current stream's handle, are
    read once for all of them (a replay switches neither; each read costs about a microsecond)."""
    bound = None
    streams: dict[torch.device, int] = {}
    for launch in launches:
        if launch.compiled is None:  # (the interpreter's launches: Triton's own launcher)
            launch(False)
            continue
        if bound is None:
            bound = _bound_now()
        stream = None
        if bound:
            stream = streams.get(launch.device)
            if stream is None:
                stream = streams[launch.device] = _stream(launch.device)
        launch(bound, stream)
