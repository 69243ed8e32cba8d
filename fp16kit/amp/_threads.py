"""fp16kit regions belong to the thread that opened them; torch's ``DataParallel`` worker threads say so.

``torch.nn.DataParallel`` runs its replicas in threads (``_worker`` in ``torch/nn/parallel/parallel_apply.py``)
and re-enters only torch's own autocast state there (``torch.autocast(device_type, enabled=...)`` with torch's
default dtype). A region opened around the ``DataParallel`` call is not in those threads: the replicas run under
torch's table (dispatcher engine) or with nothing cast (mode engine). fp16kit cannot re-enter the region there (the
worker does not know which thread started it), so the first such ``torch.autocast`` entered while a region is open
on another thread warns once, naming the fixes: open the region inside the module's ``forward`` (the replicas' own
threads then open it), or train with ``DistributedDataParallel``/FSDP2. ``autocast_mode`` counts the open
outermost regions (:func:`opened`, :func:`closed`) and calls :func:`check_worker` from its ``torch.autocast`` hook
when this thread has none.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["DataParallelRegionWarning", "check_worker", "closed", "opened"]

_OPEN = [0]  # outermost regions open on any thread (a hint for the warning: exactness is not needed)
_WARNED: list[bool] = []


class DataParallelRegionWarning(UserWarning):
    """A ``DataParallel`` replica runs outside the fp16kit region its caller opened."""


def opened() -> None:
    _OPEN[0] += 1


def closed() -> None:
    _OPEN[0] = max(0, _OPEN[0] - 1)


def _in_parallel_apply_worker(depth: int = 6) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_worker" and code.co_filename.replace("\\", "/").endswith("nn/parallel/parallel_apply.py"):
            return True
        frame = frame.f_back
    return False


def check_worker() -> None:
    """Called when a ``torch.autocast`` is entered on a thread without a region: warn once if a region is open
    elsewhere and this is a ``DataParallel`` worker."""
    if not _OPEN[0] or _WARNED or not _in_parallel_apply_worker():
        return
    _WARNED.append(True)
    warnings.warn(
        "torch.nn.DataParallel runs its replicas in worker threads, and an fp16kit.amp.autocast region belongs to "
        "the thread that opened it: the replicas' forward runs outside the region (torch's own autocast state only). "
        "Open the region inside the module's forward (decorate forward with @fp16kit.amp.autocast(...), or a `with` "
        "block in it), or train with DistributedDataParallel / FSDP2 (one process per device).",
        DataParallelRegionWarning,
        stacklevel=2,
    )
