"""float64 reference implementations of every fp16kit kernel (the spec, readable and slow).

``kernels``: unscale-and-check, L2 norm, cast copy, and the exact rounding they use.
``ops``: softmax, log-softmax, layer and RMS norm, GELU (erf and tanh), cross-entropy, and a matmul with the
magnitude its fp32-accumulation budget needs; each states its own error bound.
``histogram``: the exponent histogram (numpy ``frexp``).
``optim``: LAMB (apex's FusedLAMB math) and Adam/AdamW.
``optim_apex``: apex's FusedSGD, FusedAdagrad, FusedNovoGrad and LARC's gradient rewrite.

May import: numpy, torch and ``fp16kit.numerics`` only (never ``fp16kit.kernels``: a reference that shared the
kernels' code could not catch their mistakes).
"""

from .histogram import exponent_histogram
from .kernels import UnscaleResult, copy, l2norm, round_to_format, unscale_and_check
from .ops import (  # noqa: F401  (re-exported)
    MatmulReference,
    cross_entropy,
    gelu,
    layer_norm,
    log_softmax,
    matmul,
    rms_norm,
    softmax,
)
from .optim import adam_step, global_grad_norm, lamb_step  # noqa: F401  (re-exported)
from .optim_apex import adagrad_step, larc_grads, novograd_step, sgd_step  # noqa: F401  (re-exported)

__all__ = ["UnscaleResult", "copy", "exponent_histogram", "l2norm", "round_to_format", "unscale_and_check"]
