"""Run code written for CUDA on the CPU: ``device="cuda"``, ``.cuda()``, ``torch.cuda.FloatTensor``, ...

Two parts, both undone on exit:

* :func:`cuda_on_cpu` - a ``TorchFunctionMode`` that rewrites every CUDA device argument of a torch call
  (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, ``device=`` keywords) to the CPU, makes
  ``Tensor.cuda()`` return the tensor itself, maps ``Tensor.type("torch.cuda.HalfTensor")`` to the CPU type,
  and reports ``Tensor.type()`` with CUDA names (tests compare against ``"torch.cuda.HalfTensor"``);
* :func:`patch_cuda_module` - ``torch.cuda.<Type>Tensor`` constructors become the CPU ones,
  ``synchronize``/``manual_seed``/``device(...)``/``current_device`` become CPU equivalents. ``is_available()``
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


def patch_cuda_module() -> Callable[[], None]:
    """Replace CUDA-only ``torch.cuda`` entry points by CPU equivalents; returns the function that undoes it."""
    saved: dict[str, Any] = {}

    def put(name: str, value: Any) -> None:
        saved[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, value)

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

    def undo() -> None:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)

    return undo
