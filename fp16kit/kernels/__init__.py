"""Multi-tensor kernels: fused unscale + inf/NaN check, L2 norms, cast copies (and optimizer steps).

The overflow flag these kernels raise (``found_inf``) has one owner, :mod:`fp16kit.kernels.found_inf`: its
shape and dtype, creation, merging, and the form handed to an optimizer.

Every operation takes whole lists of tensors and runs them in a constant number of launches per dtype
group, planned once per list by ``fp16kit/kernels/_plan.py`` (validation, dtype groups, address tables; cached
and invalidated when a tensor's storage or layout changes). The optimizers' per-group updates are public ops too
(``fp16kit/kernels/optimizers.py``). Which implementation runs is decided per device by
:mod:`fp16kit.kernels.backend`: compiled Triton on CUDA, Triton's interpreter on CPU under ``TRITON_INTERPRET=1``,
the torch fallback otherwise.
"""

from . import library  # registers the fp16kit:: dispatcher ops (torch.ops.fp16kit.*)
from ._checks import KERNEL_DTYPES, check_flag, check_pairs, check_tensor_list, common_device
from ._table import release_graph_tables
from .backend import Backend, BackendChoice, select_backend, use_backend
from .found_inf import (
    as_fp16kit_flag,
    as_torch_flag,
    check_found_inf,
    checks_inf_itself,
    flag_for,
    flag_is_final,
    flag_nonfinite,
    merge_found_inf,
    merge_found_inf_into,
    new_found_inf,
)
from .histogram import exponent_histogram
from .ops import copy_, forget_autocast_casts, l2norm, unscale_and_check
from .optimizers import (
    Bf16Weights,
    DeviceStep,
    LambStaged,
    adagrad_update,
    adam_update,
    check_and_norm,
    join_halves,
    lamb_stage1,
    lamb_stage2,
    lamb_update,
    novograd_update,
    sgd_update,
    split_halves,
    step_check,
    stochastic_round,
)
from .state8 import QBLOCK as STATE8_BLOCK
from .state8 import SMALL_NUMEL as STATE8_SMALL_NUMEL
from .state8 import absmax_of as state8_absmax
from .state8 import dequantize as dequantize_state8
from .state8 import from_state8, to_state8, uses_state8
from .state8 import num_blocks as state8_blocks

__all__ = [
    "KERNEL_DTYPES",
    "STATE8_BLOCK",
    "STATE8_SMALL_NUMEL",
    "Backend",
    "BackendChoice",
    "Bf16Weights",
    "DeviceStep",
    "LambStaged",
    "adagrad_update",
    "adam_update",
    "as_fp16kit_flag",
    "as_torch_flag",
    "check_and_norm",
    "check_flag",
    "check_found_inf",
    "check_pairs",
    "check_tensor_list",
    "checks_inf_itself",
    "common_device",
    "copy_",
    "dequantize_state8",
    "exponent_histogram",
    "flag_for",
    "flag_is_final",
    "flag_nonfinite",
    "forget_autocast_casts",
    "from_state8",
    "join_halves",
    "l2norm",
    "lamb_stage1",
    "lamb_stage2",
    "lamb_update",
    "library",
    "merge_found_inf",
    "merge_found_inf_into",
    "metadata_guard",
    "new_found_inf",
    "novograd_update",
    "release_graph_tables",
    "select_backend",
    "sgd_update",
    "split_halves",
    "state8_absmax",
    "state8_blocks",
    "step_check",
    "stochastic_round",
    "to_state8",
    "unscale_and_check",
    "use_backend",
    "uses_state8",
    "vouched_rows",
]


def vouched_rows(token: object, lists: list) -> object:
    """``with vouched_rows(token, lists):``: the caller has just checked these lists' tensors against the guard
    that ``token`` stands for, so the planner may skip its own (``fp16kit/kernels/_plan.py``, ``vouched``)."""
    from . import _plan

    return _plan.vouched(token, lists)


def metadata_guard(tensors: list) -> object:
    """A guard over ``tensors``' metadata (shape, strides, dtype, device, dispatch keys): ``guard.check(*same)`` is
    True while every tensor at each position still has that metadata. The planner's guard (``_plan.make_guard``:
    torch's C++ ``TensorGuards`` where available); callers remember a validation verdict with it."""
    from . import _plan

    return _plan.make_guard(list(tensors))
