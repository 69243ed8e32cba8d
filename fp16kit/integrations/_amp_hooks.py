"""What apex-style amp needs from a trainer that owns the backward and the clipping (shared by the transformers and
accelerate integrations): a backward inside ``amp.scale_loss``, and a clip / norm on the unscaled fp32 master grads."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .. import amp

__all__ = ["clip_master_grads", "patched", "same_params", "scaled_backward"]


def scaled_backward(backward: Callable[..., Any], loss: torch.Tensor, optimizer: Any, *, last_micro_batch: bool,
                    **kwargs: Any) -> None:
    """``backward(scaled_loss, **kwargs)`` inside ``amp.scale_loss(loss, optimizer)``.

    Micro-batches before the last one of a gradient-accumulation step use ``delay_unscale=True`` (the scaled grads
    add up; apex's recipe, and fp16kit's fused O2 path stays fused); the last one unscales and checks the sum, updates
    the loss scale and arms the (device-side) skip of an overflowed step.
    """
    with amp.scale_loss(loss, optimizer, delay_unscale=not last_micro_batch) as scaled:
        backward(scaled, **kwargs)


def clip_master_grads(optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Total ``norm_type``-norm of the unscaled fp32 master grads of ``optimizer`` (``amp.master_params``), clipped to
    ``max_norm`` in place unless it is inf (then only measured: no pass over the grads). Returns the pre-clip norm
    as a device tensor (inf/NaN on an overflowed step, which amp skips anyway)."""
    params = [p for p in amp.master_params(optimizer) if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm != float("inf"):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    grads = [p.grad for p in params]
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: what clip_grad_norm_ computes
        return torch.nn.utils.get_total_norm(grads, norm_type)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)


@contextlib.contextmanager
def patched(obj: Any, name: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``obj.name = replacement`` (an instance attribute) for the duration; what was there before comes back."""
    own = vars(obj)
    had, old = name in own, own.get(name)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def same_params(given: Iterable[torch.Tensor], model: torch.nn.Module) -> tuple[bool, list[torch.Tensor]]:
    """``(are the given tensors the model's parameters (a subset), the given tensors as a list)``."""
    params = list(given)
    ids = {id(p) for p in model.parameters()}
    return bool(params) and all(id(p) in ids for p in params), params
