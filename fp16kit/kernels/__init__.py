"""Multi-tensor kernels: fused unscale + inf/NaN check, L2 norms, cast copies (and optimizer steps).

The overflow flag these kernels raise (``found_inf``) has one owner, :mod:`fp16kit.kernels.found_inf`: its
shape and dtype, creation, merging, and the form handed to an optimizer.

Every operation takes whole lists of tensors and runs them in a constant number of launches per dtype
group. Which implementation runs is decided per device by :mod:`fp16kit.kernels.backend`: compiled
Triton on CUDA, Triton's interpreter on CPU under ``TRITON_INTERPRET=1``, the torch fallback otherwise.
"""

from . import library  # registers the fp16kit:: dispatcher ops (torch.ops.fp16kit.*)
from ._table import release_graph_tables
from .backend import Backend, BackendChoice, select_backend, use_backend
from .found_inf import (
    as_fp16kit_flag,
    as_torch_flag,
    check_found_inf,
    checks_inf_itself,
    flag_for,
    merge_found_inf,
    merge_found_inf_into,
    new_found_inf,
)
from .histogram import exponent_histogram
from .ops import copy_, l2norm, unscale_and_check

__all__ = [
    "Backend",
    "BackendChoice",
    "as_fp16kit_flag",
    "as_torch_flag",
    "check_found_inf",
    "checks_inf_itself",
    "copy_",
    "exponent_histogram",
    "flag_for",
    "l2norm",
    "library",
    "merge_found_inf",
    "merge_found_inf_into",
    "new_found_inf",
    "release_graph_tables",
    "select_backend",
    "unscale_and_check",
    "use_backend",
]
