"""fp16kit where people train: the HF ``transformers.Trainer``, ``accelerate`` and PyTorch Lightning.

* ``fp16kit.integrations.transformers.AmpTrainer``: a ``transformers.Trainer`` with apex-style amp (O1/O2) done
  right: loss scaling around the Trainer's backward, gradient clipping and the logged grad norm on the unscaled
  fp32 master gradients, overflowed steps skipped on the device, amp state saved in and restored from the
  Trainer's checkpoints.
* ``fp16kit.integrations.accelerate``: ``backward`` and ``clip_grad_norm_`` for apex-style amp on
  ``accelerator.prepare``'d models and optimizers.
* ``fp16kit.integrations.lightning.AmpPrecision``: a Lightning precision plugin running fp16kit's autocast +
  GradScaler or apex-style O1/O2, with clipping on unscaled gradients and the amp state in Lightning's
  checkpoints (docs/ecosystem.md).

Torch-style mixed precision (``Trainer(fp16=True / bf16=True)``, ``Accelerator(mixed_precision=...)``) needs no
integration: pass fp16kit's optimizers and it works (docs/trainer.md). Importing this package imports neither
transformers, accelerate nor lightning (``integrations.transformers`` imports transformers,
``integrations.lightning`` lightning; ``integrations.accelerate`` needs only the accelerator object it is given).

May import: ``fp16kit.amp``, ``fp16kit.optim`` and the frameworks they integrate with; nothing of fp16kit
imports the integrations.
"""

from __future__ import annotations

__all__: list[str] = []
