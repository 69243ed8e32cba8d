"""apex.parallel on torch: ``DistributedDataParallel``, ``SyncBatchNorm``, ``convert_syncbn_model``, ``LARC``.

``DistributedDataParallel`` accepts apex's keyword arguments and runs torch's DDP (docs/migrating-from-apex.md
says which apex option maps to what). ``SyncBatchNorm`` synchronizes the batch statistics over the process
group, and unlike ``torch.nn.SyncBatchNorm`` it also trains on CPU tensors (gloo), so a distributed script
can be tested without a GPU. ``LARC`` is ``fp16kit.optim.LARC``. Names resolve lazily.

May import: ``fp16kit.distributed``, ``fp16kit._versions``, ``fp16kit._lazy``, and ``fp16kit.optim`` (its LARC, loaded
on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed as _dist

from .._lazy import lazy_exports

ReduceOp = _dist.ReduceOp

_EXPORTS = {
    "DistributedDataParallel": ".distributed",
    "SyncBatchNorm": ".sync_batchnorm",
    "convert_syncbn_model": ".sync_batchnorm",
}

__all__ = sorted([*_EXPORTS, "LARC", "ReduceOp"])

_getattr, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "LARC":
        optim = importlib.import_module("fp16kit.optim")
        try:
            larc = optim.LARC
        except AttributeError:
            raise AttributeError(
                "fp16kit.parallel.LARC is fp16kit.optim.LARC, which this fp16kit does not have yet "
                "(fp16kit/optim/larc.py is missing); wrap your optimizer without LARC or update fp16kit."
            ) from None
        globals()["LARC"] = larc
        return larc
    return _getattr(name)
