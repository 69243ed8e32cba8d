"""Run code written for CUDA on the CPU: ``device="cuda"``, ``.cuda()``, ``torch.cuda.FloatTensor``, ...

Two parts, both undone on exit:

* :func:`cuda_on_cpu` - a ``TorchFunctionMode`` that rewrites every CUDA device argument of a torch call
  (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, ``device=`` keywords) to the CPU, makes
  ``Tensor.cuda()`` return the tensor itself, maps ``Tensor.type("torch.cuda.HalfTensor")`` to the CPU type,
  and reports ``Tensor.type()`` with CUDA names (tests compare against ``"torch.cuda.HalfTensor"``);
* :func:`patch_cuda_module` - ``torch.cuda.<Type>Tensor`` constructors become the CPU ones,
  ``synchronize``/``manual_seed``/``device(...)``/``current_device`` become CPU equivalents,
  ``torch.amp.autocast("cuda")`` is CPU autocast in fp16 and ``torch.amp.GradScaler("cuda")`` scales on the CPU
  (it would otherwise disable itself without CUDA and make loss-scaling tests vacuous). ``is_available()``
  and ``device_count()`` stay honest (0 on a CPU machine), so multi-GPU tests still skip themselves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cuda_on_cpu", "map_device", "patch_cuda_module"]

_CPU = torch.device("cpu")
_TENSOR_TYPES = ("Float", "Half", "Double", "Int", "Long", "Byte", "Char", "Short", "Bool", "BFloat16")


def map_device(value: Any) -> Any:
    """``value`` with any CUDA device (string or ``torch.device``) replaced by the CPU; other values unchanged."""
    if isinstance(value, torch.device):
        return _CPU if value.type == "cuda" else value
    if isinstance(value, str):
        if value == "cuda" or value.startswith("cuda:"):
            return "cpu"
        if value.startswith("torch.cuda.") and value.endswith("Tensor"):
            return "torch." + value[len("torch.cuda."):]
    return value


def _map_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    args = tuple(map_device(a) for a in args)
    if "device" in kwargs:
        kwargs = {**kwargs, "device": map_device(kwargs["device"])}
    return args, kwargs


class _CudaOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs.get("dtype"):
            name = func(*args, **kwargs)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        args, kwargs = _map_args(args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Inside: torch calls that name a CUDA device run on the CPU (see the module docstring)."""
    with _CudaOnCpu():
        yield


def _cpu_tensor_type(name: str) -> Any:
    return getattr(torch, f"{name}Tensor")


class _NullStream:
    def synchronize(self) -> None:
        return None

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None


class _CpuAutocast(torch.amp.autocast):
    """``autocast("cuda")`` becomes CPU autocast with CUDA's default dtype (fp16)."""

    def __init__(self, device_type: str = "cuda", dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        if device_type == "cuda":
            device_type, dtype = "cpu", dtype or torch.float16
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class _CpuGradScaler(torch.amp.GradScaler):
    """``GradScaler("cuda")`` on a machine without CUDA would disable itself; scale on the CPU instead."""

    def __init__(self, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
        super().__init__("cpu" if device == "cuda" else device, *args, **kwargs)


def patch_cuda_module() -> Callable[[], None]:
    """Replace CUDA-only ``torch.cuda`` entry points by CPU equivalents (and ``torch.amp``'s autocast and
    GradScaler for device "cuda" by their CPU versions); returns the function that undoes it."""
    saved: list[tuple[Any, str, Any]] = []

    def put(name: str, value: Any, module: Any = torch.cuda) -> None:
        saved.append((module, name, getattr(module, name, None)))
        setattr(module, name, value)

    for t in _TENSOR_TYPES:
        put(f"{t}Tensor", _cpu_tensor_type(t))
    put("synchronize", lambda device=None: None)
    # torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the CPU generator directly, no recursion
    put("manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
    put("manual_seed_all", lambda seed: None)
    put("device", lambda device=None: contextlib.nullcontext())
    put("current_device", lambda: 0)
    put("set_device", lambda device: None)
    put("current_stream", lambda device=None: _NullStream())
    put("empty_cache", lambda: None)
    put("autocast", _CpuAutocast, torch.amp)
    put("autocast", _CpuAutocast, torch)
    put("GradScaler", _CpuGradScaler, torch.amp)

    def undo() -> None:
        for module, name, value in reversed(saved):
            setattr(module, name, value)

    return undo
