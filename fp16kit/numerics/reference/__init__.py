"""float64 reference implementations of every fp16kit kernel (the spec, readable and slow).

``kernels``: unscale-and-check, L2 norm, cast copy, and the exact rounding they use.
``histogram``: the exponent histogram (numpy ``frexp``).
``optim``: LAMB (apex's FusedLAMB math) and Adam/AdamW.
``optim_apex``: apex's FusedSGD, FusedAdagrad, FusedNovoGrad and LARC's gradient rewrite.
"""

from .histogram import exponent_histogram
from .kernels import UnscaleResult, copy, l2norm, round_to_format, unscale_and_check
from .optim import adam_step, global_grad_norm, lamb_step  # noqa: F401  (re-exported)
from .optim_apex import adagrad_step, larc_grads, novograd_step, sgd_step  # noqa: F401  (re-exported)

__all__ = ["UnscaleResult", "copy", "exponent_histogram", "l2norm", "round_to_format", "unscale_and_check"]
