"""Argument checks shared by the multi-tensor kernels: every failure names the problem and the fix."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "FLOAT_DTYPES",
    "KERNEL_DTYPES",
    "check_flag",
    "check_pairs",
    "check_scalar_tensor",
    "check_tensor_list",
    "common_device",
]

#: dtypes the Triton kernels handle natively; float64 tensors go to the torch path in float64 math.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = (*KERNEL_DTYPES, torch.float64)
_FLOAT_SET = frozenset(FLOAT_DTYPES)


def check_tensor_list(fn: str, name: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A list of dense floating-point tensors (fp16, bf16, fp32, fp64)."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got a single tensor; wrap it as [tensor].")
    out = list(tensors)
    for i, t in enumerate(out):
        # Fast path first: this runs for every tensor on every call.
        if isinstance(t, torch.Tensor) and t.dtype in _FLOAT_SET and t.layout == torch.strided:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name}[{i}] is a {type(t).__name__}, not a torch.Tensor.")
        if t.layout != torch.strided:
            raise TypeError(
                f"{fn}: {name}[{i}] has layout {t.layout}; only dense (strided) tensors are supported. "
                f"Coalesce sparse tensors and pass their .values()."
            )
        raise TypeError(
            f"{fn}: {name}[{i}] has dtype {t.dtype}; expected a floating dtype "
            f"(float16, bfloat16, float32 or float64). Integer, bool and complex tensors are not gradients."
        )
    return out


def common_device(fn: str, *lists: Sequence[torch.Tensor]) -> torch.device | None:
    """The one device of all tensors in ``lists`` (None when they are all empty)."""
    device = None
    for tensors in lists:
        for t in tensors:
            d = t.device
            if device is None:
                device = d
            elif d != device:
                raise ValueError(
                    f"{fn}: tensors are on mixed devices ({device} and {d}); one call handles one "
                    f"device. Group the tensors by device and call once per device."
                )
    return device


def check_pairs(fn: str, a_name: str, a: Sequence[torch.Tensor], b_name: str, b: Sequence[torch.Tensor]) -> None:
    """Two lists that correspond element by element: same length, same number of elements."""
    if len(a) != len(b):
        raise ValueError(f"{fn}: {a_name} has {len(a)} tensors but {b_name} has {len(b)}; they must pair up.")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(
                f"{fn}: {a_name}[{i}] has shape {tuple(x.shape)} but {b_name}[{i}] has shape {tuple(y.shape)}."
            )


def check_flag(fn: str, found_inf: torch.Tensor, device: torch.device | None, name: str = "found_inf") -> None:
    """``found_inf`` (or another accumulator): a one-element float32 tensor on the tensors' device."""
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a one-element float32 tensor, e.g. torch.zeros(1, device=...).")
    if found_inf.numel() != 1 or found_inf.dtype != torch.float32:
        raise ValueError(
            f"{fn}: {name} must be a one-element float32 tensor; got dtype {found_inf.dtype} "
            f"with {found_inf.numel()} elements."
        )
    if device is not None and found_inf.device != device:
        raise ValueError(f"{fn}: {name} is on {found_inf.device} but the tensors are on {device}.")


def check_scalar_tensor(fn: str, name: str, value: torch.Tensor, device: torch.device | None) -> None:
    """A one-element floating tensor on the tensors' device (read by the kernel: no host sync)."""
    if value.numel() != 1 or not value.is_floating_point():
        raise ValueError(
            f"{fn}: {name} must be a Python float or a one-element floating tensor; "
            f"got dtype {value.dtype} with {value.numel()} elements."
        )
    if device is not None and value.device != device:
        raise ValueError(f"{fn}: {name} is on {value.device} but the tensors are on {device}; move it there.")
