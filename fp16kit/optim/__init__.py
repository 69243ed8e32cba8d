"""fp16kit.optim: FusedLAMB (apex-exact) and FusedAdam on multi-tensor Triton kernels.

Names resolve lazily to their defining module.

May import: ``fp16kit.kernels`` (its public names), ``fp16kit.distributed``, ``fp16kit.numerics``,
``fp16kit._versions``, ``fp16kit._lazy``; never ``fp16kit.amp`` (amp drives the optimizers, not the other way round).
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "FusedLAMB": ".lamb",
    "FusedAdam": ".adam",
    "lamb_step_": ".functional",
    "adam_step_": ".functional",
    "FusedSGD": ".sgd",
    "FusedAdagrad": ".adagrad",
    "FusedNovoGrad": ".novograd",
    "FusedMixedPrecisionLamb": ".mixed_lamb",
    "LARC": ".larc",
    "to_torch_state_dict": ".torch_state",
    "from_torch_state_dict": ".torch_state",
    "fp32_params": ".torch_state",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
