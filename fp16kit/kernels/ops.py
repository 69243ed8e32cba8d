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

from .engine import plan as _plan
from .engine.checks import check_flag, check_scalar_tensor, check_tensor_list, resolve_inputs
from .engine.table import index_tensor, playing
from .fallback import copy as fb_copy
from .fallback import l2norm as fb_l2norm
from .fallback import unscale as fb_unscale

__all__ = ["copy_", "forget_autocast_casts", "l2norm", "unscale_and_check"]

# The rows of each op, for the planner (fp16kit/kernels/engine/plan.py): validation, grouping and the cache.
_UNSCALE = _plan.Spec("unscale_and_check", ("tensors",), written=(0,), key_rows=(0,))
_UNSCALE_OUT = _plan.Spec("unscale_and_check", ("tensors", "out"), written=(1,), key_rows=(0, 1))
_L2NORM = _plan.Spec("l2norm", ("tensors",), written=(), key_rows=(0,))
_COPY = _plan.Spec("copy_", ("dst", "src"), written=(0,), key_rows=(1, 0))


def _seq(fn: str, name: str, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """A list or tuple as it is (the planner reads it without a copy); anything else validated into a list."""
    if tensors.__class__ is list or tensors.__class__ is tuple:
        return tensors
    return check_tensor_list(fn, name, tensors)


#: torch's own error for an in-place write into a leaf that requires grad, while grad mode is on
_LEAF_ERROR = "a leaf Variable that requires grad is being used in an in-place operation."


def _check_leaf_outputs(fn: str, name: str, outputs: Sequence[torch.Tensor]) -> None:
    """As ``Tensor.copy_`` (and every torch in-place op): with grad mode on, writing into a leaf tensor that
    requires grad (an ``nn.Parameter``) is a RuntimeError, raised here before anything is written, on every
    backend alike (the Triton kernels write raw memory, which autograd cannot refuse). Under ``torch.no_grad()``
    (how optimizers and amp write their params) it is allowed, as in torch."""
    if not torch.is_grad_enabled():
        return
    for i, t in enumerate(outputs):
        if t.requires_grad and t.is_leaf:
            raise RuntimeError(f"{fn}: {name}[{i}]: {_LEAF_ERROR} Write it under torch.no_grad().")


def _device_scalar(fn: str, name: str, value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A Python float becomes a one-element float64 tensor on ``device`` (a fill, not a host sync): float64
    tensors are scaled by the value itself, the others by its round-to-nearest fp32 (``.to(float32)`` in the
    kernel and the fallback), exactly as ``fp16kit.numerics.reference`` rounds it."""
    if isinstance(value, torch.Tensor):
        check_scalar_tensor(fn, name, value, device)
        return value.reshape(1)
    return torch.full((1,), float(value), dtype=torch.float64, device=device)


def _scatter(dst: torch.Tensor, group: _plan.Group, values: torch.Tensor) -> None:
    """``dst[group.idx] = values``; the common all-in-order case needs no index tensor."""
    if group.whole:
        dst.copy_(values)
    else:
        dst[index_tensor(group.idx, dst.device)] = values  # cached: no copy, no host sync per call


#: Record an in-place write for autograd and caches (e.g. autocast's weight cache), as torch's own in-place ops do:
#: the Triton kernels write raw memory, which torch cannot see, and torch's fused unscale
#: (``_amp_foreach_non_finite_check_and_unscale_``, the fallback's) bumps nothing either. Bumping twice is
#: harmless, so writes by ops that bump already (``_foreach_copy_``) are not told apart. (The C function behind
#: ``torch.autograd.graph.increment_version``, without its Python frame.)
_bump = torch._C._increment_version


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
    tensors = _seq(fn, "tensors", tensors)
    rows = (tensors,) if out is None else (tensors, _seq(fn, "out", out))
    if out is not None:
        _check_leaf_outputs(fn, "out", rows[1])
    if isinstance(found_inf, torch.Tensor):
        # The flag and the scale are checked with the lists, on a miss; on a hit the guard pins their metadata.
        scale_t = inv_scale if isinstance(inv_scale, torch.Tensor) else None
        aux = (found_inf,) if scale_t is None else (found_inf, scale_t)
        if sq_norm is not None:
            aux += (sq_norm,)
        plan = _plan.plan(
            _UNSCALE if out is None else _UNSCALE_OUT,
            rows,
            aux=aux,
            aux_key=(scale_t is None, sq_norm is None),
            check_aux=lambda device: _check_unscale_args(found_inf, inv_scale, sq_norm, device),
        )
    else:
        check_flag(fn, found_inf, None)  # raises: not a tensor
    device = plan.device
    if device is None:
        return
    inputs = tensors
    outputs = rows[-1]
    with_norm = sq_norm is not None
    if not plan.kernel and not with_norm and len(plan.rest) == 1 and not plan.neg_inputs:
        # the group's own pairs, not the whole list: empty tensors of another dtype are in no group, and must not
        # decide the math dtype of the ones that are (an empty fp16 grad beside a float64 one)
        group = plan.rest[0]
        ins, outs = group.pick(inputs), group.pick(outputs)
        direct = group.memo.get("direct")
        if direct is None:
            in_place = fb_unscale.in_place_pairs(ins, outs)
            direct = group.memo["direct"] = fb_unscale.fused_unscale_mode(ins, outs, in_place)
        if direct:  # the common torch-backend call: torch's own fused op, nothing else per tensor
            fb_unscale.fused_unscale_(ins, outs, direct == "widen", _scale32(inv_scale, device), found_inf)
            _bump([found_inf, *outs])  # torch's fused unscale bumps no version (it writes behind autograd)
            return
    if plan.neg_inputs:  # resolved into temporaries (new addresses every call): no recorded tables for them
        inputs = resolve_inputs(list(inputs))
    scale = _device_scalar(fn, "inv_scale", inv_scale, device)
    flag = found_inf.reshape(1)
    partials = []
    if plan.kernel:
        from .triton.unscale import launch_unscale

        for g in plan.kernel:
            with playing(None if plan.neg_inputs else g.tape):
                p = launch_unscale((g.pick(inputs), g.pick(outputs)), scale, flag, with_norm)
            if p is not None:
                partials.append(p)
    for g in plan.rest:
        ins, outs = g.pick(inputs), g.pick(outputs)
        in_place = g.memo.get("in_place")
        if in_place is None or plan.neg_inputs:
            in_place = fb_unscale.in_place_pairs(ins, outs)
            if not plan.neg_inputs:
                g.memo["in_place"] = in_place
        p = fb_unscale.unscale(ins, outs, scale, flag, with_norm, in_place=in_place)
        if p is not None:
            partials.append(p)
    if sq_norm is not None and partials:
        sq_norm.add_(torch.cat(partials).sum().reshape(sq_norm.shape))  # float64 sum, one rounding into sq_norm
    _bump([found_inf, *outputs] if sq_norm is None else [found_inf, sq_norm, *outputs])


def _check_unscale_args(
    found_inf: torch.Tensor, inv_scale: float | torch.Tensor, sq_norm: torch.Tensor | None, device: torch.device | None
) -> None:
    fn = "unscale_and_check"
    check_flag(fn, found_inf, device)
    if isinstance(inv_scale, torch.Tensor):
        check_scalar_tensor(fn, "inv_scale", inv_scale, device)
    if sq_norm is not None:
        check_flag(fn, sq_norm, device, name="sq_norm", float64_ok=True)


def _scale32(inv_scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``fp32(inv_scale)`` as a one-element tensor (no copy when it already is one)."""
    if isinstance(inv_scale, torch.Tensor):
        return inv_scale if inv_scale.dtype == torch.float32 else inv_scale.to(torch.float32)
    return torch.full((1,), float(inv_scale), dtype=torch.float32, device=device)


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
    tensors = _seq(fn, "tensors", tensors)
    plan = _plan.plan(_L2NORM, (tensors,))
    device = plan.device
    if found_inf is not None:
        check_flag(fn, found_inf, device)
    if device is None:
        zero = torch.zeros((), dtype=torch.float32)
        return (zero, torch.zeros(0, dtype=torch.float32)) if per_tensor else zero
    scale = _device_scalar(fn, "pre_scale", 1.0 if pre_scale is None else pre_scale, device)
    flag = None if found_inf is None else found_inf.reshape(1)

    sumsq = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    if plan.kernel:
        from .triton.l2norm import launch_sumsq, segment_sums

        for g in plan.kernel:
            with playing(g.tape):
                partials, table = launch_sumsq(g.pick(tensors), scale, flag)
            _scatter(sumsq, g, segment_sums(partials, table))
    for g in plan.rest:
        ys = fb_unscale.scaled(g.pick(tensors), scale)
        _scatter(sumsq, g, fb_l2norm.sumsq_per_tensor(ys))
        if flag is not None:
            fb_unscale.flag_nonfinite_(ys, flag)  # ys are our own temporaries
    if found_inf is not None:
        _bump([found_inf])
    total = sumsq.sum().sqrt().float()
    return (total, sumsq.sqrt().float()) if per_tensor else total


def forget_autocast_casts() -> None:
    """Drop torch's autocast weight-cast cache (``torch.clear_autocast_cache``) after a write into weights.

    torch keys that cache by tensor, not by ``_version``: inside an autocast region (torch's, or fp16kit's default
    engine, which uses it), a weight cast before an in-place write (the O2 master -> model copy, an optimizer step)
    would otherwise be reused stale by the next op of the region. Cheap: outside a region the cache is empty. Not
    while compiling (the compiled graph holds no cache)."""
    if not torch.compiler.is_compiling():
        torch.clear_autocast_cache()


def copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for whole lists: one launch per (source, destination) dtype pair.

    Casts round to nearest even, bit-identical to ``Tensor.copy_`` (e.g. fp32 master weights into
    fp16/bf16 model params). ``dst[i]`` and ``src[i]`` must have the same shape. A destination may be the same
    view as its own source; it may not overlap another destination or another source, nor have internal
    overlap or the negative bit (``ValueError``, every backend). Sources with the negative bit are resolved.
    A destination that is a leaf requiring grad (an ``nn.Parameter``) is a ``RuntimeError`` while grad mode is
    on, as for ``Tensor.copy_``, on every backend. Every destination's ``_version`` is bumped, and torch's autocast
    weight-cast cache is dropped (:func:`forget_autocast_casts`).
    """
    dst, src = _seq("copy_", "dst", dst), _seq("copy_", "src", src)
    _check_leaf_outputs("copy_", "dst", dst)
    plan = _plan.plan(_COPY, (dst, src))
    if plan.device is None:
        return
    srcs = resolve_inputs(list(src)) if plan.neg_inputs else src
    if plan.kernel:
        from .triton.copy import launch_copy

        for g in plan.kernel:
            dsts = g.pick(dst)
            with playing(None if plan.neg_inputs else g.tape):
                launch_copy(dsts, g.pick(srcs))
            _bump(dsts)
    for g in plan.rest:
        fb_copy.copy_(g.pick(dst), g.pick(srcs))  # torch's _foreach_copy_ bumps the destinations itself
    forget_autocast_casts()
