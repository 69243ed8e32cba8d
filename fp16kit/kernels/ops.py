"""Public multi-tensor operations: validate, pick a backend, launch once per dtype group.

Each function takes whole lists of tensors. Layouts are validated first, the same way on every backend
(``_checks.check_writes``: no output shared with another pair, docs/kernels.md).
Contiguous fp16/bf16/fp32 tensors go to the Triton kernels (one launch per dtype combination, via a cached
address table) when the backend is Triton or the Triton interpreter; non-contiguous or float64 tensors, and
every tensor when the backend is the torch fallback, go to ``fp16kit.kernels.fallback``. No function syncs
with the host. Every tensor a call writes has its ``_version`` bumped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import fallback
from ._checks import (
    KERNEL_DTYPES,
    check_flag,
    check_pairs,
    check_scalar_tensor,
    check_tensor_list,
    check_writes,
    common_device,
    resolve_inputs,
)
from ._table import index_tensor
from .backend import Backend, select_backend

__all__ = ["copy_", "l2norm", "unscale_and_check"]

_KERNEL_DTYPES = frozenset(KERNEL_DTYPES)


def _device_scalar(fn: str, name: str, value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A Python float becomes a one-element float64 tensor on ``device`` (a fill, not a host sync): float64
    tensors are scaled by the value itself, the others by its round-to-nearest fp32 (``.to(float32)`` in the
    kernel and the fallback), exactly as ``fp16kit.numerics.reference`` rounds it."""
    if isinstance(value, torch.Tensor):
        check_scalar_tensor(fn, name, value, device)
        return value.reshape(1)
    return torch.full((1,), float(value), dtype=torch.float64, device=device)


def _plan(
    device: torch.device, first: Sequence[torch.Tensor], second: Sequence[torch.Tensor] | None = None
) -> tuple[list[list[int]], list[list[int]]]:
    """Group positions of ``first`` (paired with ``second``) by dtypes: groups for the Triton kernels (backend
    allows it; contiguous fp16/bf16/fp32) and groups for the torch fallback (any strides, float64, or a torch
    backend). Empty tensors are in neither: there is nothing to do for them. One plain loop: this runs on every
    call, for every tensor, so it avoids per-row generators."""
    triton_ok = select_backend(device).backend is not Backend.TORCH
    kernel: dict[object, list[int]] = {}
    rest: dict[object, list[int]] = {}
    ok = _KERNEL_DTYPES
    last_key: object = None
    last_fits = False
    last_group: list[int] = []
    for i, x in enumerate(first):
        if x.numel() == 0:
            continue
        if second is None:
            key: object = x.dtype
            fits = triton_ok and key in ok and x.is_contiguous()
        else:
            y = second[i]
            key = (x.dtype, y.dtype)
            fits = triton_ok and x.dtype in ok and y.dtype in ok and x.is_contiguous() and y.is_contiguous()
        if key == last_key and fits == last_fits:  # runs of one dtype are the common case
            last_group.append(i)
            continue
        last_key, last_fits = key, fits
        last_group = (kernel if fits else rest).setdefault(key, [])
        last_group.append(i)
    return list(kernel.values()), list(rest.values())


def _pick(tensors: list[torch.Tensor], idx: list[int]) -> list[torch.Tensor]:
    return tensors if len(idx) == len(tensors) else [tensors[i] for i in idx]


def _scatter(dst: torch.Tensor, chosen: list[int], values: torch.Tensor) -> None:
    """``dst[chosen] = values``; the common all-in-order case needs no index tensor."""
    if len(chosen) == dst.numel() and chosen == list(range(len(chosen))):
        dst.copy_(values)
    else:
        dst[index_tensor(chosen, dst.device)] = values  # cached: no copy, no host sync per call


def _bump(written: list[torch.Tensor]) -> None:
    """Record an in-place write for autograd and caches (e.g. autocast's weight cache), as torch's own in-place
    ops do: the Triton kernels write raw memory, which torch cannot see. Bumping twice is harmless, so the
    torch fallback's writes (which bump already) are not told apart."""
    torch.autograd.graph.increment_version(written)


def unscale_and_check(
    tensors: Sequence[torch.Tensor],
    inv_scale: float | torch.Tensor,
    found_inf: torch.Tensor,
    *,
    out: Sequence[torch.Tensor] | None = None,
    sq_norm: torch.Tensor | None = None,
) -> None:
    """Unscale a list of tensors and flag inf/NaN, in one fused pass per dtype group.

    For every element ``x`` of ``tensors[i]``::

        y = fp32(x) * fp32(inv_scale)            # float64 math (and scale) for float64 tensors
        w = round_to_nearest_even(y, dtype of the destination)
        destination[i] = w                       # ``out[i]`` if given, else ``tensors[i]`` in place
        found_inf = 1 if any w is inf or NaN      # never cleared: zero it before the first call
        sq_norm += sum(y * y)                      # only when ``sq_norm`` is given; accumulated in float64

    Args:
        tensors: floating tensors (fp16, bf16, fp32, fp64; dtypes may be mixed), all on one device.
        inv_scale: ``1 / loss_scale`` as a Python float or a one-element tensor on that device; a
            tensor is read by the kernel, so a scale that lives on the GPU costs no host sync.
        found_inf: one-element float32 tensor on that device; raised to 1, never lowered.
        out: optional destinations of any float dtype, paired with ``tensors`` by position (e.g. fp16
            model grads unscaled into fp32 master grads). ``out=None`` writes in place. Each pair is in
            place exactly when ``out[i]`` is the same view as ``tensors[i]``; a list may mix both.
        sq_norm: optional one-element float32 or float64 tensor that accumulates the squared L2 norm of the
            unscaled values ``y`` (before rounding to the destination dtype), so gradient clipping and
            LAMB's global norm cost no second read of the gradients. The sum is formed in float64 (no
            overflow or underflow for finite ``y``) and added once, so an fp32 ``sq_norm`` is off by one
            rounding of the float64 result (inf only when ``sum(y*y)`` exceeds fp32's range, about a norm of
            1.8e19; ``found_inf`` is never raised by that).

    Raises:
        ValueError: an output that overlaps another output or another pair's input (only the exact in-place
            view is allowed), an output with internal overlap (stride-0 expanded view) or with the negative
            bit (``complex.conj().imag``), on every backend. Inputs with the negative bit are resolved.

    Checking the *written* value catches inputs that are already inf/NaN as well as finite values
    that overflow only after scaling (``inv_scale > 1``) or after the cast (fp32 -> fp16 ``out``).
    Every written tensor's ``_version`` is bumped (``found_inf`` and the outputs).
    """
    fn = "unscale_and_check"
    inputs = check_tensor_list(fn, "tensors", tensors)
    outputs = inputs if out is None else check_tensor_list(fn, "out", out)
    if out is not None:
        check_pairs(fn, "tensors", inputs, "out", outputs)
    device = common_device(fn, inputs, outputs)
    check_flag(fn, found_inf, device)
    if sq_norm is not None:
        check_flag(fn, sq_norm, device, name="sq_norm", float64_ok=True)
    if device is None:
        return
    if out is None:
        check_writes(fn, "tensors", outputs)
    else:
        check_writes(fn, "out", outputs, "tensors", inputs)
        inputs = resolve_inputs(inputs)
    scale = _device_scalar(fn, "inv_scale", inv_scale, device)
    flag = found_inf.reshape(1)

    kernel_groups, rest_groups = _plan(device, inputs, None if out is None else outputs)
    partials = []
    if kernel_groups:
        from .unscale_kernel import launch_unscale

        for idx in kernel_groups:
            p = launch_unscale(_pick(inputs, idx), _pick(outputs, idx), scale, flag, sq_norm is not None)
            if p is not None:
                partials.append(p)
    for idx in rest_groups:
        p = fallback.unscale(_pick(inputs, idx), _pick(outputs, idx), scale, flag, sq_norm is not None)
        if p is not None:
            partials.append(p)
    if sq_norm is not None and partials:
        sq_norm.add_(torch.cat(partials).sum().reshape(sq_norm.shape))  # float64 sum, one rounding into sq_norm
    _bump([found_inf, *outputs] if sq_norm is None else [found_inf, sq_norm, *outputs])


def l2norm(
    tensors: Sequence[torch.Tensor],
    *,
    per_tensor: bool = False,
    pre_scale: float | torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 L2 norm of a whole list of tensors, optionally with each tensor's own norm.

    Math: ``y = fp32(x) * fp32(pre_scale)`` (float64 for float64 tensors), ``norm = sqrt(sum y^2)``. The
    squares are formed and summed in float64 (per block of 4096 elements as a tree, then over blocks in a fixed
    order: results are deterministic run to run) and the root is rounded once to fp32. So for every finite
    input the result is within 1 ulp (fp32) of the exact norm of the ``y``: no overflow for values near fp32's
    maximum, no underflow for subnormals; it is inf only when the norm itself exceeds fp32's maximum.

    Args:
        tensors: floating tensors on one device (dtypes may be mixed).
        per_tensor: also return the 1-D fp32 tensor of per-tensor norms, as ``(global, per_tensor)``.
        pre_scale: multiply every element by this first (e.g. ``inv_scale`` to get the norm of
            unscaled gradients); Python float or one-element device tensor.
        found_inf: optional one-element float32 flag raised to 1 if any scaled element ``y`` is inf/NaN;
            never by a large finite norm.

    Returns:
        A 0-dim fp32 tensor on the tensors' device (``(global, per_tensor)`` with ``per_tensor``).
        An empty list gives 0 (on the CPU).

    Inputs are only read; a negative-bit view (``complex.conj().imag``) is read as raw memory, which has the
    same squares and the same non-finite elements.
    """
    fn = "l2norm"
    items = check_tensor_list(fn, "tensors", tensors)
    device = common_device(fn, items)
    if found_inf is not None:
        check_flag(fn, found_inf, device)
    if device is None:
        zero = torch.zeros((), dtype=torch.float32)
        return (zero, torch.zeros(0, dtype=torch.float32)) if per_tensor else zero
    scale = _device_scalar(fn, "pre_scale", 1.0 if pre_scale is None else pre_scale, device)
    flag = None if found_inf is None else found_inf.reshape(1)

    sumsq = torch.zeros(len(items), dtype=torch.float64, device=device)
    kernel_groups, rest_groups = _plan(device, items)
    if kernel_groups:
        from .l2norm_kernel import launch_sumsq, segment_sums

        for idx in kernel_groups:
            partials, table = launch_sumsq(_pick(items, idx), scale, flag)
            _scatter(sumsq, idx, segment_sums(partials, table))
    for idx in rest_groups:
        ys = fallback.scaled(_pick(items, idx), scale)
        _scatter(sumsq, idx, fallback.sumsq_per_tensor(ys))
        if flag is not None:
            fallback.flag_nonfinite_(ys, flag)  # ys are our own temporaries
    if found_inf is not None:
        _bump([found_inf])
    total = sumsq.sum().sqrt().float()
    return (total, sumsq.sqrt().float()) if per_tensor else total


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for whole lists: one launch per (source, destination) dtype pair.

    Casts round to nearest even, bit-identical to ``Tensor.copy_`` (e.g. fp32 master weights into
    fp16/bf16 model params). ``dst[i]`` and ``src[i]`` must have the same shape. A destination may be the same
    view as its own source; it may not overlap another destination or another source, nor have internal
    overlap or the negative bit (``ValueError``, every backend). Sources with the negative bit are resolved.
    Every destination's ``_version`` is bumped.
    """
    fn = "copy_"
    dsts = check_tensor_list(fn, "dst", dst)
    srcs = check_tensor_list(fn, "src", src)
    check_pairs(fn, "dst", dsts, "src", srcs)
    device = common_device(fn, dsts, srcs)
    if device is None:
        return
    check_writes(fn, "dst", dsts, "src", srcs)
    srcs = resolve_inputs(srcs)
    kernel_groups, rest_groups = _plan(device, srcs, dsts)
    if kernel_groups:
        from .copy_kernel import launch_copy

        for idx in kernel_groups:
            launch_copy(_pick(dsts, idx), _pick(srcs, idx))
    for idx in rest_groups:
        fallback.copy_(_pick(dsts, idx), _pick(srcs, idx))
    _bump(dsts)
