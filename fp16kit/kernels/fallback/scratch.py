"""The CPU fast paths' working memory: batches that stay in cache, scratch buffers, fp32 sums of squares.

Both fused CPU paths (``fallback/adam.py``, ``fallback/lamb.py``) run batch by batch (``_BATCH`` elements: a batch's
p, scaled grads and buffer stay in L2 between its passes) and write the model copies of a batch while it is in
cache; Adam with nothing to copy (the caller's grads read as they are, no model copies) makes one call over the
whole list instead. They are never given ``grad_scale``: torch's CPU kernel writes the unscaled grads back into
``grad`` (fp16kit leaves grads untouched), so a loss scale and a clip are applied to a scaled copy first, as one
multiply by ``inv_scale / clip`` (:func:`_grads_for`). Rounding differs from the foreach sequence by a few fp32
roundings (``sqrt(v) / sqrt(bc2)`` for ``sqrt(v / bc2)``, ``m * (1 / bc1)`` for ``m / bc1``, one rounded factor for
the scale and the clip), inside the ulp budgets of ``tests/optim/optim_helpers.py``.

Sums of squares on the CPU (the check pass over the grads, LAMB's trust-ratio norms) use ``torch.dot`` on
large fp32 tensors (BLAS: memory bandwidth on every thread; ``_foreach_norm`` runs at about half that on one
thread) with fp32 accumulation, and every verdict on them (inf/NaN flag, which tensors to redo in float64,
trust ratios) is taken on host numbers: on a loaded machine, a small tensor op that wakes the worker threads
can cost milliseconds. Many small tensors (a model's biases and LayerNorm weights; the host-bound case) are summed
as one gather into a scratch buffer plus one segmented sum, and LAMB's ``p += ratio * buf`` over them as one
multiply by per-element ratios plus one ``_foreach_add_`` (:func:`_sumsq32`, :func:`_add_scaled`): per-tensor ops
there cost ~1.2 us each on the CPU, these ~0.4.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Sequence

import torch

from .step import _DTYPE, _all_of

__all__ = ["segment_sums"]

# Elements per batch of the fused paths: a batch's p, scaled grads and update buffer (256 KiB each in fp32)
# stay in the per-core L2 cache between the kernel, the norms and the final update. Measured on a 2 MiB-L2
# x86 box (1 thread, BERT-base-shaped lists): LAMB 5% faster than with 1M-element batches; beyond L2 every
# pass is bound by the per-core bandwidth to L3/DRAM, so larger batches gain nothing from "cache".
_BATCH = 1 << 16

_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

# fp32 tensors from this size on get their own BLAS dot; smaller ones (and other dtypes) share one
# ``_foreach_norm`` call: per-call host cost, not bandwidth, is what matters for them.
_DOT_MIN = 1 << 14


def _sumsq32(tensors: Sequence[torch.Tensor], tiled: torch.Tensor | None = None) -> list[float]:
    """Per-tensor sums of squares (host numbers) with fp32 accumulation, so over- and underflowing like the
    fp32 norms ``_max_norms``/``_repair_fp32_norms`` are written for: ``torch.dot`` for large contiguous fp32
    tensors (the BLAS dot reads at memory bandwidth on all threads; ``_foreach_norm`` on the CPU runs at about
    half that speed on one thread), and for large contiguous fp16/bf16 tensors on their exact fp32 conversion
    in a cached scratch buffer, ``_BATCH`` elements at a time (``_foreach_norm(dtype=float32)`` allocates a
    converted copy of every tensor, page faults included); the squared ``_foreach_norm`` (fp32 result, squared
    in float64) for the rest. A tensor converted in pieces sums the pieces' fp32 sums in float64. float64
    tensors (LAMB's trust ratio on float64 params) get float64 norms.

    A list of only small fp32/fp16/bf16 tensors (each below ``_DOT_MIN`` elements: host cost per tensor is all there is)
    is gathered into one scratch buffer (one ``_foreach_copy_``; none when the caller passes ``tiled``, the
    contiguous buffer the tensors already tile in order) and summed per tensor by :func:`segment_sums` over the
    fp32 squares: ~0.4 us per tensor against ~1.2 us for ``_foreach_norm`` on the CPU."""
    f32 = torch.float32
    if not tensors:
        return []
    numels = tuple(map(_NUMEL, tensors))
    if max(numels) < _DOT_MIN and _LOW_OR_F32.issuperset(map(_DTYPE, tensors)):  # many small ones
        if tiled is None:
            tiled, views = _scratch_views("norm", tensors, f32)  # fp16/bf16: exact widening
            torch._foreach_copy_(views, list(tensors))
        return segment_sums(torch.mul(tiled, tiled), numels).tolist()
    if all(t.dtype is f32 and t.numel() >= _DOT_MIN and t.is_contiguous() for t in tensors):  # large ones
        return torch.stack([torch.dot(f, f) for f in (t.view(-1) for t in tensors)]).tolist()
    big, small, low = [], [], []
    for i, t in enumerate(tensors):
        if t.numel() < _DOT_MIN or not t.is_contiguous() or t.dtype is torch.float64:
            small.append(i)
        elif t.dtype is f32:
            big.append(i)
        else:
            (low if t.dtype in (torch.float16, torch.bfloat16) else small).append(i)
    out = [0.0] * len(tensors)
    if big:
        for i, x in zip(big, torch.stack([torch.dot(f, f) for f in (tensors[i].view(-1) for i in big)]).tolist()):
            out[i] = x
    if small:
        chosen = [tensors[i] for i in small]
        wide = any(t.dtype is torch.float64 for t in chosen)
        norms = torch._foreach_norm(chosen, 2, dtype=torch.float64 if wide else f32)
        for i, x in zip(small, torch.stack(norms).tolist()):
            out[i] = x * x
    for i in low:
        flat = tensors[i].view(-1)
        pieces = []
        for start in range(0, flat.numel(), _BATCH):
            buf = _scratch_views("check", [flat[start : start + _BATCH]], f32)[0]
            buf.copy_(flat[start : start + _BATCH])  # exact widening conversion
            pieces.append(torch.dot(buf, buf))
        out[i] = math.fsum(torch.stack(pieces).tolist())
    return out

_NUMEL = torch.Tensor.numel

_LOW_OR_F32 = frozenset((torch.float32, torch.float16, torch.bfloat16))

# Below this many tensors a per-tensor op costs less than building per-element factors.
_FEW = 8

# lengths tuple -> its int64 tensor (a training loop's lists repeat every step)
_lengths: dict[tuple[int, ...], torch.Tensor] = {}


def segment_sums(values: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """Per-segment sums of the 1-D ``values`` split into consecutive runs of ``lengths`` (an empty run sums to
    0), in the dtype of ``values``: one ``torch.segment_reduce`` (on the CPU it accumulates in that dtype, in
    order: fp32 sums over- and underflow as ``_foreach_norm``'s do)."""
    return torch.segment_reduce(values, "sum", lengths=_lengths_of(lengths).to(values.device), unsafe=True)


def _lengths_of(lengths: tuple[int, ...]) -> torch.Tensor:
    """``lengths`` as a CPU int64 tensor (cached)."""
    lens = _lengths.get(lengths)
    if lens is None:
        if len(_lengths) >= 256:
            _lengths.clear()
        lens = _lengths[lengths] = torch.tensor(lengths, dtype=torch.int64)
    return lens


def _batches(p: Sequence[torch.Tensor]) -> Iterator[Sequence[int]]:
    """Consecutive index runs of at most ``_BATCH`` elements (a larger tensor alone)."""
    if sum(map(_NUMEL, p)) <= _BATCH:  # one run (C-level sum: many small tensors are the host-bound case)
        yield range(len(p))
        return
    run: list[int] = []
    size = 0
    for i, t in enumerate(p):
        if run and size + t.numel() > _BATCH:
            yield run
            run, size = [], 0
        run.append(i)
        size += t.numel()
    if run:
        yield run

_SHAPE = operator.attrgetter("shape")

# (name, device, dtype, shapes) -> (the scratch tensor the views are of, its flat prefix, the views)
_views: dict[tuple, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}


def _scratch_views(
    name: str, rows: Sequence[torch.Tensor], dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(flat, views)``: buffers shaped like ``rows`` (uninitialized), consecutive views of one module-level
    scratch tensor per (name, device, dtype) that grows to the largest batch seen (no allocation, and no page
    faults, per step), and ``flat``, the 1-D slice they tile (one op over a batch instead of one per tensor).
    The views are cached by the batch's shapes: a training loop's batches repeat every step. ``dtype``: of the
    buffers (default: that of ``rows``)."""
    key = (name, rows[0].device, dtype or rows[0].dtype, tuple(map(_SHAPE, rows)))
    buf = _scratch.get(key[:3])
    hit = _views.get(key)
    if hit is not None and hit[0] is buf:
        return hit[1], hit[2]
    need = sum(t.numel() for t in rows)
    if buf is None or buf.numel() < need:
        buf = _scratch[key[:3]] = torch.empty(max(need, _BATCH), dtype=key[2], device=rows[0].device)
    flat = buf[:need]
    views, offset = [], 0
    for t in rows:
        views.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    if len(_views) >= 256:
        _views.clear()
    _views[key] = (buf, flat, views)
    return flat, views


def _reads_grads_as_they_are(p: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> bool:
    """Can torch's fused kernel read these grads in place (the params' dtype, contiguous)? (The params are of one
    dtype: ``_fused_takes`` checked them.)"""
    return len(grads) == len(p) and _all_of(p[0].dtype, grads) if p else True


def _grads_for(pb: list[torch.Tensor], grads: list[torch.Tensor], inv_scale: float, clip: float) -> list[torch.Tensor]:
    """The kernel's grads for one batch: the caller's own where nothing is to be done (the kernel only reads
    them), else ``g * (inv_scale / clip)`` in the math dtype, in a scratch buffer (in cache): one rounding of
    the float64 factor to the math dtype and one of the product, the same count as the foreach path's
    ``(g * inv_scale) / clip`` (exact for a power-of-two scale, then a rounded divisor and the quotient)."""
    same = _reads_grads_as_they_are(pb, grads)
    if inv_scale == 1.0 and clip == 1.0 and same:
        return grads
    flat, out = _scratch_views("grad", pb)
    _scaled_into(flat, out, grads, inv_scale / clip)
    return out


def _scaled_into(flat: torch.Tensor, out: list[torch.Tensor], srcs: Sequence[torch.Tensor], factor: float) -> None:
    """``out[i] = srcs[i] * factor`` rounded to the scratch dtype (``out`` are views tiling ``flat``), the same bits
    either way: a lone tensor of that dtype in one op (each op over a large tensor is a parallel region; on a
    loaded machine waking the worker threads costs more than the pass itself), else one ``_foreach_copy_`` (exact:
    a widening conversion, or a gather of a non-contiguous layout) and one multiply over ``flat`` (a batch of many
    small tensors: two calls instead of one per tensor)."""
    if len(out) == 1 and factor != 1.0 and srcs[0].dtype == out[0].dtype:
        torch.mul(srcs[0], factor, out=out[0])
        return
    torch._foreach_copy_(out, list(srcs))
    if factor != 1.0:
        flat.mul_(factor)


def _write_models(models: Sequence[torch.Tensor | None], rows: list[int], pb: list[torch.Tensor]) -> None:
    """Model copies of one batch's updated params, while the params are still in cache (one call)."""
    pairs = [(models[i], q) for i, q in zip(rows, pb) if models[i] is not None]
    if pairs:
        torch._foreach_copy_([m for m, _ in pairs], [q for _, q in pairs])


def _add_scaled(p: list[torch.Tensor], buf: list[torch.Tensor], flat: torch.Tensor, alphas: list[float]) -> None:
    """``p[i] += alphas[i] * buf[i]`` (``buf`` tiles ``flat``). Many small tensors (host cost per tensor is all
    there is): ``buf`` scaled in place by the per-element factors (one multiply over ``flat``), then one
    ``_foreach_add_``: ~0.6 us per tensor against ~1.3 us for a per-tensor ``add_``; the product is rounded to
    fp32 before the add (no fused multiply-add), one rounding more, inside the ulp budgets of
    ``tests/optim/optim_helpers.py``. Large tensors: one ``add_`` each (no pass more)."""
    if len(p) < _FEW or max(map(_NUMEL, p)) >= _DOT_MIN:
        for q, b, a in zip(p, buf, alphas):
            q.add_(b, alpha=a)
        return
    numels = tuple(map(_NUMEL, p))
    factors = torch.tensor(alphas, dtype=flat.dtype)
    flat.mul_(torch.repeat_interleave(factors, _lengths_of(numels), output_size=flat.numel()))
    torch._foreach_add_(p, buf)
