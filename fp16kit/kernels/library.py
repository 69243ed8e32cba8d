"""fp16kit's multi-tensor kernels as dispatcher ops (``torch.ops.fp16kit.*``), for torch.compile and the profiler.

Each op is registered with ``torch.library.custom_op`` under the ``fp16kit::`` namespace, with its mutations
declared, a fake (meta) implementation (shapes and dtypes only: what ``torch.compile``/``torch.export`` trace
with) and one real implementation registered for the ``cpu`` and ``cuda`` dispatch keys. The real
implementation is the public eager function (``fp16kit.kernels.unscale_and_check``, ``l2norm``, ``copy_``, the
optimizers' check-and-norm pass and LAMB/Adam updates), which picks its backend per device with
:func:`fp16kit.kernels.select_backend`: compiled Triton on CUDA, Triton's interpreter on CPU under
``TRITON_INTERPRET=1`` (so tests exercise the real kernels through the ops), the torch fallback otherwise;
``use_backend`` forces a choice, inside an op as outside. So an op call and the eager call give the same bits.

The ops (schemas as ``torch.ops.fp16kit.<op>._schema`` prints them; ``(a!)`` marks a tensor written in place)::

    unscale_and_check(Tensor(a!)[] tensors, Tensor inv_scale, Tensor(b!) found_inf, Tensor(c!)? sq_norm) -> ()
    unscale_and_check_out(Tensor[] tensors, Tensor inv_scale, Tensor(a!) found_inf, Tensor(b!)[] out,
                          Tensor(c!)? sq_norm) -> ()
    l2norm(Tensor[] tensors, Tensor pre_scale, Tensor(a!)? found_inf) -> (Tensor, Tensor)   # global, per tensor
    copy_(Tensor(a!)[] dst, Tensor[] src) -> ()
    check_and_norm(Tensor[] grads, Tensor inv_scale64, Tensor(a!) found_inf) -> Tensor
    lamb_update(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,
                Tensor(d!)[] models, int[] model_rows, Tensor hp64, Tensor found_inf, float weight_decay,
                bool adam_w_mode, bool use_nvlamb, Tensor? step) -> ()
    adam_update(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs,
                Tensor(d!)[] models, int[] model_rows, Tensor hp64, Tensor found_inf, float weight_decay,
                bool adam_w_mode, Tensor? step) -> ()

The dispatcher has no list of optional tensors that may be written, so the optimizers' low-precision model
copies (``None`` where a param has none) travel as ``models`` (the present ones) plus ``model_rows`` (their
positions in ``params``). The typed wrappers below take the eager functions' arguments (``None`` entries
included) and call the ops.

Validation: the real implementation validates exactly as the eager function does (clear errors, before any
write). The fake implementations check only what shapes need; a traced call's errors surface when it runs.

Cost: a call through the dispatcher costs a few microseconds more than the eager function, so eager code
calls the functions directly; the fused optimizers route a step through these ops only while
``torch.compiler.is_compiling()`` (docs/optim.md), so Dynamo sees one op per pass instead of the launchers'
``data_ptr()`` reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import ops, optimizers

__all__ = [
    "NAMESPACE",
    "OP_NAMES",
    "adam_update",
    "check_and_norm",
    "copy_",
    "l2norm",
    "lamb_update",
    "split_models",
    "unscale_and_check",
]

NAMESPACE = "fp16kit"
_DEVICES = ("cpu", "cuda")
F32 = torch.float32


def split_models(models: Sequence[Tensor | None]) -> tuple[list[Tensor], list[int]]:
    """``[m0, None, m2]`` -> ``([m0, m2], [0, 2])``: the dispatcher form of an optional-entry list."""
    present: list[Tensor] = []
    rows: list[int] = []
    for i, m in enumerate(models):
        if m is not None:
            present.append(m)
            rows.append(i)
    return present, rows


def _join_models(n: int, models: list[Tensor], model_rows: list[int]) -> list[Tensor | None]:
    """Inverse of :func:`split_models` for ``n`` params (rows are validated: a bad list would misplace writes)."""
    if len(models) != len(model_rows):
        raise ValueError(f"fp16kit ops: {len(models)} model copies but {len(model_rows)} model_rows; they must pair.")
    out: list[Tensor | None] = [None] * n
    for m, r in zip(models, model_rows):
        if not 0 <= r < n or out[r] is not None:
            raise ValueError(f"fp16kit ops: model_rows entry {r} is out of range [0, {n}) or repeated.")
        out[r] = m
    return out


# ---------------------------------------------------------------------------------------------------------
# unscale_and_check, l2norm, copy_


@torch.library.custom_op(
    f"{NAMESPACE}::unscale_and_check", mutates_args=("tensors", "found_inf", "sq_norm"), device_types=_DEVICES
)
def _unscale_and_check_op(tensors: list[Tensor], inv_scale: Tensor, found_inf: Tensor, sq_norm: Tensor | None) -> None:
    ops.unscale_and_check(tensors, inv_scale, found_inf, sq_norm=sq_norm)


@_unscale_and_check_op.register_fake
def _(tensors: list[Tensor], inv_scale: Tensor, found_inf: Tensor, sq_norm: Tensor | None) -> None:
    return None


@torch.library.custom_op(
    f"{NAMESPACE}::unscale_and_check_out", mutates_args=("found_inf", "out", "sq_norm"), device_types=_DEVICES
)
def _unscale_and_check_out_op(
    tensors: list[Tensor], inv_scale: Tensor, found_inf: Tensor, out: list[Tensor], sq_norm: Tensor | None
) -> None:
    ops.unscale_and_check(tensors, inv_scale, found_inf, out=out, sq_norm=sq_norm)


@_unscale_and_check_out_op.register_fake
def _(tensors: list[Tensor], inv_scale: Tensor, found_inf: Tensor, out: list[Tensor], sq_norm: Tensor | None) -> None:
    return None


@torch.library.custom_op(f"{NAMESPACE}::l2norm", mutates_args=("found_inf",), device_types=_DEVICES)
def _l2norm_op(tensors: list[Tensor], pre_scale: Tensor, found_inf: Tensor | None) -> tuple[Tensor, Tensor]:
    if not tensors:  # the eager function answers on the CPU; the op answers on pre_scale's device, as its fake
        zeros = torch.zeros(0, dtype=F32, device=pre_scale.device)
        return zeros.new_zeros(()), zeros
    total, each = ops.l2norm(tensors, per_tensor=True, pre_scale=pre_scale, found_inf=found_inf)
    return total, each


@_l2norm_op.register_fake
def _(tensors: list[Tensor], pre_scale: Tensor, found_inf: Tensor | None) -> tuple[Tensor, Tensor]:
    device = pre_scale.device
    return torch.empty((), dtype=F32, device=device), torch.empty((len(tensors),), dtype=F32, device=device)


@torch.library.custom_op(f"{NAMESPACE}::copy_", mutates_args=("dst",), device_types=_DEVICES)
def _copy_op(dst: list[Tensor], src: list[Tensor]) -> None:
    ops.copy_(dst, src)


@_copy_op.register_fake
def _(dst: list[Tensor], src: list[Tensor]) -> None:
    return None


# ---------------------------------------------------------------------------------------------------------
# the optimizers' passes


@torch.library.custom_op(f"{NAMESPACE}::check_and_norm", mutates_args=("found_inf",), device_types=_DEVICES)
def _check_and_norm_op(grads: list[Tensor], inv_scale64: Tensor, found_inf: Tensor) -> Tensor:
    return optimizers.check_and_norm(grads, inv_scale64, found_inf)


@_check_and_norm_op.register_fake
def _(grads: list[Tensor], inv_scale64: Tensor, found_inf: Tensor) -> Tensor:
    return torch.empty((), dtype=F32, device=found_inf.device)


_UPDATE_MUTATES = ("params", "exp_avgs", "exp_avg_sqs", "models")
_UPDATE_SCHEMA = (
    "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] models, "
    "int[] model_rows, Tensor hp64, Tensor found_inf, float weight_decay, bool adam_w_mode, {extra}Tensor? step) -> ()"
)


def _register_update(kind: str, extra: tuple[str, ...]) -> None:
    """``fp16kit::<kind>_update``: ``fp16kit.kernels.<kind>_update`` (fp16kit/kernels/optimizers.py) over the
    dispatcher form of its lists. LAMB and Adam share the schema but for LAMB's ``use_nvlamb``, so one factory
    registers both."""

    def impl(params, grads, exp_avgs, exp_avg_sqs, models, model_rows, hp64, found_inf, weight_decay, adam_w_mode,
             *rest):  # fmt: skip
        *flags, step = rest
        update = getattr(optimizers, f"{kind}_update")
        update(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            _join_models(len(params), models, model_rows),
            hp64,
            found_inf,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            **dict(zip(extra, flags)),
            step=step,
        )

    schema = _UPDATE_SCHEMA.format(extra="".join(f"bool {name}, " for name in extra))
    op = torch.library.custom_op(
        f"{NAMESPACE}::{kind}_update", impl, mutates_args=_UPDATE_MUTATES, device_types=_DEVICES, schema=schema
    )
    op.register_fake(lambda *args: None)  # writes in place, returns nothing: no shapes to compute


_register_update("lamb", ("use_nvlamb",))
_register_update("adam", ())


#: every op this module registers, as ``fp16kit::<name>`` (the names the profiler shows)
OP_NAMES = tuple(
    f"{NAMESPACE}::{name}"
    for name in (
        "unscale_and_check",
        "unscale_and_check_out",
        "l2norm",
        "copy_",
        "check_and_norm",
        "lamb_update",
        "adam_update",
    )
)


# ---------------------------------------------------------------------------------------------------------
# typed wrappers: the eager functions' arguments, through the dispatcher


def _scalar(value: float | Tensor, device: torch.device, dtype: torch.dtype = torch.float64) -> Tensor:
    if isinstance(value, Tensor):
        return value
    return torch.full((1,), float(value), dtype=dtype, device=device)


def unscale_and_check(
    tensors: Sequence[Tensor],
    inv_scale: float | Tensor,
    found_inf: Tensor,
    *,
    out: Sequence[Tensor] | None = None,
    sq_norm: Tensor | None = None,
) -> None:
    """:func:`fp16kit.kernels.unscale_and_check` through ``torch.ops.fp16kit.unscale_and_check[_out]``."""
    scale = _scalar(inv_scale, found_inf.device)
    if out is None:
        torch.ops.fp16kit.unscale_and_check(list(tensors), scale, found_inf, sq_norm)
    else:
        torch.ops.fp16kit.unscale_and_check_out(list(tensors), scale, found_inf, list(out), sq_norm)


def l2norm(
    tensors: Sequence[Tensor],
    *,
    per_tensor: bool = False,
    pre_scale: float | Tensor | None = None,
    found_inf: Tensor | None = None,
    device: torch.device | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`fp16kit.kernels.l2norm` through ``torch.ops.fp16kit.l2norm``. The device comes from the tensors
    (``device`` for an empty list, default CPU)."""
    items = list(tensors)
    where = items[0].device if items else (device or torch.device("cpu"))
    total, each = torch.ops.fp16kit.l2norm(items, _scalar(1.0 if pre_scale is None else pre_scale, where), found_inf)
    return (total, each) if per_tensor else total


def copy_(dst: Sequence[Tensor], src: Sequence[Tensor]) -> None:
    """:func:`fp16kit.kernels.copy_` through ``torch.ops.fp16kit.copy_``."""
    torch.ops.fp16kit.copy_(list(dst), list(src))


def check_and_norm(grads: Sequence[Tensor], inv_scale64: Tensor, found_inf: Tensor) -> Tensor:
    """``fp16kit.kernels.check_and_norm`` through ``torch.ops.fp16kit.check_and_norm``."""
    return torch.ops.fp16kit.check_and_norm(list(grads), inv_scale64, found_inf)


def _update(op, lists: tuple, models: Sequence[Tensor | None], hp64: Tensor, found_inf: Tensor, *flags) -> None:
    present, rows = split_models(models)
    op(*(list(x) for x in lists), present, rows, hp64, found_inf, *flags)


def lamb_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    models: Sequence[Tensor | None],
    hp64: Tensor,
    found_inf: Tensor,
    *,
    weight_decay: float,
    adam_w_mode: bool,
    use_nvlamb: bool,
    step: Tensor | None = None,
) -> None:
    """``fp16kit.kernels.lamb_update`` through ``torch.ops.fp16kit.lamb_update``."""
    flags = (float(weight_decay), bool(adam_w_mode), bool(use_nvlamb), step)
    _update(torch.ops.fp16kit.lamb_update, (params, grads, exp_avgs, exp_avg_sqs), models, hp64, found_inf, *flags)


def adam_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    models: Sequence[Tensor | None],
    hp64: Tensor,
    found_inf: Tensor,
    *,
    weight_decay: float,
    adam_w_mode: bool,
    step: Tensor | None = None,
) -> None:
    """``fp16kit.kernels.adam_update`` through ``torch.ops.fp16kit.adam_update``."""
    flags = (float(weight_decay), bool(adam_w_mode), step)
    _update(torch.ops.fp16kit.adam_update, (params, grads, exp_avgs, exp_avg_sqs), models, hp64, found_inf, *flags)
