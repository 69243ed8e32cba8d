"""The overflow flag ``found_inf``: one owner for its shape, dtype, creation, merging and hand-over.

The flag says "an inf or NaN was seen" (``0`` = all finite; kernels only ever *raise* it to ``1``, never clear
it). It lives on the device, so nothing here reads it on the host. Two forms of the same value exist:

* **fp16kit's form**: float32 of shape ``[1]``, what :func:`fp16kit.kernels.unscale_and_check`, the fused
  optimizers and :class:`fp16kit.amp.LossScaler` read and write (a one-element tensor is one pointer for a kernel).
* **torch's form**: a 0-dim float32 tensor, what ``torch.amp.GradScaler`` hands to optimizers that set
  ``_step_supports_amp_scaling`` (torch's fused Adam/AdamW/SGD read ``optimizer.found_inf`` in that shape).

:func:`as_fp16kit_flag` and :func:`as_torch_flag` convert between them as *views* (no copy, no sync): raising
one raises the other. Which form an optimizer takes is declared, not guessed: a class attribute
``_fp16kit_checks_inf = True`` (:data:`CHECKS_INF_ATTR`; fp16kit's ``FusedLAMB``/``FusedAdam`` set it) says "I
check for inf/NaN in my own first pass and take fp16kit's ``[1]`` flag"; every other optimizer gets torch's
0-dim form (:func:`flag_for`). Merging several flags (several devices, several losses) is a ``max``, not a sum:
fused kernels test ``found_inf == 1`` and a NaN stays a NaN (still non-zero: an overflow).

**Final flags.** A caller that hands over a flag it has already computed over exactly the grads the step will
read (``optimizer.grad_scale`` their scale) may declare it *final* for that one step call:
``optimizer.found_inf_final = True`` (:data:`FINAL_ATTR`, read by :func:`flag_is_final`). An optimizer that
needs no gradient norm (FusedAdam; FusedLAMB with ``max_grad_norm=0``) then skips its own check pass. The
declaration is the caller's proof, so it is made only where it holds: amp O2's fused-masters path makes it when
every grad the optimizer will read is the tensor its ``scale_loss`` exit checked, unmodified since (same tensor,
same version counter). fp16kit's GradScaler hands a zeroed flag and never declares it final; torch's GradScaler
never does either (its check reads the *scaled* grads: with a scale below 1 an unscaled value may still
overflow), so the optimizer checks in both cases.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import torch

from .engine.checks import check_flag

__all__ = [
    "CHECKS_INF_ATTR",
    "FINAL_ATTR",
    "FLAG_DTYPE",
    "as_fp16kit_flag",
    "as_torch_flag",
    "check_found_inf",
    "checks_inf_itself",
    "flag_for",
    "flag_is_final",
    "flag_nonfinite",
    "merge_found_inf",
    "merge_found_inf_into",
    "new_found_inf",
]

#: the flag's dtype, in both forms
FLAG_DTYPE = torch.float32
#: class attribute of an optimizer that checks for inf/NaN itself and takes fp16kit's ``[1]`` flag
CHECKS_INF_ATTR = "_fp16kit_checks_inf"
#: attribute set on an optimizer, for one step call, by a caller whose handed-over ``found_inf`` is final
FINAL_ATTR = "found_inf_final"


def new_found_inf(device: torch.device | str) -> torch.Tensor:
    """A zeroed flag in fp16kit's form (float32 ``[1]``) on ``device`` (whatever torch's default dtype is)."""
    return torch.zeros(1, dtype=FLAG_DTYPE, device=device)


def check_found_inf(fn: str, flag: Any, device: torch.device | None) -> None:
    """Raise unless ``flag`` is a one-element float32 tensor (either form) on ``device`` (None: any device)."""
    check_flag(fn, flag, device)


def as_fp16kit_flag(flag: torch.Tensor) -> torch.Tensor:
    """``flag`` (either form) as fp16kit's ``[1]``: a view of the same storage, so raising it raises ``flag``."""
    return flag.view(1)


def as_torch_flag(flag: torch.Tensor) -> torch.Tensor:
    """``flag`` (either form) as torch's 0-dim flag: a view of the same storage."""
    return flag.view(())


def checks_inf_itself(optimizer: Any) -> bool:
    """Does ``optimizer``'s class declare ``_fp16kit_checks_inf = True`` (check in its own pass, ``[1]`` flag)?"""
    return getattr(type(optimizer), CHECKS_INF_ATTR, False) is True


def flag_is_final(optimizer: Any) -> bool:
    """Has the caller declared ``optimizer.found_inf`` final (module docstring: already raised for every inf/NaN
    in ``grad * (1 / grad_scale)`` of every grad this step reads)? Only ``optimizer.found_inf_final is True``
    counts; anything else means "check"."""
    return getattr(optimizer, FINAL_ATTR, False) is True


#: from this many elements a tensor's largest magnitude comes from its own ``aminmax`` (no temporary copy)
_AMINMAX_MIN = 1 << 16
#: tensors below this many elements are checked together, as one concatenated copy (per-tensor calls cost ~1 us
#: each on the CPU: ``_foreach_abs`` + ``_foreach_max`` over 400 four-element tensors take ~0.5 ms, their
#: concatenation ~0.1 ms); the ones in between share one ``_foreach_abs``/``_foreach_max`` call
_TINY = 1 << 12
#: at most this many elements are concatenated at once (bounds the temporary copy)
_CAT_MAX = 1 << 22


def _largest_magnitudes(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """0-dim float32 tensors whose max is the largest ``|g|`` over ``grads`` (NaN if any element is NaN); empty
    tensors add nothing (no tensor at all for an empty total)."""
    sizes = list(map(torch.Tensor.numel, grads))
    total = sum(sizes)
    if not total:
        return []
    if max(sizes) < _TINY and total <= _CAT_MAX:  # the many-small-tensors case: no per-tensor Python
        return [torch.cat(list(map(torch.flatten, grads))).abs().max().float()]
    tiny, mid, ends = [], [], []
    for g, n in zip(grads, sizes):
        if n >= _AMINMAX_MIN:
            lo, hi = torch.aminmax(g)  # one read, no temporary
            ends += (hi.float(), lo.float().neg())
        elif n >= _TINY:
            mid.append(g)
        elif n:
            tiny.append(g)
    if tiny and sum(map(torch.Tensor.numel, tiny)) <= _CAT_MAX:
        ends.append(torch.cat(list(map(torch.flatten, tiny))).abs().max().float())
    else:
        mid += tiny
    if mid:
        ends += [n.float() for n in torch._foreach_max(torch._foreach_abs(mid))]
    return ends


def flag_nonfinite(grads: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``found_inf = 1`` if any ``fp32(g) * inv_scale`` is inf/NaN (``inv_scale``: one-element float32); reads each
    grad once, writes nothing else, never lowers the flag, never syncs a device with the host. The read-only check
    whose flag a caller may hand over as final (module docstring), and the check of a step that needs no norm.

    Triton backends: ``l2norm``'s check (its norm is not used). Torch backend: the largest magnitude (NaN-
    propagating) times ``inv_scale``, which overflows exactly when some element's product does (rounding is
    monotonic): the flag ``unscale_and_check`` would raise (:func:`_flag_from_largest`). CPU grads with
    ``|inv_scale| <= 1`` first take the cheaper proof of :func:`_cpu_unproven` (a finite sum), and only the
    tensors it cannot clear go through the largest magnitude. Grads on several devices: per device.
    """
    from .backend import Backend, select_backend
    from .ops import l2norm

    if not grads:
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    if len(set(map(attrgetter("device"), grads))) == 1:
        by_device[grads[0].device] = list(grads)
    else:
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
    for dev, same in by_device.items():
        flag = as_fp16kit_flag(found_inf) if dev == found_inf.device else new_found_inf(dev)
        inv = inv_scale.to(dev)
        if select_backend(dev).backend is not Backend.TORCH:
            l2norm(same, pre_scale=inv, found_inf=flag)
        elif dev.type == "cpu" and not torch.compiler.is_compiling() and abs(float(inv.reshape(()))) <= 1.0:
            # host reads of CPU tensors (no sync); not in a compiled step, where torch 2.11 breaks the graph on them
            _flag_from_largest(_cpu_unproven(same), inv, flag)
        else:
            _flag_from_largest(same, inv, flag)
        if dev != found_inf.device:
            merge_found_inf_into(found_inf, flag)


def _flag_from_largest(grads: list[torch.Tensor], inv: torch.Tensor, flag: torch.Tensor) -> None:
    """``flag = 1`` if ``max |g| * inv`` (fp32, NaN-propagating) is inf/NaN: device ops only (no host read).

    The largest magnitude is ``max(hi, -lo)`` of one ``aminmax`` read for large tensors (no temporary: 0.16 ms per
    1M fp16 values on 1 CPU thread), ``max(abs(g))`` over one ``_foreach`` call for mid-sized ones (``abs`` makes
    a temporary copy, 0.28 ms per 1M fp16 values), and over one concatenation of the tiny ones (exact: promotion
    to a wider float is exact). All ~10x faster on the CPU than ``_foreach_norm(inf)`` (2.8 ms per 1M fp16 values).
    """
    ends = _largest_magnitudes(grads)
    if ends:
        largest = torch.stack(ends).max()
        torch.maximum(flag, (~torch.isfinite(largest * inv)).float().reshape(1), out=flag)


#: CPU grads from this many elements are reduced alone (or in pairs: one reduction each; torch runs it on every
#: thread from its grain size, 32K elements, on); smaller ones are summed as one concatenated copy (per-call host
#: cost, not bandwidth, is what matters for them: ~100 LayerNorm/bias vectors per BERT model)
_SUM_ALONE = 1 << 14
#: the dtypes whose fp32 sum :func:`_cpu_unproven` may read (their conversion to fp32 is exact)
_SUMMED = (torch.float16, torch.bfloat16, torch.float32)
_SUMMED_SET = frozenset(_SUMMED)
_dtype = attrgetter("dtype")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def _cpu_unproven(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU grads, for a caller whose ``|inv_scale| <= 1``: the grads whose finiteness a reduction could not prove
    (every other grad holds only finite values, so ``fp32(g) * inv_scale`` is finite for each of its elements).

    Why it holds: a finite fp32 sum (``sum(dtype=float32)``: fp32 accumulation, fp16/bf16 widened exactly) proves
    every element finite, because one inf or NaN element makes every partial sum that contains it inf or NaN,
    whatever the order of the additions. So does a finite ``dot(a, b)`` for both ``a`` and ``b``: an inf or NaN
    factor makes its product inf or NaN (``inf * 0`` is NaN), and the sum then follows. The converse fails only
    where finite values overflow a product or the sum (or cancel an overflow to NaN): those tensors are handed back,
    with every tensor holding an inf/NaN, for the exact largest-magnitude check. ``|inv| <= 1`` makes
    ``|g * inv| <= |g|`` (the rounding of the exact product is monotonic), so a finite ``g`` gives a finite product.

    One read of each grad: large contiguous fp32 grads of equal sizes in pairs, ``dot(a, b)`` (BLAS: two streams
    read at once; with the grads out of cache, as in a training step, 20% faster than a sum per tensor on 1
    thread), a lone one as ``dot(g, g)``; other large grads ``sum``; one sum over the concatenated small ones.
    Verdicts on host numbers (a CPU tensor has no queue to drain). Other dtypes (float64: ``fp32(g)`` may
    overflow) are handed back unread.
    """
    sizes = list(map(torch.Tensor.numel, grads))
    if sizes and max(sizes) < _SUM_ALONE and sum(sizes) <= _CAT_MAX and _SUMMED_SET.issuperset(map(_dtype, grads)):
        # only small grads of summed dtypes (the many-small-tensors case): the one pooled sum, no per-grad Python
        total = torch.cat(list(map(torch.flatten, grads))).sum(dtype=torch.float32)
        return [] if math.isfinite(total.item()) else [g for g, n in zip(grads, sizes) if n]
    by_size: dict[int, list[torch.Tensor]] = {}
    alone: list[torch.Tensor] = []
    pooled: list[torch.Tensor] = []
    unproven: list[torch.Tensor] = []
    for g in grads:
        if g.dtype not in _SUMMED:
            unproven.append(g)
        elif g.numel() < _SUM_ALONE:
            if g.numel():
                pooled.append(g)
        elif g.dtype is torch.float32 and g.is_contiguous():
            by_size.setdefault(g.numel(), []).append(g.view(-1))
        else:
            alone.append(g)
    groups: list[list[torch.Tensor]] = []
    reductions = []
    for same in by_size.values():
        for i in range(0, len(same), 2):
            pair = same[i : i + 2]
            groups.append(pair)
            reductions.append(torch.dot(pair[0], pair[-1]))
    if pooled and sum(map(torch.Tensor.numel, pooled)) <= _CAT_MAX:
        groups.append(pooled)  # 1-D tensors join the concatenation as they are (a reshape costs ~1 us)
        reductions.append(torch.cat([_flat(t) for t in pooled]).sum(dtype=torch.float32))
    else:
        alone += pooled
    for g in alone:
        groups.append([g])
        reductions.append(g.sum(dtype=torch.float32))
    if reductions:
        for group, total in zip(groups, torch.stack(reductions).tolist()):
            if not math.isfinite(total):
                unproven += group
    return unproven


def flag_for(optimizer: Any, flag: torch.Tensor) -> torch.Tensor:
    """``flag`` in the form ``optimizer`` takes as ``optimizer.found_inf``: fp16kit's ``[1]`` for an optimizer that
    declares :data:`CHECKS_INF_ATTR`, torch's 0-dim for every other (torch's documented hand-over). A view."""
    return as_fp16kit_flag(flag) if checks_inf_itself(optimizer) else as_torch_flag(flag)


def merge_found_inf(flags: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flag on ``device`` from several: ``max`` of them (copies from other devices are non-blocking).

    No flags (no gradients at all) gives a fresh zeroed flag: nothing overflowed. One flag on ``device`` is returned
    as fp16kit's view of itself (no op, the common case), so raising the result raises it; two or more give a new
    ``[1]`` tensor.
    """
    moved = [f if f.device == device else f.to(device, non_blocking=True) for f in flags]
    if not moved:
        return new_found_inf(device)
    out = as_fp16kit_flag(moved[0])
    for f in moved[1:]:
        out = torch.maximum(out, as_fp16kit_flag(f))
    return out


def merge_found_inf_into(dst: torch.Tensor, flag: torch.Tensor) -> None:
    """``dst = max(dst, flag)`` in place (``flag`` copied to ``dst``'s device without blocking)."""
    src = flag if flag.device == dst.device else flag.to(dst.device, non_blocking=True)
    torch.maximum(dst, src.view(dst.shape), out=dst)
