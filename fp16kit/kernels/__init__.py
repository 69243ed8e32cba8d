"""Multi-tensor kernels: fused unscale + inf/NaN check, L2 norms, cast copies (and optimizer steps).

Every operation takes whole lists of tensors and runs them in a constant number of launches per dtype
group. Which implementation runs is decided per device by :mod:`fp16kit.kernels.backend`: compiled
Triton on CUDA, Triton's interpreter on CPU under ``TRITON_INTERPRET=1``, the torch fallback otherwise.
"""

from .backend import Backend, BackendChoice, select_backend, use_backend
from .histogram import exponent_histogram
from .ops import copy_, l2norm, unscale_and_check

__all__ = [
    "Backend",
    "BackendChoice",
    "copy_",
    "exponent_histogram",
    "l2norm",
    "select_backend",
    "unscale_and_check",
    "use_backend",
]
