"""Run a function in N fresh processes joined by a gloo group on 127.0.0.1, with a hard timeout.

``run(fn, world, out_dir, timeout)`` starts ``fn(rank, world, out_dir)`` in ``world`` spawned processes
(``torch.multiprocessing``), each with ``torch.distributed`` initialised (gloo on the loopback interface) and
one torch thread. The ranks meet through a ``file://`` store in ``out_dir`` (a fresh file per run), not a TCP
port: picking a free port by binding port 0 and closing it races with every other process on the machine
(another test, another user) that may take the port before rank 0 binds it again — the SIGABRT of issue 22.
A process that has not finished when the timeout expires is killed and the run fails
with the tail of every rank's log, so a hung collective can never hang CI.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def store_file(out_dir: str | Path) -> str:
    """A rendezvous file path in ``out_dir`` that no earlier run used (``file://`` init: no port to race for)."""
    return os.path.join(str(out_dir), f"rendezvous-{uuid.uuid4().hex}")


def init_gloo(rank: int, world: int, store: str, timeout: float = 120.0) -> None:
    """``torch.distributed`` over gloo on 127.0.0.1 (the loopback interface only), meeting through ``store``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"file://{store}", timeout=datetime.timedelta(seconds=timeout)
    )


def _entry(rank: int, fn: Callable, world: int, store: str, out_dir: str) -> None:
    log = open(os.path.join(out_dir, f"log{rank}.txt"), "w")  # noqa: SIM115
    sys.stdout = sys.stderr = log
    torch.set_num_threads(1)
    init_gloo(rank, world, store)
    try:
        fn(rank, world, out_dir)
        dist.barrier()  # every rank done before any tears gloo down (a peer's teardown can abort a busy rank)
    except BaseException:
        traceback.print_exc()
        log.flush()
        raise
    finally:
        dist.destroy_process_group()
        log.flush()


def run(fn: Callable[[int, int, str], None], world: int, out_dir: str | Path, timeout: float) -> None:
    """Run ``fn`` on ``world`` ranks; raise AssertionError (with the logs) on failure or timeout."""
    out_dir = str(out_dir)
    ctx = mp.start_processes(_entry, args=(fn, world, store_file(out_dir), out_dir), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    error = None
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                error = f"timed out after {timeout:.0f} s"
                break
    except Exception as e:  # a rank raised: ProcessRaisedException / ProcessExitedException
        error = f"{type(e).__name__}: {e}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    if error is not None:
        logs = "\n".join(
            f"--- rank {r} ---\n{Path(out_dir, f'log{r}.txt').read_text()[-3000:]}"
            for r in range(world) if Path(out_dir, f"log{r}.txt").exists()
        )
        raise AssertionError(f"{world}-process run failed: {error}\n{logs}")
