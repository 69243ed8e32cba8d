"""apex's ``DistributedDataParallel`` signature on ``torch.nn.parallel.DistributedDataParallel``.

Mapping (apex option -> what runs):

* ``message_size`` (elements per all-reduce bucket) -> ``bucket_cap_mb = message_size * 4 bytes / 2**20``;
* ``delay_allreduce=True`` (one all-reduce after the whole backward) -> one bucket holding every parameter;
* ``allreduce_always_fp32``, ``gradient_average``, ``gradient_predivide_factor`` -> a DDP communication hook
  with apex's order of operations: cast the bucket to fp32 (``allreduce_always_fp32``), multiply by
  ``1 / gradient_predivide_factor``, all-reduce (sum), multiply by ``gradient_predivide_factor / world_size``
  (only with ``gradient_average``), cast back. With the defaults torch's own averaging runs (no hook);
* ``shared_param`` -> ``ValueError``, as in apex;
* ``allreduce_trigger_params``, ``retain_allreduce_buffers``, ``num_allreduce_streams > 1``,
  ``allreduce_communicators``, ``gradient_average_split_factor``, ``prof=True``: no torch equivalent; each
  warns once per process and is ignored (gradients are the same, only scheduling differs).

Like apex, buffers are not synchronized before each forward (``forward_sync_buffers=False``, or
``broadcast_buffers=False`` on older torch); any other torch DDP
keyword (``find_unused_parameters``, ``broadcast_buffers``, ...) is passed through.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import _versions

__all__ = ["DistributedDataParallel"]

_warned: set[str] = set()

_NO_EQUIVALENT = {
    "allreduce_trigger_params": "torch DDP starts a bucket's all-reduce when the bucket is ready",
    "retain_allreduce_buffers": "torch DDP writes the reduced values into param.grad",
    "num_allreduce_streams": "torch DDP uses one communication stream",
    "allreduce_communicators": "torch DDP uses its process group",
    "gradient_average_split_factor": "apex ignored it too; use gradient_predivide_factor",
    "prof": "use torch.profiler",
}


def _warn_once(option: str) -> None:
    if option not in _warned:
        _warned.add(option)
        warnings.warn(
            f"fp16kit.parallel.DistributedDataParallel: apex option {option!r} has no torch equivalent and is "
            f"ignored ({_NO_EQUIVALENT[option]}).", stacklevel=3,
        )


class _HookState:
    def __init__(self, group: Any, fp32: bool, average: bool, predivide: float) -> None:
        self.group, self.fp32, self.average, self.predivide = group, fp32, average, predivide


def _apex_allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch checks real annotations, if any
    """apex's all-reduce of one bucket: [fp32 cast], ``* 1/predivide``, sum, [``* predivide/world``], cast back.

    ``state``: a :class:`_HookState`; ``bucket``: a ``dist.GradBucket``; returns a future of the bucket buffer.
    """
    buf = bucket.buffer()
    work = buf.float() if state.fp32 and buf.dtype != torch.float32 else buf
    if state.predivide != 1.0:
        work.mul_(1.0 / state.predivide)
    world = dist.get_world_size(state.group)
    fut = dist.all_reduce(work, group=state.group, async_op=True).get_future()

    def finish(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        if state.average:
            out.mul_(state.predivide / world)
        if out is not buf:
            buf.copy_(out)
        return buf

    return fut.then(finish)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch DDP constructed from apex's arguments (see the module docstring for the mapping).

    Call ``torch.distributed.init_process_group`` first; wrap the model after ``amp.initialize`` (apex's rule).
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 10000000,
        delay_allreduce: bool = False,
        shared_param: Any = None,
        allreduce_trigger_params: Any = None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators: Any = None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor: float | None = None,
        prof: bool = False,
        **torch_kwargs: Any,
    ) -> None:
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported (as in apex): overlapping communication works with shared "
                "parameters. To reduce only after the whole backward, pass delay_allreduce=True."
            )
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 may only be used with delay_allreduce=False (as in apex).")
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError("allreduce_trigger_params is only valid with delay_allreduce=False (as in apex).")
        if int(message_size) <= 0 or gradient_predivide_factor <= 0:
            raise ValueError(f"message_size and gradient_predivide_factor must be positive, got {message_size} and "
                             f"{gradient_predivide_factor}.")
        given = {
            "allreduce_trigger_params": allreduce_trigger_params is not None,
            "retain_allreduce_buffers": bool(retain_allreduce_buffers),
            "num_allreduce_streams": num_allreduce_streams != 1,
            "allreduce_communicators": allreduce_communicators is not None,
            "gradient_average_split_factor": gradient_average_split_factor is not None,
            "prof": bool(prof),
        }
        for option, used in given.items():
            if used:
                _warn_once(option)
        if delay_allreduce:
            nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
            bucket_mb = max(nbytes / 2**20 * 2, 1.0)  # one bucket: the all-reduce starts after the last grad
        else:
            bucket_mb = int(message_size) * 4 / 2**20
        torch_kwargs.setdefault("bucket_cap_mb", bucket_mb)
        if "broadcast_buffers" not in torch_kwargs and "forward_sync_buffers" not in torch_kwargs:
            # apex did not sync buffers before each forward (newer torch spells this forward_sync_buffers)
            torch_kwargs[_versions.ddp_sync_buffers_arg()] = False
        super().__init__(module, **torch_kwargs)
        self.message_size = int(message_size)
        self.delay_allreduce = bool(delay_allreduce)
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        if allreduce_always_fp32 or not gradient_average or gradient_predivide_factor != 1.0:
            state = _HookState(self.process_group, self.allreduce_always_fp32, self.gradient_average,
                               self.gradient_predivide_factor)
            self.register_comm_hook(state, _apex_allreduce_hook)
