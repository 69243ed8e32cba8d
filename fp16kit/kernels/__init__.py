"""Multi-tensor kernels: fused unscale + inf/NaN check, L2 norms, cast copies, exponent histograms, optimizer steps.

One idea: **every multi-tensor operation has a Triton kernel and a torch twin with one contract, checked against one
float64 reference** (``fp16kit/numerics/reference/``). Every operation takes whole lists of tensors and runs them in
a constant number of launches per dtype group, planned once per list (validation, dtype groups, address tables;
cached and invalidated when a tensor's storage or layout changes). Which side runs is decided per device by
:mod:`fp16kit.kernels.backend`: compiled Triton on CUDA, Triton's interpreter on CPU under ``TRITON_INTERPRET=1``,
the torch twin otherwise (and for the tensors a kernel does not take: non-contiguous, float64).

The map (``fp16kit/kernels/``)::

    __init__.py    the public names (this module)
    ops.py         public ops unscale_and_check, l2norm, copy_        (docs/kernels.md)
    optimizers.py  public optimizer-step ops (lamb_update, adam_update, lamb_stage1/2, sgd/adagrad/novograd_update)
    histogram.py   public op exponent_histogram
    library.py     the torch.library registrations (torch.ops.fp16kit.*): compile, fake tensors, autograd
    backend.py     which side runs: Triton, its interpreter, or torch
    found_inf.py   the overflow flag: shape, dtype, creation, merging, hand-over
    engine/        what both sides share: checks, planner, address tables, recorded launches, the device
                   functions of every kernel (chunks, rounding, step skeleton, step scalars, result check)
    triton/        the Triton side, one file per operation: adam.py lamb.py sgd.py adagrad.py novograd.py
                   l2norm.py unscale.py copy.py histogram.py
    fallback/      the torch side, the same file names: adam.py lamb.py sgd.py adagrad.py novograd.py l2norm.py
                   unscale.py copy.py histogram.py; plus step.py / apex_step.py / scratch.py (what the twins
                   share) and lamb_native.py (LAMB's opt-in C++ CPU kernel)
    state8/        8-bit moments: rule.py (the rule), triton.py (its device functions), fallback.py (8-bit Adam
                   and LAMB in torch: the CPU path); reference fp16kit/numerics/reference/state8.py
    bf16_weights/  bf16 weights without fp32 masters (split halves, stochastic rounding): modes.py holds the
                   rule, the device functions and the torch twin; reference fp16kit/numerics/reference/bf16_weights.py

The float64 references: ``fp16kit/numerics/reference/kernels.py`` (unscale, l2norm, copy), ``optim.py`` (LAMB, Adam, the
check-and-norm pass), ``optim_apex.py`` (SGD, Adagrad, NovoGrad), ``histogram.py``, ``state8.py``, ``bf16_weights.py``.

May import: torch, triton, numpy and ``fp16kit._versions``; nothing else of fp16kit. Inside (pinned by
``tests/test_layering.py``): the public modules above import the folders; ``triton/`` imports the engine, ``state8/``
and ``bf16_weights/``; ``state8/`` and ``bf16_weights/`` import the engine and ``fallback/``; ``fallback/`` imports only
the engine, which imports only ``backend.py`` (and ``fp16kit._versions``); no folder imports the public ops (``ops``,
``optimizers``, ``histogram``, ``library``, ``found_inf``). Other packages of fp16kit import the names of this module
(and the public modules ``ops``, ``optimizers``, ``histogram``, ``found_inf``, ``library``), never the folders.
"""

from . import library  # registers the fp16kit:: dispatcher ops (torch.ops.fp16kit.*)
from .backend import Backend, BackendChoice, select_backend, use_backend
from .engine.checks import KERNEL_DTYPES, check_device, check_flag, check_pairs, check_tensor_list, common_device
from .engine.table import release_graph_tables
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
from .state8.rule import QBLOCK as STATE8_BLOCK
from .state8.rule import SMALL_NUMEL as STATE8_SMALL_NUMEL
from .state8.rule import absmax_of as state8_absmax
from .state8.rule import dequantize as dequantize_state8
from .state8.rule import from_state8, to_state8, uses_state8
from .state8.rule import num_blocks as state8_blocks

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
    "check_device",
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
    that ``token`` stands for, so the planner may skip its own (``fp16kit/kernels/engine/plan.py``, ``vouched``)."""
    from .engine import plan as _plan

    return _plan.vouched(token, lists)


def metadata_guard(tensors: list) -> object:
    """A guard over ``tensors``' metadata (shape, strides, dtype, device, dispatch keys): ``guard.check(*same)`` is
    True while every tensor at each position still has that metadata. The planner's guard (``_plan.make_guard``:
    torch's C++ ``TensorGuards`` where available); callers remember a validation verdict with it."""
    from .engine import plan as _plan

    return _plan.make_guard(list(tensors))
