"""apex-style amp under the HF ``transformers.Trainer``: :class:`AmpTrainer`.

The stock Trainer owns the backward (``accelerator.backward(loss)``) and the clipping
(``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)``, default ``max_grad_norm=1.0``), so an
``amp.initialize``'d model and optimizer passed to it train wrongly: no loss scaling at all under O1, nothing at all
under O2, and with a ``scale_loss`` override of ``training_step`` the clipping acts on the scaled fp16 grads (updates
far too small; logged ``grad_norm`` = scale x the true norm). fp16kit warns on each of those (docs/trainer.md);
``AmpTrainer`` does it right::

    from fp16kit.integrations.transformers import AmpTrainer
    from fp16kit.optim import FusedLAMB

    trainer = AmpTrainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0), train_dataset=ds,
                         optimizers=(FusedLAMB(model.parameters(), lr=1e-3), None), opt_level="O2")
    trainer.train()                                   # or train(resume_from_checkpoint=...)

What it changes, and nothing else (the Trainer's data, loss normalisation, schedules, logging and checkpoints stay
the stock ones):

* ``amp.initialize(model, optimizer, opt_level, **amp_options)`` when the Trainer creates its optimizer (the one
  passed in ``optimizers=`` or the default one), before accelerate wraps either;
* every backward runs inside ``amp.scale_loss`` (``delay_unscale=True`` for all but the last micro-batch of a
  gradient-accumulation step, apex's recipe);
* ``accelerator.clip_grad_norm_`` on the model's parameters clips and measures the unscaled fp32 master grads
  (``amp.master_params``): ``max_grad_norm`` clips the real gradient and the logged ``grad_norm`` is the real norm
  (inf on an overflowed step);
* an overflowed step is skipped by amp (on the device with fp16kit's fused optimizers) and the scale backs off;
* the amp state (loss scale, growth and hysteresis trackers) is saved as ``amp_state.pt`` next to the optimizer in
  every Trainer checkpoint and restored on ``train(resume_from_checkpoint=...)``: with the optimizer's fp32 masters
  (in its own state) the resumed run continues bit for bit.

Not combined with ``TrainingArguments(fp16=True / bf16=True)`` (torch autocast + GradScaler through accelerate: that
route needs no AmpTrainer, pass fp16kit's optimizers to the stock Trainer), DeepSpeed or FSDP (they bring their own
mixed precision): each raises. accelerate does not learn that amp skipped a step, so the LR scheduler steps on
skipped steps too, as in apex scripts.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "fp16kit.integrations.transformers needs the transformers package: pip install 'fp16kit[hf]'."
    ) from exc

from .. import amp
from ._amp_hooks import clip_master_grads, same_params, scaled_backward

__all__ = ["AMP_STATE_NAME", "AmpTrainer"]

#: the file, next to the optimizer's, that holds ``amp.state_dict()`` in each checkpoint
AMP_STATE_NAME = "amp_state.pt"


class AmpTrainer(Trainer):
    """A ``transformers.Trainer`` with apex-style amp at ``opt_level`` (module docstring).

    Args:
        *args, **kwargs: the Trainer's own.
        opt_level: ``"O0"``-``"O3"`` (``"O2"``: fp16 model, fp32 masters; ``"O1"``: per-op casts).
        amp_options: further keywords for ``amp.initialize`` (``loss_scale``, ``min_loss_scale``,
            ``low_precision_dtype``, ``verbosity``, ...; ``verbosity`` defaults to 1, apex's).

    Raises:
        ValueError: ``args.fp16`` or ``args.bf16`` is set (that route is the stock Trainer's; both at once would scale
            twice).
        NotImplementedError: DeepSpeed or FSDP is configured.
    """

    def __init__(self, *args: Any, opt_level: str = "O2", amp_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self.opt_level = opt_level
        self.amp_options = dict(amp_options or {})
        super().__init__(*args, **kwargs)
        if self.args.fp16 or self.args.bf16:
            raise ValueError(
                "AmpTrainer runs apex-style amp itself; TrainingArguments(fp16=True / bf16=True) would add torch "
                "autocast and a GradScaler on top of it (the loss scaled twice). Drop fp16/bf16 from the arguments, "
                "or use the stock Trainer with fp16=True / bf16=True and fp16kit's optimizers (docs/trainer.md)."
            )
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            raise NotImplementedError(
                "AmpTrainer does not combine with DeepSpeed or FSDP, which bring their own mixed precision; use their "
                "settings (or Trainer(bf16=True)) with those backends."
            )

    # ------------------------------------------------------------------ set-up
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with its ``backward`` and ``clip_grad_norm_`` routed through amp."""
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        backward, clip = acc.backward, acc.clip_grad_norm_

        def amp_backward(loss: torch.Tensor, **kwargs: Any) -> Any:
            if not _initialized(self.optimizer):
                return backward(loss, **kwargs)
            return scaled_backward(backward, loss, self.optimizer, last_micro_batch=bool(acc.sync_gradients),
                                   **kwargs)

        def amp_clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
            ours, params = same_params(parameters, self.model)
            if not ours or not _initialized(self.optimizer):
                return clip(params, max_norm, norm_type)
            return clip_master_grads(self.optimizer, float(max_norm), norm_type)

        acc.backward = amp_backward
        acc.clip_grad_norm_ = amp_clip_grad_norm_

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """The Trainer's optimizer (``optimizers=`` or its default), passed through ``amp.initialize`` once, with the
        model, before accelerate wraps them."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if not _initialized(self.optimizer):
            options = {"verbosity": 1, **self.amp_options}
            amp.initialize(self.model, self.optimizer, opt_level=self.opt_level, **options)
        return optimizer

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if _initialized(self.optimizer) and self.args.should_save:
            torch.save(amp.state_dict(optimizer=self.optimizer), os.path.join(output_dir, AMP_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or not _initialized(self.optimizer):
            return
        path = os.path.join(checkpoint, AMP_STATE_NAME)
        if os.path.isfile(path):
            amp.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), optimizer=self.optimizer)
        else:
            warnings.warn(
                f"AmpTrainer: the checkpoint {checkpoint} has no {AMP_STATE_NAME} (written by the stock Trainer?): "
                "the loss scale starts again from its initial value, so the resumed run is not bit-identical.",
                RuntimeWarning,
                stacklevel=2,
            )


def _initialized(optimizer: Any) -> bool:
    """Has ``optimizer`` (or the optimizer inside accelerate's wrapper) been through ``amp.initialize``?"""
    for _ in range(8):
        if optimizer is None:
            return False
        if getattr(optimizer, "_amp_stash", None) is not None:
            return True
        optimizer = getattr(optimizer, "optimizer", None)
    return False
