"""``python -m fp16kit info``: what is installed and which kernel backend each device uses."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from .kernels.backend import interpreter_active, select_backend, triton_available


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def devices() -> list[torch.device]:
    """The CPU and every visible CUDA device."""
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return found


def report() -> str:
    """A human-readable report; every device line names its kernel backend and the reason."""
    from . import __version__

    lines = [
        f"fp16kit {__version__}",
        f"python  {platform.python_version()} ({platform.system()} {platform.machine()})",
        f"torch   {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"triton  {_version('triton') if triton_available() else 'not installed'}"
        + (" [interpreter mode: TRITON_INTERPRET=1]" if interpreter_active() else ""),
        "",
        "devices and kernel backend:",
    ]
    for dev in devices():
        name = "CPU" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
        try:
            choice = select_backend(dev)
            line = f"  {dev!s:8} {name}: backend = {choice.backend.value} ({choice.reason})"
        except RuntimeError as err:  # a forced backend that cannot run here
            line = f"  {dev!s:8} {name}: backend = unavailable ({err})"
        lines.append(line)
    return "\n".join(lines)
