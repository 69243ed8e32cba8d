"""apex-style amp with HF ``accelerate``: :func:`backward`, :func:`clip_grad_norm_` and :class:`AmpState`.

``accelerator.backward(loss)`` runs a plain backward, so an ``amp.initialize``'d model and optimizer get no loss
scaling (O1; fp16kit warns) or no update at all (O2; fp16kit warns); ``accelerator.clip_grad_norm_(
model.parameters(), ...)`` clips the fp16 model grads, not the fp32 masters the optimizer steps. The recipe::

    from fp16kit import amp
    from fp16kit.integrations import accelerate as amp_accelerate

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")         # before prepare (DDP wraps after)
    accelerator = Accelerator(gradient_accumulation_steps=2)                    # mixed_precision="no": amp does it
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    accelerator.register_for_checkpointing(amp_accelerate.AmpState(optimizer))  # amp state in save_state/load_state
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            amp_accelerate.backward(accelerator, loss, optimizer)              # scale_loss around accelerator.backward
            if accelerator.sync_gradients:
                amp_accelerate.clip_grad_norm_(optimizer, 1.0)                 # the unscaled fp32 master grads
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Torch-style mixed precision needs none of this: ``Accelerator(mixed_precision="fp16" / "bf16")`` with fp16kit's
optimizers, ``accelerator.backward`` and ``accelerator.clip_grad_norm_`` work as they are (docs/trainer.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .. import amp
from ._amp_hooks import clip_master_grads, scaled_backward

__all__ = ["AmpState", "backward", "clip_grad_norm_"]


def backward(accelerator: Any, loss: torch.Tensor, optimizer: Any, **kwargs: Any) -> None:
    """``accelerator.backward(loss, **kwargs)`` inside ``amp.scale_loss(loss, optimizer)``.

    Within ``accelerator.accumulate`` the micro-batches that do not sync use ``delay_unscale=True`` (the scaled
    grads add up); the one that syncs unscales and checks the sum, updates the loss scale and arms the skip of an
    overflowed step. ``optimizer`` may be the prepared (wrapped) one.

    Raises:
        ValueError: the accelerator was built with ``mixed_precision`` other than ``"no"`` (its autocast and
            GradScaler would come on top of amp's: the loss scaled twice).
    """
    mixed = getattr(accelerator, "mixed_precision", "no")
    if mixed not in (None, "no") or getattr(accelerator, "scaler", None) is not None:
        raise ValueError(
            f"fp16kit.integrations.accelerate.backward: the Accelerator runs mixed_precision={mixed!r} (torch autocast "
            "and, for fp16, a GradScaler), and amp.initialize does mixed precision too: the loss would be scaled "
            "twice. Use Accelerator(mixed_precision='no') with amp, or drop amp and use accelerator.backward with "
            "fp16kit's optimizers (docs/trainer.md)."
        )
    scaled_backward(accelerator.backward, loss, optimizer, last_micro_batch=bool(accelerator.sync_gradients),
                    **kwargs)


def clip_grad_norm_(optimizer: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the unscaled fp32 master grads of ``optimizer`` (``amp.master_params``) to ``max_norm`` and return their
    total norm before clipping (``max_norm=inf``: only measure). Call it when ``accelerator.sync_gradients``, after
    :func:`backward`; under DDP every rank holds the same all-reduced grads, so every rank gets the same norm."""
    return clip_master_grads(optimizer, float(max_norm), norm_type)


class AmpState:
    """The amp state (loss scale and its trackers) of the ``amp.initialize`` call that processed ``optimizer``, as an
    object ``accelerator.register_for_checkpointing`` accepts: ``save_state`` stores it, ``load_state`` restores
    it, so a resumed run continues bit for bit (the fp32 masters travel in the optimizer's own state)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def state_dict(self) -> OrderedDict:
        return amp.state_dict(optimizer=self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        amp.load_state_dict(state_dict, optimizer=self.optimizer)
