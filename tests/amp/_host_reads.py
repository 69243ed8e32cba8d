"""Test helper: catch every read of a tensor value back to the host (the thing a GPU would sync on).

Shared by the LossScaler and GradScaler tests. A read of a *CPU* tensor made inside
``fp16kit/kernels/`` (the torch fallback may inspect a CPU scalar to pick a path) is not a device
sync and is not the scaler's doing, so it is let through; every other read is counted or refused.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

SYNC_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
_KERNELS_DIR = os.path.join("fp16kit", "kernels") + os.sep
#: the scalers' named readers of one-element CPU tensors (host memory, not a device sync)
_CPU_READERS = frozenset(("_cpu_scalar_at_most_one", "_cpu_scalar"))


@contextmanager
def count_host_reads(*, forbid: bool) -> Iterator[list[str]]:
    """Patch the Tensor methods that read values back; yield the list of calls (or raise on the first)."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def make(name):
        def patched(self, *args, **kwargs):
            frame = sys._getframe(1).f_code
            # the scalers read CPU scalars (host memory, not a device sync) in named functions only
            exempt = self.device.type == "cpu" and (
                _KERNELS_DIR in frame.co_filename or frame.co_name in _CPU_READERS
            )
            if not exempt:
                if forbid:
                    raise AssertionError(f"host sync: Tensor.{name}() called from {frame.co_filename}")
                calls.append(name)
            return originals[name](self, *args, **kwargs)

        return patched

    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, make(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
