"""apex's ``amp_C`` extension, on fp16kit's kernels: same names, arguments and return values.

Compatibility shim: scripts that call ``multi_tensor_applier(amp_C.<op>, noop_flag, lists, *args)`` run
unchanged. Conventions (apex's ``csrc/amp_C_frontend.cpp``):

* every op takes ``(chunk_size, noop_flag, tensor_lists, *args)``; ``chunk_size`` is accepted and unused
  (fp16kit's kernels pick their own blocks; results do not depend on it);
* ``noop_flag`` is a one-element integer tensor (apex: ``torch.zeros(1, dtype=torch.int, device=...)``) on
  the tensors' device. An op that finds inf/NaN sets it to 1; nothing ever clears it (zero it yourself);
* all arithmetic is fp32 (inputs of any of fp16/bf16/fp32 are widened first, results rounded once);
* no op syncs with the host: the flag, the norms and the scale stay on the device.

The public fp16kit way is to call ``fp16kit.kernels`` (``unscale_and_check``, ``l2norm``, ``copy_``) and
``fp16kit.optim.functional`` (``lamb_step_``, ``adam_step_``) directly, with a float32 ``found_inf``.

Differences from apex, all in the direction of never writing NaN/inf silently (docs/migrating-from-apex.md):

* ``multi_tensor_scale`` flags a non-finite *output* (apex checked the input only): a finite value that
  overflows when scaled or cast to fp16 raises the flag too.
* ``multi_tensor_lamb`` / ``multi_tensor_adam`` skip the update (params and moments unchanged) when a
  gradient is inf/NaN and set ``noop_flag``; apex wrote NaN into the params. ``multi_tensor_lamb`` leaves
  the gradients untouched (apex overwrote them with the LAMB update direction as scratch space).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp16kit.kernels import (
    check_device,
    check_pairs,
    check_tensor_list,
    common_device,
    l2norm,
    new_found_inf,
    unscale_and_check,
)
from fp16kit.optim.functional import adam_step_, lamb_step_

__all__ = [
    "multi_tensor_adam",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_lamb",
    "multi_tensor_scale",
    "multi_tensor_unscale_l2norm",
    "update_scale_hysteresis",
]

TensorLists = Sequence[Sequence[torch.Tensor]]


def _lists(fn: str, tensor_lists: TensorLists, names: tuple[str, ...]) -> tuple[list[list[torch.Tensor]],
                                                                                torch.device | None]:
    """``tensor_lists`` as ``len(names)`` validated lists that pair up, and their device."""
    if isinstance(tensor_lists, torch.Tensor) or len(tensor_lists) != len(names):
        raise ValueError(
            f"amp_C.{fn}: tensor_lists must be a list of {len(names)} lists [{', '.join(names)}], "
            f"got {type(tensor_lists).__name__} of length {len(tensor_lists)}."
        )
    lists = [check_tensor_list(f"amp_C.{fn}", name, ts) for name, ts in zip(names, tensor_lists)]
    for name, other in zip(names[1:], lists[1:]):
        check_pairs(f"amp_C.{fn}", names[0], lists[0], name, other)
    return lists, common_device(f"amp_C.{fn}", *lists)


def _check_noop(fn: str, noop_flag: torch.Tensor, device: torch.device | None) -> None:
    if (not isinstance(noop_flag, torch.Tensor) or noop_flag.numel() != 1
            or noop_flag.is_floating_point() or noop_flag.is_complex() or noop_flag.dtype == torch.bool):
        raise TypeError(
            f"amp_C.{fn}: noop_flag must be a one-element integer tensor, e.g. "
            f"torch.zeros(1, dtype=torch.int, device=...); got {noop_flag!r}."
        )
    check_device(f"amp_C.{fn}", "noop_flag", noop_flag, device)


def _raise_noop(noop_flag: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``noop_flag = 1`` where ``found_inf`` is set (device op, never clears the flag)."""
    noop_flag.masked_fill_((found_inf != 0).reshape(noop_flag.shape), 1)


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """``out[i] = round(fp32(in[i]) * scale)`` for ``tensor_lists = [ins, outs]``; flag inf/NaN outputs.

    ``fp16kit.kernels.unscale_and_check(ins, scale, found_inf, out=outs)`` with an int flag. Input and
    output may be the same tensors (in place) and of different dtypes (e.g. fp16 grads into fp32 masters).
    Like apex's CUDA kernel it writes the outputs behind autograd, model params included (apex's
    ``master_params_to_model_params``), on every backend (``unscale_and_check`` refuses leaf outputs that
    require grad while grad mode is on, as torch does).
    """
    (ins, outs), device = _lists("multi_tensor_scale", tensor_lists, ("inputs", "outputs"))
    _check_noop("multi_tensor_scale", noop_flag, device)
    if device is None:
        return
    flag = new_found_inf(device)
    with torch.no_grad():
        unscale_and_check(ins, float(scale), flag, out=outs)
    _raise_noop(noop_flag, flag)


def _norms(fn: str, noop_flag: torch.Tensor, tensor_lists: TensorLists, pre_scale: float | torch.Tensor,
           per_tensor: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    (xs,), device = _lists(fn, tensor_lists, ("tensors",))
    _check_noop(fn, noop_flag, device)
    if device is None:
        raise ValueError(f"amp_C.{fn}: tensor_lists[0] is empty; apex needs at least one tensor to pick a device.")
    flag = new_found_inf(device)
    total, each = l2norm(xs, per_tensor=True, pre_scale=pre_scale, found_inf=flag)
    # apex also flags a norm that overflows fp32 (finite elements, infinite norm); fp16kit's squares are summed
    # in float64, so unlike apex's only a norm beyond fp32's range is inf
    torch.maximum(flag, (~torch.isfinite(total)).float().reshape(1), out=flag)
    _raise_noop(noop_flag, flag)
    empty = torch.empty(0, dtype=torch.float32, device=device)
    return total.reshape(1), (each if per_tensor else empty)


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                        per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, per_tensor_norms)`` of ``tensor_lists = [tensors]``: fp32 ``[1]`` and ``[n]`` (``[0]`` unless
    ``per_tensor``). ``norm = sqrt(sum_i sum_j fp32(x_ij)^2)`` (``fp16kit.kernels.l2norm``, squares summed in
    float64); the flag is set when an element or the norm is inf/NaN (apex also flagged finite norms above
    ~1.8e19, whose fp32 sum of squares overflowed)."""
    return _norms("multi_tensor_l2norm", noop_flag, tensor_lists, 1.0, per_tensor)


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                                inv_scale: torch.Tensor, per_tensor: bool | None = False,
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`multi_tensor_l2norm` of ``fp32(x) * inv_scale`` (``inv_scale``: one-element fp32 device
    tensor). The tensors themselves are not modified."""
    if not isinstance(inv_scale, torch.Tensor):
        raise TypeError("amp_C.multi_tensor_unscale_l2norm: inv_scale must be a one-element float32 tensor on the "
                        "tensors' device, e.g. torch.tensor([1 / scale], device=...).")
    return _norms("multi_tensor_unscale_l2norm", noop_flag, tensor_lists, inv_scale, per_tensor)


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, a: float, b: float,
                       arg_to_check: int) -> None:
    """``out[i] = round(a * fp32(x[i]) + b * fp32(y[i]))`` for ``tensor_lists = [xs, ys, outs]``.

    ``arg_to_check``: -1 flags inf/NaN in ``x`` or ``y``, 0 in ``x`` only, 1 in ``y`` only (apex's
    convention; other values check nothing). The check reads the inputs in one ``l2norm`` pass per list.
    fp32 math; ``a`` and ``b`` are rounded to fp32 first, as apex's ``float`` arguments.
    """
    (xs, ys, outs), device = _lists("multi_tensor_axpby", tensor_lists, ("x", "y", "out"))
    _check_noop("multi_tensor_axpby", noop_flag, device)
    if device is None:
        return
    flag = new_found_inf(device)
    for which, ts in ((0, xs), (1, ys)):
        if arg_to_check in (-1, which):
            l2norm(ts, found_inf=flag)
    a32, b32 = float(torch.tensor(a, dtype=torch.float32)), float(torch.tensor(b, dtype=torch.float32))
    with torch.no_grad():
        ax = torch._foreach_mul([x.float() for x in xs], a32)
        torch._foreach_add_(ax, torch._foreach_mul([y.float() for y in ys], b32))
        for out, value in zip(outs, ax):
            out.copy_(value)
    _raise_noop(noop_flag, flag)


def _step_tensor(fn: str, step: int, device: torch.device) -> torch.Tensor:
    """fp16kit's functional steps count ``step`` up themselves: hand them ``step - 1``."""
    if int(step) != step or step < 1:
        raise ValueError(f"amp_C.{fn}: step must be the 1-based number of the step being taken, got {step!r}.")
    return torch.full((1,), float(step) - 1.0, dtype=torch.float32, device=device)


def _optimizer_lists(fn: str, noop_flag: torch.Tensor, tensor_lists: TensorLists, mode: int,
                     ) -> tuple[list[list[torch.Tensor]], torch.device | None]:
    """``[grads, params, exp_avgs, exp_avg_sqs]`` validated, with the flag and apex's ``mode`` (0 L2, 1 decoupled)."""
    lists, device = _lists(fn, tensor_lists, ("grads", "params", "exp_avgs", "exp_avg_sqs"))
    _check_noop(fn, noop_flag, device)
    if mode not in (0, 1):
        raise ValueError(f"amp_C.{fn}: mode must be 0 (L2 regularization) or 1 (decoupled weight decay), got {mode}.")
    return lists, device


def multi_tensor_lamb(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, bias_correction: int, weight_decay: float,
                      grad_averaging: int, mode: int, global_grad_norm: torch.Tensor, max_grad_norm: float,
                      use_nvlamb: bool | None = False) -> None:
    """One LAMB step on ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]`` (apex's argument order).

    Math (apex): ``g' = g / c`` with ``c = global_grad_norm / max_grad_norm`` when ``global_grad_norm >
    max_grad_norm``, else 1; ``mode`` 0 adds ``weight_decay * p`` to ``g'`` (L2), 1 adds it to the update
    (decoupled); then ``fp16kit.optim.functional.lamb_step_`` (docs/optim.md) with ``step`` the 1-based step
    number, ``beta3 = 1 - beta1`` when ``grad_averaging`` else 1, bias correction when ``bias_correction``.
    The division by ``c`` is a multiplication by ``1/c`` (within one fp32 rounding of apex's quotient).
    Moments must be fp32 (fp16kit keeps optimizer state in fp32). inf/NaN in a gradient: nothing changes
    and ``noop_flag`` is set.
    """
    fn = "multi_tensor_lamb"
    (gs, ps, ms, vs), device = _optimizer_lists(fn, noop_flag, tensor_lists, mode)
    if device is None:
        return
    if not isinstance(global_grad_norm, torch.Tensor) or global_grad_norm.numel() != 1:
        raise TypeError(f"amp_C.{fn}: global_grad_norm must be a one-element tensor (e.g. from multi_tensor_l2norm).")
    gnorm = global_grad_norm.detach().reshape(1).to(device=device, dtype=torch.float32)
    clip = torch.where(gnorm > float(max_grad_norm), gnorm / float(max_grad_norm), torch.ones_like(gnorm))
    flag = new_found_inf(device)
    lamb_step_(ps, gs, ms, vs, step=_step_tensor(fn, step, device), lr=lr, betas=(beta1, beta2), eps=epsilon,
               weight_decay=weight_decay, bias_correction=bool(bias_correction), grad_averaging=bool(grad_averaging),
               adam_w_mode=mode == 1, use_nvlamb=bool(use_nvlamb), max_grad_norm=0.0,
               inv_scale=clip.reciprocal(), found_inf=flag)
    _raise_noop(noop_flag, flag)


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                      weight_decay: float) -> None:
    """One Adam step on ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]`` (apex's argument order).

    ``mode`` 0: L2 (``g + weight_decay * p``, ``torch.optim.Adam``), 1: decoupled (AdamW); ``step`` is the
    1-based step number; ``fp16kit.optim.functional.adam_step_``. apex's math is
    ``p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) [+ wd p])``, the same update in another order of fp32
    operations (a few ulps apart). inf/NaN in a gradient: nothing changes and ``noop_flag`` is set.
    """
    fn = "multi_tensor_adam"
    (gs, ps, ms, vs), device = _optimizer_lists(fn, noop_flag, tensor_lists, mode)
    if device is None:
        return
    flag = new_found_inf(device)
    adam_step_(ps, gs, ms, vs, step=_step_tensor(fn, step, device), lr=lr, betas=(beta1, beta2), eps=epsilon,
               weight_decay=weight_decay, adam_w_mode=mode == 1, bias_correction=bool(bias_correction),
               found_inf=flag)
    _raise_noop(noop_flag, flag)


def update_scale_hysteresis(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                            hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                            backoff_factor: float, growth_interval: int, hysteresis: int) -> torch.Tensor:
    """apex's dynamic-scale update with hysteresis, in place on the device; returns ``current_scale``.

    ``current_scale`` fp32 ``[1]``, ``growth_tracker`` / ``hysteresis_tracker`` int32 ``[1]``, ``found_inf``
    fp32 ``[1]``. Rules (apex's ``update_scale_hysteresis.cu``)::

        found_inf > 0:  hysteresis_tracker -= 1
                        if hysteresis_tracker > 0: growth_tracker = 0; stop      (overflow tolerated)
        found_inf != 0: scale = ftz(fp32(scale * backoff_factor)); growth_tracker = 0
        else:           growth_tracker += 1
                        if growth_tracker == growth_interval:
                            scale = fp32(scale * growth_factor) unless that is inf; growth_tracker = 0
        found_inf <= 0: hysteresis_tracker = hysteresis

    Products are formed in float64 and rounded once (apex multiplies the float by a double); a backed-off scale
    below fp32's smallest normal becomes 0, as apex's flush-to-zero build does (its test checks it). No host sync.
    The public fp16kit way: ``fp16kit.amp.LossScaler(hysteresis=...)`` (docs/grad-scaler.md).
    """
    fn = "update_scale_hysteresis"
    for name, t, dtype in (("current_scale", current_scale, torch.float32), ("growth_tracker", growth_tracker,
                           torch.int32), ("hysteresis_tracker", hysteresis_tracker, torch.int32),
                           ("found_inf", found_inf, torch.float32)):
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != dtype:
            raise TypeError(f"amp_C.{fn}: {name} must be a one-element {dtype} tensor, got {t!r}.")
        if t.device != current_scale.device:
            raise ValueError(f"amp_C.{fn}: {name} is on {t.device} but current_scale is on {current_scale.device}.")
    with torch.no_grad():
        inf = found_inf.reshape(1)
        scale64 = current_scale.reshape(1).to(torch.float64)
        growth = growth_tracker.reshape(1)
        hyst = hysteresis_tracker.reshape(1) - (inf > 0).to(torch.int32)
        tolerated = (inf > 0) & (hyst > 0)
        backoff = (inf != 0) & ~tolerated
        clean = inf == 0
        successful = growth + 1
        grow = clean & (successful == int(growth_interval))
        grown = (scale64 * float(growth_factor)).float()
        backed = (scale64 * float(backoff_factor)).float()
        # apex's kernel is built with --use_fast_math: a backed-off scale below the smallest normal flushes to 0
        backed = torch.where(backed.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(backed), backed)
        new_scale = torch.where(backoff, backed, current_scale.reshape(1))
        new_scale = torch.where(grow & torch.isfinite(grown), grown, new_scale)
        new_growth = torch.where(clean & ~grow, successful, torch.zeros_like(growth))
        new_hyst = torch.where(inf <= 0, torch.full_like(hyst, int(hysteresis)), hyst)
        current_scale.copy_(new_scale.reshape(current_scale.shape))
        growth_tracker.copy_(new_growth.reshape(growth_tracker.shape))
        hysteresis_tracker.copy_(new_hyst.reshape(hysteresis_tracker.shape))
    return current_scale
