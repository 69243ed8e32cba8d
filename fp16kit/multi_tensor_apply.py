"""apex's ``multi_tensor_applier``: call an ``fp16kit.amp_C`` op on whole tensor lists.

Compatibility shim for ``from apex.multi_tensor_apply import multi_tensor_applier``::

    multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag, [grads, grads], 1.0 / world_size)

is ``op(chunk_size, noop_flag, tensor_lists, *args)``. The public fp16kit way is to call the list
kernels directly (``fp16kit.kernels.unscale_and_check``, ``l2norm``, ``copy_``; ``fp16kit.optim.functional``
for optimizer steps): they take no chunk size and report overflow in a float32 ``found_inf`` flag.
docs/migrating-from-apex.md maps each apex op to its fp16kit counterpart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Callable that prepends ``chunk_size`` to each op call (apex's class of the same name).

    ``available`` is always True: fp16kit's kernels need no compiled extension (Triton, or the torch
    fallback). ``chunk_size`` is passed on for apex's signature; fp16kit's kernels choose their own blocks,
    so results do not depend on it.
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        if int(chunk_size) != chunk_size or chunk_size <= 0:
            raise ValueError(f"MultiTensorApply: chunk_size must be a positive integer, got {chunk_size!r}.")
        self.chunk_size = int(chunk_size)

    def check_avail(self) -> None:
        """apex raised here when its CUDA extension was missing; fp16kit's ops are always available."""

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: torch.Tensor,
                 tensor_lists: Sequence[Sequence[torch.Tensor]], *args: Any) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


#: apex's default instance (chunks of 2048 * 32 elements).
multi_tensor_applier = MultiTensorApply(2048 * 32)
