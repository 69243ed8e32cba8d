"""``torch.nn.DataParallel`` runs its replicas in worker threads, outside the fp16kit region its caller opened
(fp16kit/amp/_threads.py): the first such replica warns once, naming the fixes, and the documented fix (the region
opened inside ``forward``) runs the replica under the region.

The worker is torch's ``_worker`` of ``torch/nn/parallel/parallel_apply.py``, which needs two CUDA devices; on the
CPU the same code shape runs in a thread from a function compiled under that file name (what the check looks at),
and the ``gpu`` test runs the real ``DataParallel`` where two GPUs are present.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from fp16kit import amp
from fp16kit.amp import _threads, autocast_mode

ENGINES = ("dispatch", "mode")

#: the shape of torch's worker: it re-enters torch's autocast state for the device (off here) and runs the replica
_WORKER_SOURCE = """
def _worker(module, x, out):
    with torch.autocast("cpu", enabled=False):
        out.append(module(x))
"""


def _fake_worker(filename: str):
    namespace = {"torch": torch}
    exec(compile(_WORKER_SOURCE, filename, "exec"), namespace)
    return namespace["_worker"]


TORCH_WORKER = _fake_worker("/site-packages/torch/nn/parallel/parallel_apply.py")
OTHER_WORKER = _fake_worker("/site-packages/mylib/threads.py")


def _in_thread(worker, module, x) -> torch.Tensor:
    out: list[torch.Tensor] = []
    t = threading.Thread(target=worker, args=(module, x, out))
    t.start()
    t.join(timeout=60)
    return out[0]


class Decorated(nn.Linear):
    @amp.autocast(dtype=torch.float16)
    def forward(self, x):
        return super().forward(x)


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    monkeypatch.setattr(_threads, "_WARNED", [])
    with autocast_mode.use_engine(request.param):
        yield request.param


def test_a_replica_thread_outside_the_region_warns_once_naming_the_fixes(engine):
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with amp.autocast(dtype=torch.float16):
        assert lin(x).dtype == torch.float16  # the caller's thread: the region
        with pytest.warns(autocast_mode.DataParallelRegionWarning, match=r"DataParallel.*inside the module's forward"):
            y = _in_thread(TORCH_WORKER, lin, x)
        assert y.dtype == torch.float32  # what the warning says: the replica ran outside the region
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _in_thread(TORCH_WORKER, lin, x)  # once per process
            # the documented fix: the replica's own thread opens the region
            assert _in_thread(TORCH_WORKER, Decorated(4, 4), x).dtype == torch.float16


def test_no_warning_without_an_open_region_or_outside_torchs_worker(engine):
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _in_thread(TORCH_WORKER, lin, x).dtype == torch.float32  # no region open anywhere
        with amp.autocast(dtype=torch.float16):
            assert _in_thread(OTHER_WORKER, lin, x).dtype == torch.float32  # not DataParallel's worker
            with torch.autocast("cpu", enabled=False):  # torch.autocast inside the region, on its own thread
                lin(x)
        assert _threads._OPEN[0] == 0  # the region closed: nothing open any more
    assert not _threads._WARNED


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel's worker threads need two CUDA devices")
def test_real_data_parallel_warns_and_the_decorated_forward_runs_under_the_region(engine):
    x = torch.randn(8, 4, device="cuda")
    with amp.autocast(dtype=torch.float16):
        with pytest.warns(autocast_mode.DataParallelRegionWarning):
            nn.DataParallel(nn.Linear(4, 4).cuda())(x)
        assert nn.DataParallel(Decorated(4, 4).cuda())(x).dtype == torch.float16
