"""What ``amp.initialize`` does to the models: checks, casting, forward hooks, fp32 ``state_dict``.

* ``check_models``: a model already wrapped in DataParallel / DistributedDataParallel is an error (the
  wrapper must see the cast parameters, so it is applied after ``initialize``); a model that already
  went through ``initialize`` is an error; low-precision parameters are an error (apex's rule: never
  call ``.half()`` yourself).
* ``cast_model``: parameters and buffers to ``cast_model_type``, except batchnorm modules with affine
  parameters when ``keep_batchnorm_fp32`` (their fp32 statistics are what makes fp16 batchnorm safe;
  PyTorch's batch_norm accepts low-precision input with fp32 parameters on CPU and GPU).
* ``install_forward_hooks``: floating inputs are cast to the model type on the way into ``forward``,
  floating outputs to fp32 (or ``cast_model_outputs``); under O1 ``forward`` runs inside the cast
  policy (``autocast``). These are module hooks rather than a replaced ``forward`` attribute, so a
  ``copy.deepcopy`` of the model behaves like the model (apex's patched ``forward`` kept calling the
  original module's).
* ``install_fp32_state_dict``: ``model.state_dict()`` returns fp32 tensors in place of the cast ones,
  so checkpoints do not depend on the opt level.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .._apex_state import low_precision_models_allowed

__all__ = ["cast_model", "check_models", "install_forward_hooks", "install_fp32_state_dict"]

_MARK = "_fp16kit_amp_initialized"
LOW_DTYPES = (torch.float16, torch.bfloat16)


def _parallel_wrappers() -> list[tuple[type, str]]:
    wrappers: list[tuple[type, str]] = [
        (nn.parallel.DistributedDataParallel, "torch.nn.parallel.DistributedDataParallel"),
        (nn.DataParallel, "torch.nn.parallel.DataParallel"),
    ]
    try:  # FSDP shards the parameters: casting must happen before it, too
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers.append((FullyShardedDataParallel, "torch.distributed.fsdp.FullyShardedDataParallel"))
    except ImportError:  # pragma: no cover - builds without distributed
        pass
    return wrappers


def check_models(models: list[nn.Module]) -> None:
    """Raise for parallel-wrapped models, models seen before, and low-precision parameters."""
    for model in models:
        if not isinstance(model, nn.Module):
            raise TypeError(f"models must be torch.nn.Module instances (or a list of them), got {type(model)}.")
        for cls, name in _parallel_wrappers():
            if isinstance(model, cls):
                raise RuntimeError(
                    f"Incoming model is an instance of {name}. Parallel wrappers should only be applied to the "
                    "model(s) AFTER \nthe model(s) have been returned from amp.initialize."
                )
        if getattr(model, _MARK, False):
            raise RuntimeError(
                "This model was already passed through amp.initialize. Call amp.initialize once per model "
                "(build a fresh model, or keep using the one it returned)."
            )
        for name, param in model.named_parameters():
            if param.dtype in LOW_DTYPES and not low_precision_models_allowed():
                raise RuntimeError(
                    f"Found param {name} with type {param.type()}, expected a float32 parameter.\n"
                    "When using amp.initialize, you do not need to call .half() on your model\n"
                    "before passing it, no matter what optimization level you choose."
                )


def _is_kept_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine


def cast_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Cast floating parameters, their grads and buffers to ``dtype`` in place (same Parameter objects)."""
    for module in model.modules():
        if keep_batchnorm_fp32 and _is_kept_batchnorm(module):
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
                if param.grad is not None and param.grad.is_floating_point():
                    param.grad = param.grad.to(dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(module, name, buf.to(dtype))
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()


def _cast(value: Any, dtype: torch.dtype, only: tuple[torch.dtype, ...] | None) -> Any:
    """Cast floating tensors inside ``value`` (tensors, mappings, sequences, namedtuples, custom batch
    objects with ``.to``) to ``dtype``; ``only`` restricts which source dtypes are cast."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and (only is None or value.dtype in only):
            return value.to(dtype)
        return value
    if isinstance(value, (str, bytes, np.ndarray, nn.Module)):
        return value
    if isinstance(value, Mapping):
        items = {k: _cast(v, dtype, only) for k, v in value.items()}
        try:
            return type(value)(items)
        except TypeError:  # a mapping type without a dict constructor (defaultdict): a plain dict
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_cast(v, dtype, only) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype, only) for v in value)
    if only is None and callable(getattr(value, "to", None)):  # custom batch classes, as apex allows
        return value.to(dtype)
    return value


def _input_hook(dtype: torch.dtype, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return _cast(args, dtype, None), _cast(kwargs, dtype, None)


def _output_hook(dtype: torch.dtype, only: tuple[torch.dtype, ...] | None, module: nn.Module, args: tuple,
                 output: Any) -> Any:
    return _cast(output, dtype, only)


class _PolicyRegion:
    """Enter the cast policy before ``forward`` and leave it after (also when ``forward`` raises).

    The stack of open regions is per thread (DataParallel runs replicas, which share these hooks, in threads;
    autocast state is per thread too), so re-entrant and concurrent calls nest correctly. Copies and pickles
    keep only the dtype.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._local = threading.local()

    def _stack(self) -> list[Any]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        from .. import autocast

        region = autocast(dtype=self.dtype)
        region.__enter__()
        self._stack().append(region)

    def exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        stack = self._stack()
        if stack:
            stack.pop().__exit__(None, None, None)

    def __deepcopy__(self, memo: dict) -> _PolicyRegion:
        return _PolicyRegion(self.dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["dtype"])


def install_forward_hooks(
    model: nn.Module,
    *,
    input_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None,
    output_only: tuple[torch.dtype, ...] | None,
    policy_dtype: torch.dtype | None,
) -> None:
    """Hooks on the root module: inputs to ``input_dtype``, outputs to ``output_dtype`` (only outputs whose
    dtype is in ``output_only``, when given), ``forward`` inside ``autocast(policy_dtype)``."""
    if policy_dtype is not None:
        region = _PolicyRegion(policy_dtype)
        model.register_forward_pre_hook(region.enter, with_kwargs=True, prepend=True)
        model.register_forward_hook(region.exit, always_call=True)
    if input_dtype is not None:
        model.register_forward_pre_hook(functools.partial(_input_hook, input_dtype), with_kwargs=True, prepend=True)
    if output_dtype is not None:
        model.register_forward_hook(functools.partial(_output_hook, output_dtype, output_only))
    setattr(model, _MARK, True)


def _fp32_state_dict_hook(cast_dtype: torch.dtype, module: nn.Module, state_dict: dict, prefix: str,
                          local_metadata: Any) -> None:
    for key, value in state_dict.items():
        if key.startswith(prefix) and isinstance(value, torch.Tensor) and value.dtype == cast_dtype:
            state_dict[key] = value.to(torch.float32)


def install_fp32_state_dict(model: nn.Module, cast_dtype: torch.dtype) -> None:
    """``state_dict()`` of the model (and of any submodule) holds fp32 in place of ``cast_dtype`` tensors."""
    for module in model.modules():
        module._register_state_dict_hook(functools.partial(_fp32_state_dict_hook, cast_dtype))
