"""Functional LAMB and Adam steps over lists of tensors, for people who write their own training loops.

``lamb_step_`` and ``adam_step_`` update params and optimizer state in place, on the device, with no host
sync: the learning rate, the step counter, the loss-scale inverse and the skip flag may all be device
tensors. ``FusedLAMB``/``FusedAdam`` are thin classes over the same private pieces defined here.

How a step runs (LAMB; Adam has no clipping and one update pass)::

    found_inf, gnorm = check-and-norm pass over grads (fp16kit.kernels.l2norm, pre_scale=inv_scale)
    clip = gnorm / max_grad_norm if 0 < max_grad_norm < gnorm else 1       (device arithmetic)
    step += (found_inf == 0)                                                (device; skipped steps do not count)
    hp = [lr, beta1, beta2, ..., bc1, bc2, inv_scale, clip]                 (float64 math, rounded to fp32 once)
    stage 1 + stage 2 kernels (or the torch fallback), both no-ops when found_inf is set

Hyper-parameters derived from the step (bias corrections ``1 - beta**t``, ``lr / bc1``, ``sqrt(bc2)``) are
computed in float64 on the device and rounded once to fp32, like the Python floats of apex and torch;
``1 - beta2`` and ``1 - beta1`` are float64 differences rounded once (apex subtracts in fp32 from the
rounded beta, which is off by up to 1.3e-5 relative for beta2 = 0.999: we follow the math, not that artifact).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from operator import is_not
from typing import Any

import torch

from fp16kit.kernels import (
    adam_update,
    check_flag,
    check_pairs,
    check_tensor_list,
    common_device,
    flag_nonfinite,
    lamb_update,
    library,
    metadata_guard,
    new_found_inf,
)
from fp16kit.kernels import check_and_norm as _check_and_norm

from ._validate import FP32_MAX, check_hyperparams

__all__ = ["adam_step_", "lamb_step_"]

F64 = torch.float64
Scalar = float | torch.Tensor

#: The square guard of updates that square unclipped gradients (Adam; LAMB with ``max_grad_norm=0``): an unscaled
#: ``|g| >= 2**63`` skips the step like inf/NaN. Below it ``v = beta2 * v + (1 - beta2) * g * g`` stays finite for
#: every finite ``v`` (it is at most ``max(v, g^2)``, and ``2**126`` leaves room for the roundings); above it the
#: second moment may become inf and the element never moves again. The check multiplies the unscaled value by this
#: power of two (exact), so "overflows fp32" means ``|g| >= 2**63`` (docs/optim.md, "Non-finite gradients").
SQUARE_GUARD = 2.0**65

# ---------------------------------------------------------------------------------------------------------
# device scalars


_constants: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A cached float64 device tensor of host constants: built once, so no per-step host-to-device copy."""
    if torch.compiler.is_compiling():
        # Fills in the graph (the cache is host state Dynamo need not trace): ``torch.tensor(values, device=...)``
        # would be a host constant copied to the device at every run of a compiled step
        # (tests/optim/test_fake_cuda_trace.py).
        return torch.cat([torch.full((1,), v, dtype=F64, device=device) for v in values])
    key = (device, values)
    t = _constants.get(key)
    if t is None:
        t = _constants[key] = torch.tensor(values, dtype=F64, device=device)
        if len(_constants) > 256:
            _constants.popitem(last=False)
    return t


def _scalar64(name: str, value: Scalar, device: torch.device) -> torch.Tensor:
    """A one-element float64 tensor on ``device`` (``torch.full`` for a Python number: a fill, not a copy)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{name} must be a Python float or a one-element floating tensor, got {value!r}.")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the params are on {device}; move it there.")
        return value.detach().reshape(1).to(F64)
    return torch.full((1,), float(value), dtype=F64, device=device)


def device_lr(lr: Scalar, device: torch.device) -> torch.Tensor | None:
    """A tensor ``lr`` as a device step reads it (validated as ``_scalar64`` validates it), None for a number."""
    if not isinstance(lr, torch.Tensor):
        return None
    if lr.device != device or lr.numel() != 1 or not lr.is_floating_point():
        _scalar64("lr", lr, device)  # raises, naming the problem
    return lr.detach()


def inv_scale_from_grad_scale(grad_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``1 / grad_scale`` in float64 (as torch's GradScaler computes its inverse), or 1 without a scale."""
    if grad_scale is None:
        return torch.ones(1, dtype=F64, device=device)
    return _scalar64("grad_scale", grad_scale, device).reciprocal()


def check_and_norm(
    grads: Sequence[torch.Tensor], inv_scale64: torch.Tensor, found_inf: torch.Tensor, *, exact: bool = False
) -> torch.Tensor:
    """Global L2 norm of the unscaled grads (0-dim fp32), raising ``found_inf`` on any inf/NaN: the pass of
    ``fp16kit.kernels.check_and_norm`` (fp16kit/kernels/optimizers.py; empty grads add 0; ``exact``: the kernels'
    float64 sums on the torch backend too). Under ``torch.compile`` it runs as the op
    ``torch.ops.fp16kit.check_and_norm`` (fp16kit/kernels/library.py), whose implementation is that same function,
    so Dynamo sees one op instead of the backends' address reads (``exact`` is for the 8-bit moments, whose compiled
    step is refused).
    """
    if torch.compiler.is_compiling():
        return library.check_and_norm(grads, inv_scale64, found_inf)
    return _check_and_norm(grads, inv_scale64, found_inf, exact=exact)


def check_square_guard(grads: Sequence[torch.Tensor], inv_scale64: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Raise ``found_inf`` when some unscaled gradient is inf/NaN or ``|g| >= 2**63`` (:data:`SQUARE_GUARD`): the
    check pass of an update that squares unclipped gradients and uses no norm (``fp16kit.kernels.flag_nonfinite``;
    while ``torch.compile`` traces, the ``fp16kit::check_and_norm`` op with the guard folded into its scale)."""
    if torch.compiler.is_compiling():
        check_and_norm(list(grads), inv_scale64 * SQUARE_GUARD, found_inf)
        return
    flag_nonfinite(list(grads), inv_scale64.float() * SQUARE_GUARD, found_inf)


def clip_factor(gnorm: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """apex's divisor ``gnorm / max_grad_norm`` when ``0 < max_grad_norm < gnorm``, else 1 (float64 [1])."""
    g = gnorm.reshape(1).to(F64)
    if max_grad_norm <= 0:
        return torch.ones_like(g)
    return torch.where(g > max_grad_norm, g / max_grad_norm, torch.ones_like(g))


def bad_lr_flag(lrs: Sequence[Scalar], device: torch.device) -> torch.Tensor | None:
    """float32 ``[1]``: 1 when any tensor learning rate is NaN, inf, negative or beyond float32's maximum (a
    float64 tensor: inf in the kernels' float32), else 0 — computed on the device (no sync); None when no lr is a
    tensor (host values are checked on the host, at step)."""
    tensors = [lr for lr in lrs if isinstance(lr, torch.Tensor)]
    if not tensors:
        return None
    values = torch.cat([_scalar64("lr", lr, device) for lr in tensors])
    return (~(values <= FP32_MAX) | (values < 0)).any().float().reshape(1)


def advance_step(step: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``step += 1`` unless ``found_inf`` is set — on the device."""
    step.add_((found_inf.reshape(step.shape) == 0).to(step.dtype))


def _bias_corrections(
    step: torch.Tensor, betas: tuple[float, float], bias_correction: bool, lr64: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not bias_correction:
        one = torch.ones_like(lr64)
        return one, one
    t = step.detach().reshape(1).to(F64)
    return 1 - torch.pow(float(betas[0]), t), 1 - torch.pow(float(betas[1]), t)


def lamb_hparams(
    *,
    lr: Scalar,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    grad_averaging: bool,
    step: torch.Tensor,
    inv_scale64: torch.Tensor,
    clip64: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """float64 ``[lr, b1, b2, beta3, 1 - b2, eps, wd, bc1, bc2, inv_scale, clip]`` (triton/lamb.py)."""
    b1, b2 = float(betas[0]), float(betas[1])
    beta3 = 1.0 - b1 if grad_averaging else 1.0
    consts = _constant((b1, b2, beta3, 1.0 - b2, float(eps), float(weight_decay)), device)
    lr64 = _scalar64("lr", lr, device)
    bc1, bc2 = _bias_corrections(step, (b1, b2), bias_correction, lr64)
    return torch.cat([lr64, consts, bc1, bc2, inv_scale64.reshape(1), clip64.reshape(1)])


def adam_hparams(
    *,
    lr: Scalar,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    step: torch.Tensor,
    inv_scale64: torch.Tensor,
    device: torch.device,
) -> torch.Tensor:
    """float64 ``[lr, b1, b2, 1 - b1, 1 - b2, eps, wd, -lr/bc1, sqrt(bc2), inv_scale, 1 - lr*wd]`` (triton/adam.py)."""
    b1, b2, wd = float(betas[0]), float(betas[1]), float(weight_decay)
    consts = _constant((b1, b2, 1.0 - b1, 1.0 - b2, float(eps), wd), device)
    lr64 = _scalar64("lr", lr, device)
    bc1, bc2 = _bias_corrections(step, (b1, b2), bias_correction, lr64)
    return torch.cat([lr64, consts, -lr64 / bc1, bc2.sqrt(), inv_scale64.reshape(1), 1 - lr64 * wd])


# ---------------------------------------------------------------------------------------------------------
# dispatch: ``lamb_update`` and ``adam_update`` (one group's update over validated lists) are the public ops of
# ``fp16kit.kernels`` (fp16kit/kernels/optimizers.py: the one planner, Triton kernels, the torch fallback),
# imported above and re-exported here under their old names.


# ---------------------------------------------------------------------------------------------------------
# public functional API


def _with_bad_lr(flag: torch.Tensor, lr: Scalar, device: torch.device, *, own: bool) -> torch.Tensor:
    """The skip flag: ``flag``, raised where a tensor ``lr`` is NaN/inf/negative. Our own flag (``own``) is
    raised in place, so the caller sees the skip; a caller's ``found_inf`` (a loss scaler's) is left alone."""
    bad = bad_lr_flag([lr], device)
    if bad is None:
        return flag
    if own:
        return torch.maximum(flag, bad, out=flag)
    return torch.maximum(flag.reshape(1), bad)


#: Remembered verdicts of :func:`_check_tensor_lists`: key (fn, list lengths, which model entries are present) ->
#: (metadata guard over every tensor, the lists' device). Every check there reads metadata only (types, dtypes,
#: layouts, shapes, devices), so tensors passing the guard get the same verdict, whatever their addresses.
_verdicts: OrderedDict[tuple, tuple[Any, torch.device | None]] = OrderedDict()
_VERDICTS_MAX = 64


def _check_lists(
    fn: str,
    given: tuple[Sequence[torch.Tensor], ...],
    model_params: Sequence[torch.Tensor | None] | None,
    step: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> tuple[torch.device | None, list[torch.Tensor | None]]:
    """The functional steps' validation of ``given`` (params, grads, exp_avgs, exp_avg_sqs), the model copies,
    ``step`` and ``found_inf`` (messages name the list and index); the list checks' verdict is remembered per list
    shape under a C++ metadata guard (``_verdicts``), so a repeated call costs one guard check over its tensors
    (~0.07 us each) instead of per-tensor Python (~1.7 us per row)."""
    if any(isinstance(x, torch.Tensor) for x in given):  # a single tensor, not a list: the checks say so
        _check_tensor_lists(fn, given, [])
    lists = [x if type(x) is list else list(x) for x in given]
    models: list[torch.Tensor | None] = [None] * len(lists[0]) if model_params is None else list(model_params)
    present = tuple(map(is_not, models, repeat(None)))
    key = (fn, *map(len, lists), present)
    flat = [t for row in lists for t in row]
    flat += compress(models, present)
    entry = None if torch.compiler.is_compiling() else _verdicts.get(key)
    if entry is not None and entry[0].check(*flat):
        device = entry[1]
    else:
        device = _check_tensor_lists(fn, lists, models)
        if not torch.compiler.is_compiling():
            _verdicts[key] = (metadata_guard(flat), device)
            if len(_verdicts) > _VERDICTS_MAX:
                _verdicts.popitem(last=False)
    if not isinstance(step, torch.Tensor) or step.numel() != 1 or not step.is_floating_point():
        raise TypeError(
            f"{fn}: step must be a one-element floating tensor counting the steps taken so far "
            f"(e.g. torch.zeros(1, device=...)); it is incremented in place unless the step is skipped."
        )
    if device is not None and step.device != device:
        raise ValueError(f"{fn}: step is on {step.device} but the params are on {device}.")
    if found_inf is not None:
        check_flag(fn, found_inf, device)
    return device, models


def _check_tensor_lists(
    fn: str, lists: Sequence[Sequence[torch.Tensor]], models: list[torch.Tensor | None]
) -> torch.device | None:
    """Every check of the tensor ``lists`` (params, grads, exp_avgs, exp_avg_sqs) and ``models`` (per tensor,
    naming list and index); returns their one device."""
    params, grads, exp_avgs, exp_avg_sqs = lists
    ps = check_tensor_list(fn, "params", params)
    gs = check_tensor_list(fn, "grads", grads)
    ms = check_tensor_list(fn, "exp_avgs", exp_avgs)
    vs = check_tensor_list(fn, "exp_avg_sqs", exp_avg_sqs)
    for name, other in (("grads", gs), ("exp_avgs", ms), ("exp_avg_sqs", vs)):
        check_pairs(fn, "params", ps, name, other)
    for i, (p, m, v) in enumerate(zip(ps, ms, vs)):
        want = F64 if p.dtype == F64 else torch.float32
        if m.dtype != want or v.dtype != want:
            raise TypeError(
                f"{fn}: exp_avgs[{i}]/exp_avg_sqs[{i}] are {m.dtype}/{v.dtype}; optimizer state must be {want} "
                f"for {p.dtype} params (create it with torch.zeros_like(p, dtype={want}))."
            )
    if len(models) != len(ps):
        raise ValueError(f"{fn}: model_params has {len(models)} entries but params has {len(ps)}; they must pair up.")
    present = [m for m in models if m is not None]
    check_tensor_list(fn, "model_params", present)
    for i, (p, m) in enumerate(zip(ps, models)):
        if m is not None and m.shape != p.shape:
            raise ValueError(f"{fn}: model_params[{i}] has shape {tuple(m.shape)}, params[{i}] {tuple(p.shape)}.")
    return common_device(fn, ps, gs, ms, vs, present)


def _step_lists(
    fn: str,
    update: Callable[..., Any],
    lists: tuple[Sequence[torch.Tensor], ...],
    model_params: Sequence[torch.Tensor | None] | None,
    step: torch.Tensor,
    lr: Scalar,
    inv_scale: Scalar | None,
    found_inf: torch.Tensor | None,
    check_pass: Callable[[torch.device, torch.Tensor, torch.Tensor], Any],
    hparams: Callable[[torch.device, torch.Tensor, Any], torch.Tensor],
    **modes: Any,
) -> torch.Tensor:
    """The sequence of :func:`lamb_step_` and :func:`adam_step_` over ``lists`` (params, grads, exp_avgs,
    exp_avg_sqs): check the lists; take the flag (``found_inf`` or a new one); ``check_pass(device, inv_scale64,
    flag)`` over the grads (its result goes to ``hparams``); the skip (the flag, raised for a bad tensor ``lr``);
    ``step += 1`` unless skipped; ``hparams(device, inv_scale64, checked)``, the float64 hyper-parameter vector; then
    ``update`` (``lamb_update`` or ``adam_update``) with ``modes``. Returns the flag."""
    device, models = _check_lists(fn, lists, model_params, step, found_inf)
    if device is None:
        return new_found_inf(step.device) if found_inf is None else found_inf
    flag = new_found_inf(device) if found_inf is None else found_inf
    inv64 = _scalar64("inv_scale", 1.0 if inv_scale is None else inv_scale, device)
    checked = check_pass(device, inv64, flag)
    skip = _with_bad_lr(flag, lr, device, own=found_inf is None)
    advance_step(step, skip)
    hp64 = hparams(device, inv64, checked)
    update(*(list(t) for t in lists), models, hp64, skip, step=step, **modes)
    return flag


@torch.no_grad()
def lamb_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: torch.Tensor,
    lr: Scalar = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    use_nvlamb: bool = False,
    max_grad_norm: float = 1.0,
    model_params: Sequence[torch.Tensor | None] | None = None,
    inv_scale: Scalar | None = None,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """One LAMB step (apex ``FusedLAMB`` math, ``docs/specs/lamb.md``) over lists of tensors, in place.

    ``grads[i]`` may be scaled by a loss scale: every element is multiplied by ``inv_scale`` first. The
    global norm (over this call's grads) clips the gradients when it exceeds ``max_grad_norm``; then::

        step += 1;  t = step
        m = b1 m + beta3 g;  v = b2 v + (1 - b2) g^2       (beta3 = 1 - b1 with grad_averaging, else 1)
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)  [+ wd p when adam_w_mode; L2 adds wd p to g]
        p = p - ratio u,   ratio = lr |p| / |u|  (when use_nvlamb or wd != 0, and both norms non-zero) else lr

    Args:
        params: the tensors to update (fp16, bf16, fp32 or fp64); fp32 masters in master-weights use.
        grads: their gradients (any float dtype, possibly loss-scaled); never modified.
        exp_avgs, exp_avg_sqs: the moments, float32 (float64 for float64 params), updated in place.
        step: one-element floating tensor with the number of steps taken so far; incremented in place on
            the device unless the step is skipped.
        lr: learning rate, a float or a one-element device tensor (no recompiles, no sync).
        model_params: optional low-precision copies written with ``round_to_nearest_even(params[i])``
            after the update (``None`` entries allowed), e.g. fp16 model params of fp32 masters.
        inv_scale: ``1 / loss_scale`` (float or device tensor); default 1.
        found_inf: optional one-element float32 flag. It is raised to 1 if any unscaled gradient is
            inf/NaN (with ``max_grad_norm=0``, no clipping: or of magnitude ``2**63`` (9.2e18) or more, whose
            square would overflow the second moment, as ``FusedLAMB`` skips it), and when it is set (by that
            check or before the call) nothing at all changes — params, moments, model copies and ``step``.

    A tensor ``lr`` that is NaN, inf or negative skips the step on the device in the same way (no host
    sync); it raises the returned flag only when this call made the flag (a caller's loss-scaler
    ``found_inf`` is left alone: ``step`` not advancing shows the skip). Host hyper-parameters are
    validated (``ValueError``; ``eps`` must be >= 1.18e-38, see ``docs/optim.md``).

    Returns:
        The ``found_inf`` flag (the one passed in, or a new one): read it to learn whether the step was skipped.
    """
    fn = "lamb_step_"
    check_hyperparams(fn, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)

    def check_pass(device: torch.device, inv64: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        if float(max_grad_norm) > 0:
            return check_and_norm(list(grads), inv64, flag)
        # no clipping: the moments square the gradients as they are (the square guard; the norm is not used)
        gnorm = torch.zeros((), dtype=torch.float32, device=device)
        check_square_guard(grads, inv64, flag)
        return gnorm

    def hparams(device: torch.device, inv64: torch.Tensor, gnorm: torch.Tensor) -> torch.Tensor:
        return lamb_hparams(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
            grad_averaging=grad_averaging, step=step, inv_scale64=inv64,
            clip64=clip_factor(gnorm, float(max_grad_norm)), device=device,
        )

    return _step_lists(
        fn, lamb_update, (params, grads, exp_avgs, exp_avg_sqs), model_params, step, lr, inv_scale, found_inf,
        check_pass, hparams, weight_decay=float(weight_decay), adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
    )


@torch.no_grad()
def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: torch.Tensor,
    lr: Scalar = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    model_params: Sequence[torch.Tensor | None] | None = None,
    inv_scale: Scalar | None = None,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Adam (``adam_w_mode=False``) or AdamW step over lists of tensors, in place, as ``torch.optim``.

    Math (``torch.optim.Adam``/``AdamW``; fp32 arithmetic in torch's order of operations)::

        step += 1;  t = step;  g = grad * inv_scale   [+ wd p when not adam_w_mode]
        m = lerp(m, g, 1 - b1);  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd)   when adam_w_mode
        p = p - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)

    A check pass over the grads raises ``found_inf`` first on any unscaled gradient that is inf/NaN or of
    magnitude ``2**63`` (9.2e18) or more (:data:`SQUARE_GUARD`: its square would make ``v`` inf, and the element
    would never move again), the rule ``FusedAdam`` follows; when the flag is set nothing changes (params,
    moments, model copies, ``step``). Arguments, validation and the tensor-``lr`` skip as
    :func:`lamb_step_` (no clipping). Returns the ``found_inf`` flag.
    """
    fn = "adam_step_"
    check_hyperparams(fn, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def check_pass(device: torch.device, inv64: torch.Tensor, flag: torch.Tensor) -> None:
        check_square_guard(grads, inv64, flag)

    def hparams(device: torch.device, inv64: torch.Tensor, _: None) -> torch.Tensor:
        return adam_hparams(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction, step=step,
            inv_scale64=inv64, device=device,
        )

    return _step_lists(
        fn, adam_update, (params, grads, exp_avgs, exp_avg_sqs), model_params, step, lr, inv_scale, found_inf,
        check_pass, hparams, weight_decay=float(weight_decay), adam_w_mode=adam_w_mode,
    )
