"""Torch fallbacks of the LAMB and Adam kernels (``torch._foreach_*``), same contracts and same math.

Used where Triton cannot run (CPU tensors without the interpreter, platforms without Triton) and for
tensors the kernels do not take (non-contiguous, float64). ``hp`` is the hyper-parameter tensor
described in ``lamb_kernel.py`` / ``adam_kernel.py``; its dtype is the math dtype (float32, or float64
for float64 params).

The ``found_inf`` skip never syncs a GPU with the host. On CPU tensors the flag is read directly (a CPU
tensor has no queue to drain): a set flag returns at once, a clear one runs the fast host path (in place,
hyper-parameters as host numbers; Adam is ``torch.optim.Adam``'s own foreach sequence). Elsewhere every new
value is computed out of place and committed with ``torch.where(found_inf != 0, old, new)``, which keeps
old values bit for bit even when the new ones are NaN. ``host_branch`` overrides the choice, per call or
for a block (:func:`masked_commits`): tests exercise the masked path on CPU.

Fast CPU path (no compiler needed): when the caller hands over the step counter (``fused``), CPU rows of
contiguous fp32/fp64 tensors run Adam's elementwise math in torch's fused CPU Adam kernel
(``torch._fused_adam_``/``torch._fused_adamw_``: one vectorized, multi-threaded pass reading g, p, m, v and
writing p, m, v), instead of ~8 foreach passes. LAMB's stage 1 *is* that Adam update direction when grad
averaging is on and there is no L2 term: the kernel runs with lr = 1 on a scratch buffer holding ``-wd p``
(or 0) in place of the param, which leaves ``-u = -wd p - (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`` there;
the per-tensor norms and ``p += ratio * buf`` follow. Both run batch by batch (``_BATCH`` elements: a batch's
p, scaled grads and buffer stay in L2 between its passes) and write the model copies of a batch while it is
in cache; Adam with nothing to copy (the caller's grads read as they are, no model copies) makes one call over
the whole list instead. The kernel computes its bias corrections from the step counter in float64 (``1 - beta**t``)
exactly as ``functional.py`` does; the path is taken only where they agree with ``hp64`` (else bias
correction is off) and ``beta3 == 1 - beta1``. It is never given ``grad_scale``: torch's CPU kernel writes
the unscaled grads back into ``grad`` (fp16kit leaves grads untouched), so a loss scale and a clip are
applied to a scaled copy first, as one multiply by ``inv_scale / clip``. Rounding differs from the foreach
sequence by a few fp32 roundings (``sqrt(v) / sqrt(bc2)`` for ``sqrt(v / bc2)``, ``m * (1 / bc1)`` for
``m / bc1``, one rounded factor for the scale and the clip), inside the ulp budgets of
``tests/optim/optim_helpers.py``.

Sums of squares on the CPU (the check pass over the grads, LAMB's trust-ratio norms) use ``torch.dot`` on
large fp32 tensors (BLAS: memory bandwidth on every thread; ``_foreach_norm`` runs at about half that on one
thread) with fp32 accumulation, and every verdict on them (inf/NaN flag, which tensors to redo in float64,
trust ratios) is taken on host numbers: on a loaded machine, a small tensor op that wakes the worker threads
can cost milliseconds. Many small tensors (a model's biases and LayerNorm weights; the host-bound case) are summed
as one gather into a scratch buffer plus one segmented sum, and LAMB's ``p += ratio * buf`` over them as one
multiply by per-element ratios plus one ``_foreach_add_`` (``_sumsq32``, ``_add_scaled``): per-tensor ops there cost
~1.2 us each on the CPU, these ~0.4.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import NamedTuple

import torch

from ._table import group_by

__all__ = ["FusedAdamArgs", "adam_", "check_and_norm", "foreach_only", "lamb_", "masked_commits"]

F64 = torch.float64


class FusedAdamArgs(NamedTuple):
    """What torch's fused CPU Adam kernel needs beyond the ``hp`` tensor: the (already advanced) step counter
    it derives the bias corrections from, the float64 hyper-parameters (``hp`` may be rounded to fp32), and
    ``memo``: the caller's plan group's memo (``_plan.Group``; a plan hit means the same addresses and metadata),
    where the layout verdicts of :func:`_fused_takes` and :func:`_adam_fused` are kept instead of being recomputed
    over every tensor every step (~0.5 us per tensor)."""

    step: torch.Tensor
    hp64: torch.Tensor
    memo: dict | None = None


# Elements per batch of the fused paths: a batch's p, scaled grads and update buffer (256 KiB each in fp32)
# stay in the per-core L2 cache between the kernel, the norms and the final update. Measured on a 2 MiB-L2
# x86 box (1 thread, BERT-base-shaped lists): LAMB 5% faster than with 1M-element batches; beyond L2 every
# pass is bound by the per-core bandwidth to L3/DRAM, so larger batches gain nothing from "cache".
_BATCH = 1 << 16
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

_forced_host_branch: list[bool] = []


@contextlib.contextmanager
def masked_commits() -> Iterator[None]:
    """Within the block, every call takes the masked (off-CPU) path, on CPU tensors too (for tests)."""
    _forced_host_branch.append(False)
    try:
        yield
    finally:
        _forced_host_branch.pop()


_foreach_only: list[bool] = []


@contextlib.contextmanager
def foreach_only() -> Iterator[None]:
    """Within the block, the CPU host path never uses torch's fused Adam kernel (the foreach sequence only):
    for benchmarks (the path before the fast one) and tests that compare the two."""
    _foreach_only.append(True)
    try:
        yield
    finally:
        _foreach_only.pop()


def check_and_norm(grads: Sequence[torch.Tensor], inv_scale64: torch.Tensor, found_inf: torch.Tensor) -> torch.Tensor:
    """Torch fallback of the optimizers' check-and-norm pass (``fp16kit.optim.functional.check_and_norm``):
    ``inv_scale * sqrt(sum g^2)`` (0-dim fp32) and the flag ``any(|g| * inv_scale)`` non-finite, fp32 math
    (fp64 for fp64). Reading CPU tensors on the host here syncs nothing (the CPU has no queue).

    ``|g|max * inv_scale`` overflows exactly when some ``g * inv_scale`` does (rounding is monotonic), so the
    flag equals the kernel's; the norm differs from the norm of scaled values by at most one rounding.
    Empty grads are left out (``_foreach_norm`` has no inf-norm of an empty tensor; they add nothing).
    CPU grads of fp32 math take :func:`_cpu_check_and_norm` (one read of the grads, verdicts on the host).
    """
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=found_inf.device)
    sumsq, amax = [], []
    for rows in group_by([F64 if g.dtype == F64 else torch.float32 for g in grads]).values():
        chosen = [grads[i] for i in rows]
        if chosen[0].dtype != F64 and chosen[0].device.type == "cpu":
            sq, worst = _cpu_check_and_norm(chosen, float(inv_scale64.reshape(())))
            sumsq.append(torch.tensor(sq, dtype=F64))
            amax.append(torch.tensor(worst, dtype=F64))
            continue
        norms = torch.stack(torch._foreach_norm(chosen, 2, dtype=F64))
        largest = torch.stack(torch._foreach_norm(chosen, float("inf"))).to(F64)
        sumsq.append(norms.square().sum())
        amax.append(largest.max())
    inv = inv_scale64.reshape(())
    largest = torch.stack(amax).max().float() * inv.float()
    flag = found_inf.reshape(1)
    torch.maximum(flag, (~torch.isfinite(largest)).float().reshape(1), out=flag)
    return (torch.stack(sumsq).sum().sqrt() * inv).float()


# Below this magnitude the squares of an fp32 tensor's elements are subnormal or flush to zero, so its fp32
# sum of squares loses bits or vanishes; above fp32's range (a norm > ~1.8e19) the sum of squares is inf.
_TINY_FOR_FP32_SQUARES = 2.0**-60


def _cpu_check_and_norm(chosen: Sequence[torch.Tensor], inv: float) -> tuple[float, float]:
    """CPU grads, fp32 math: ``(sum of the per-tensor squared norms, a stand-in of max |g|)`` (float64 host
    numbers), from one read of the grads: the per-tensor fp32 2-norms (``torch._foreach_norm``, one call).

    The max-norm of a tensor is read (a second pass over that tensor only, see :func:`_max_norms`) where it
    may matter, and its norm recomputed with float64 accumulation where the fp32 sum of squares over- or
    underflowed (:func:`_repair_fp32_norms`). Every verdict is a host decision on a few host numbers (no
    small tensor ops: on a loaded machine each one that wakes the worker threads can stall for milliseconds).
    The returned max stand-in is ``max |g|`` itself where it was read, else a 2-norm with ``norm * inv <=
    2**127``: its fp32 product with ``inv`` overflows (or is NaN) exactly when some ``|g| * inv`` does.
    """
    norms = list(map(math.sqrt, _sumsq32(chosen)))
    largest = _max_norms(chosen, norms, inv)
    norms = _repair_fp32_norms(chosen, norms, largest)
    total = sum(largest)  # NaN exactly when some max stand-in is NaN (they are >= 0: no inf - inf)
    return math.fsum(map(operator.mul, norms, norms)), max(largest) if total == total else math.nan


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


def _nan_first(x: float) -> float:
    """Sort key that ranks NaN above everything (``max`` over host numbers then propagates NaN as torch does)."""
    return math.inf if math.isnan(x) else x


def _max_norms(chosen: Sequence[torch.Tensor], norms: list[float], inv: float) -> list[float]:
    """CPU, fp32 math: per-tensor max-norms where the caller needs them, the 2-norms as stand-ins elsewhere,
    so the grads are read once instead of twice. The max-norm is read (a second pass over that tensor only)
    where the 2-norm is not finite, where ``norm * inv_scale > 2**127`` (the scaled max might overflow), or
    where ``norm <= 2 sqrt(n) * _TINY_FOR_FP32_SQUARES`` (the max might be below the tiny threshold). For the
    other tensors ``max <= norm`` (up to rounding, which the 2**127 margin absorbs) and ``max >= tiny``, so
    ``_repair_fp32_norms`` and the inf/NaN flag decide exactly as with the true max-norms. (First a test over
    the whole list, C-level: no tensor is to be read when the sum is finite, the largest norm is below the
    overflow bound and the smallest above the tiny bound of the largest tensor.)"""
    tiny = 2.0 * math.sqrt(max(map(_NUMEL, chosen), default=0)) * _TINY_FOR_FP32_SQUARES
    if norms and math.isfinite(sum(norms)) and max(norms) * inv <= 2.0**127 and min(norms) > tiny:
        return norms
    redo = [
        i
        for i, (n, t) in enumerate(zip(norms, chosen))
        if not math.isfinite(n) or n * inv > 2.0**127 or n <= 2.0 * math.sqrt(t.numel()) * _TINY_FOR_FP32_SQUARES
    ]
    if not redo:
        return norms
    largest = list(norms)
    exact = torch.stack(torch._foreach_norm([chosen[i] for i in redo], float("inf"))).tolist()
    for i, value in zip(redo, exact):
        largest[i] = value
    return largest


def _repair_fp32_norms(chosen: Sequence[torch.Tensor], norms: list[float], largest: list[float]) -> list[float]:
    """CPU only: the fp32 per-tensor norms, with the tensors whose fp32 sum of squares over- or underflowed (a
    finite, nonzero max-norm but an inf norm, or a max-norm below ``_TINY_FOR_FP32_SQUARES``) recomputed with
    float64 accumulation. On other devices the norms are float64 from the start (a memory-bound reduction
    there), so this never syncs a device."""
    if math.isfinite(sum(norms)) and min(largest, default=math.inf) >= _TINY_FOR_FP32_SQUARES:
        return norms  # (a C-level test first: nothing to redo)
    redo = [
        i
        for i, (n, big) in enumerate(zip(norms, largest))
        if math.isfinite(big) and big > 0 and (not math.isfinite(n) or big < _TINY_FOR_FP32_SQUARES)
    ]
    if not redo:
        return norms
    norms = list(norms)
    exact = torch.stack(torch._foreach_norm([chosen[i] for i in redo], 2, dtype=F64)).tolist()
    for i, value in zip(redo, exact):
        norms[i] = value
    return norms


def _skip(found_inf: torch.Tensor, host_branch: bool | None) -> bool | torch.Tensor:
    """``True``/``False`` decided on the host, or a 0-dim bool tensor for masked commits."""
    if host_branch is None and _forced_host_branch:
        host_branch = _forced_host_branch[-1]
    if host_branch is None:
        host_branch = found_inf.device.type == "cpu"
    flag = found_inf.reshape(()) != 0
    return bool(flag) if host_branch else flag


def _commit(dsts: Sequence[torch.Tensor], news: Sequence[torch.Tensor], skip: bool | torch.Tensor) -> None:
    """``dst.copy_(new)`` (rounding to dst's dtype), or keep ``dst`` where ``skip`` is a set device flag."""
    for dst, new in zip(dsts, news):
        if isinstance(skip, torch.Tensor):
            new = torch.where(skip, dst.to(new.dtype), new)
        dst.copy_(new)


def _write_params(
    params: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    new_params: Sequence[torch.Tensor],
    skip: bool | torch.Tensor,
) -> None:
    """Params (unless ``new_params[i]`` already is ``params[i]``, updated in place) and model copies."""
    moved = [(d, n) for d, n in zip(params, new_params) if d is not n]
    _commit([d for d, _ in moved], [n for _, n in moved], skip)
    pairs = [(m, p) for m, p in zip(models, new_params) if m is not None]
    _commit([m for m, _ in pairs], [p for _, p in pairs], skip)


def _second_moment(
    exp_avg_sqs: Sequence[torch.Tensor],
    g: list[torch.Tensor],
    beta2: torch.Tensor | float,
    one_minus_beta2: torch.Tensor | float,
    *,
    in_place: bool = False,
) -> list[torch.Tensor]:
    """``v * beta2 + (1 - beta2) * g * g``, out of place (or in place on ``exp_avg_sqs``)."""
    if in_place:
        v = list(exp_avg_sqs)
        torch._foreach_mul_(v, beta2)
    else:
        v = torch._foreach_mul(list(exp_avg_sqs), beta2)
    gg = torch._foreach_mul(g, one_minus_beta2)
    torch._foreach_mul_(gg, g)
    torch._foreach_add_(v, gg)
    return v


def _math(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors in ``dtype``: themselves where they have it (``t.to`` would return ``t`` too, at ~1 us a call)."""
    return [t if t.dtype is dtype else t.to(dtype) for t in tensors]


def lamb_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    trust: bool,
    host_branch: bool | None = None,
    fused: FusedAdamArgs | None = None,
) -> None:
    """Both LAMB stages (see ``lamb_kernel.py`` for the math); ``models[i]`` may be None. ``fused`` enables
    the fast CPU path (module docstring)."""
    if not params:
        return
    skip = _skip(found_inf, host_branch)
    if skip is True:
        return
    if skip is False:
        modes = {"l2_mode": l2_mode, "decoupled": decoupled, "trust": trust}
        _lamb_host(params, grads, exp_avgs, exp_avg_sqs, models, hp, **modes, fused=fused)
        return
    lr = hp[0]
    p = _math(params, hp.dtype)  # may alias the params: only out-of-place ops on it
    m, v, u = lamb_direction(p, grads, exp_avgs, exp_avg_sqs, hp.unbind()[1:], l2_mode, decoupled, in_place=False)
    torch._foreach_mul_(u, _trust_ratios(p, u, lr, trust))
    _finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, u, skip)


def lamb_direction(
    p: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: Sequence[torch.Tensor | float],
    l2_mode: bool,
    decoupled: bool,
    *,
    in_place: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """LAMB's stage 1 in torch ops, the one copy every torch path shares (``lamb_`` and the sharded
    ``optimizers.lamb_stage1``; the math of ``lamb_kernel.py``): returns ``(m, v, u)`` with
    ``g = grad * inv_scale / clip (+ wd p in l2 mode)``, ``m = beta1 m + beta3 g``,
    ``v = beta2 v + (1 - beta2) g g``, ``u = (m / bc1) / (sqrt(v / bc2) + eps) (+ wd p when decoupled)``.

    ``scalars`` are ``hp[1:]`` (0-dim tensors, or host numbers where the skip was read on the host);
    ``p`` is the params in the math dtype (only read). ``in_place``: m and v are the state tensors themselves,
    else new tensors (committed later under the skip mask). The rounding sequence (a multiply, then an add,
    no fused ``alpha``) is the kernel's; ``_lamb_host`` keeps its own in-place sequence for the CPU fast path.
    """
    m, v = lamb_moments(p, grads, exp_avgs, exp_avg_sqs, scalars, l2_mode, in_place=in_place)
    _, _, _, _, eps, wd, bc1, bc2, _, _ = scalars
    return m, v, lamb_u(p, m, v, eps, wd, bc1, bc2, decoupled)


def lamb_moments(
    p: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: Sequence[torch.Tensor | float],
    l2_mode: bool,
    *,
    in_place: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LAMB's new moments ``(m, v)`` in the kernels' rounding sequence (:func:`lamb_direction`'s first half; also the
    8-bit CPU chunks', ``optim_fallback_state8.py``): ``g = grad * inv_scale / clip (+ wd p in l2 mode)``,
    ``m = beta1 m + beta3 g``, ``v = beta2 v + (1 - beta2) g g``; in place on ``exp_avgs``/``exp_avg_sqs`` with
    ``in_place``, else new tensors."""
    beta1, beta2, beta3, one_minus_beta2, _, wd, _, _, inv_scale, clip = scalars
    g = torch._foreach_mul(_math(grads, p[0].dtype), inv_scale)
    torch._foreach_div_(g, clip)
    if l2_mode:
        torch._foreach_add_(g, torch._foreach_mul(p, wd))
    if in_place:
        m = list(exp_avgs)
        torch._foreach_mul_(m, beta1)
    else:
        m = torch._foreach_mul(list(exp_avgs), beta1)
    torch._foreach_add_(m, torch._foreach_mul(g, beta3))
    return m, _second_moment(exp_avg_sqs, g, beta2, one_minus_beta2, in_place=in_place)


def lamb_u(
    p: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    eps: torch.Tensor | float,
    wd: torch.Tensor | float,
    bc1: torch.Tensor | float,
    bc2: torch.Tensor | float,
    decoupled: bool,
) -> list[torch.Tensor]:
    """LAMB's update direction ``u = (m / bc1) / (sqrt(v / bc2) + eps) (+ wd p when decoupled)`` from the new
    moments (new tensors; the kernel's rounding sequence)."""
    u = torch._foreach_div(m, bc1)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    if decoupled:
        torch._foreach_add_(u, torch._foreach_mul(p, wd))
    return u


def _trust_ratios(
    p: list[torch.Tensor], u: list[torch.Tensor], lr: torch.Tensor | float, trust: bool
) -> list[torch.Tensor] | torch.Tensor | float:
    """Per-tensor ``lr * |p| / |u|`` (``lr`` where either norm is 0), or plain ``lr`` without the trust ratio."""
    if not trust:
        return lr
    pn = torch.stack(torch._foreach_norm(p))
    un = torch.stack(torch._foreach_norm(u))
    return list(torch.where((pn != 0) & (un != 0), lr * (pn / un), lr).unbind())


def _lamb_host(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    trust: bool,
    fused: FusedAdamArgs | None = None,
) -> None:
    """LAMB when the skip was decided on the host (CPU): in place, host-number hyper-parameters (reading a
    CPU tensor costs no sync), no copy of the grads when there is nothing to unscale or clip: ~13 passes and
    two temporaries instead of ~22 passes and seven; with ``fused`` and where it applies, torch's fused Adam
    kernel for stage 1 (module docstring): ~4 passes."""
    lr, beta1, beta2, beta3, one_minus_beta2, eps, wd, bc1, bc2, inv_scale, clip = hp.tolist()
    p = _math(params, hp.dtype)
    if fused is not None and not l2_mode and _fused_takes(fused, p, exp_avgs, exp_avg_sqs, lamb=True):
        scaling = (inv_scale, clip)
        lists = (p, grads, exp_avgs, exp_avg_sqs, models)
        _lamb_fused(*lists, fused, scaling, lr=lr, wd=wd if decoupled else 0.0, trust=trust)
        _write_params(params, [None] * len(p), p, False)  # models: written batch by batch
        return
    g = _math(grads, hp.dtype)  # read only
    if inv_scale != 1.0 or clip != 1.0:
        g = torch._foreach_mul(g, inv_scale)
        if clip != 1.0:
            torch._foreach_div_(g, clip)
    if l2_mode:
        g = torch._foreach_add(g, p, alpha=wd)
    m, v = list(exp_avgs), list(exp_avg_sqs)
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=beta3)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, one_minus_beta2)
    u = torch._foreach_div(m, bc1)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    if decoupled:
        torch._foreach_add_(u, p, alpha=wd)
    torch._foreach_mul_(u, _trust_ratios(p, u, lr, trust))
    torch._foreach_sub_(p, u)
    _write_params(params, models, p, False)


def _finish(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    p: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    delta: list[torch.Tensor],
    skip: torch.Tensor,
) -> None:
    """Masked commit of ``p - delta`` (params, model copies) and of the new moments."""
    new_p = torch._foreach_sub(p, delta)
    _commit(exp_avgs, m, skip)
    _commit(exp_avg_sqs, v, skip)
    _write_params(params, models, new_p, skip)


def adam_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    host_branch: bool | None = None,
    fused: FusedAdamArgs | None = None,
) -> None:
    """One Adam/AdamW step (see ``adam_kernel.py`` for the math); ``models[i]`` may be None. ``fused``
    enables the fast CPU path (module docstring)."""
    if not params:
        return
    skip = _skip(found_inf, host_branch)
    if skip is True:
        return
    if skip is False:
        modes = {"l2_mode": l2_mode, "decoupled": decoupled}
        _adam_host(params, grads, exp_avgs, exp_avg_sqs, models, hp, **modes, fused=fused)
        return
    p, m, v, step = adam_terms(_math(params, hp.dtype), grads, exp_avgs, exp_avg_sqs, hp.unbind(), l2_mode,
                               decoupled, in_place=False)
    _finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, step, skip)


def adam_terms(
    p: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    scalars: Sequence[torch.Tensor],
    l2_mode: bool,
    decoupled: bool,
    *,
    in_place: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Adam's terms in the kernels' rounding sequence (``adam_kernel.py``), the one copy the masked step of
    :func:`adam_` and the 8-bit CPU chunks (``optim_fallback_state8.py``) share: ``(p', m, v, step)`` with the new
    step ``p' - step`` (``p'``: ``p`` decayed when ``decoupled``, else ``p`` itself). ``p``: the params in the math
    dtype (only read); ``scalars``: ``hp.unbind()`` (0-dim tensors); ``in_place``: m and v are updated in place
    (then the state tensors, or temporaries, themselves), else new tensors."""
    _, _, beta2, one_minus_beta1, one_minus_beta2, eps, wd, neg_step_size, bc2_sqrt, inv_scale, decay = scalars
    g = torch._foreach_mul(_math(grads, p[0].dtype), inv_scale)
    if l2_mode:
        torch._foreach_add_(g, torch._foreach_mul(p, wd))
    # m + (1 - beta1) * (g - m): torch.optim.Adam's lerp (for 1 - beta1 < 0.5, i.e. every usual beta1)
    diff = torch._foreach_sub(g, list(exp_avgs))
    torch._foreach_mul_(diff, one_minus_beta1)
    if in_place:
        m = list(exp_avgs)
        torch._foreach_add_(m, diff)
    else:
        m = torch._foreach_add(list(exp_avgs), diff)
    v = _second_moment(exp_avg_sqs, g, beta2, one_minus_beta2, in_place=in_place)
    if decoupled:
        p = torch._foreach_mul(p, decay)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    step = torch._foreach_div(m, denom)
    # p + (-lr/bc1) * step, written as p - (lr/bc1) * step: the same rounding (negation is exact)
    torch._foreach_mul_(step, -neg_step_size)
    return p, m, v, step


def _adam_host(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    fused: FusedAdamArgs | None = None,
) -> None:
    """Adam when the skip was decided on the host (CPU): ``torch.optim.Adam``'s own foreach sequence, in place,
    with the hyper-parameters as host numbers (reading a CPU tensor costs no sync): 8 passes, 1 temporary;
    with ``fused`` and where it applies, torch's fused Adam kernel: one pass (module docstring)."""
    _, _, beta2, one_minus_beta1, one_minus_beta2, eps, wd, neg_step_size, bc2_sqrt, inv_scale, decay = hp.tolist()
    p = _math(params, hp.dtype)
    if fused is not None and _fused_takes(fused, p, exp_avgs, exp_avg_sqs, lamb=False):
        lists = (p, grads, exp_avgs, exp_avg_sqs, models)
        _adam_fused(*lists, fused, inv_scale, l2_mode=l2_mode, decoupled=decoupled)
        _write_params(params, [None] * len(p), p, False)  # models: written batch by batch
        return
    g = _math(grads, hp.dtype)
    if inv_scale != 1.0:
        g = torch._foreach_mul(g, inv_scale)
    if l2_mode:
        g = torch._foreach_add(g, p, alpha=wd)
    torch._foreach_lerp_(list(exp_avgs), g, one_minus_beta1)
    torch._foreach_mul_(list(exp_avg_sqs), beta2)
    torch._foreach_addcmul_(list(exp_avg_sqs), g, g, one_minus_beta2)
    if decoupled:
        torch._foreach_mul_(p, decay)
    denom = torch._foreach_sqrt(list(exp_avg_sqs))
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(p, list(exp_avgs), denom, neg_step_size)
    _write_params(params, models, p, False)


def _fused_takes(
    fused: FusedAdamArgs,
    p: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lamb: bool,
) -> bool:
    """Whether torch's fused CPU Adam kernel computes exactly this step's math: CPU, params and moments of
    one fp32/fp64 dtype, contiguous (the kernel walks raw memory; grads of other layouts or dtypes are copied
    into a contiguous scratch buffer), bias corrections equal to ``1 - beta**t`` from the step counter as the
    kernel derives them, and for LAMB ``beta3 == 1 - beta1`` (grad averaging)."""
    if _foreach_only:
        return False
    hp = fused.hp64.tolist()
    beta1, beta2 = hp[1], hp[2]
    if lamb:
        bc1, bc2 = hp[7], hp[8]
        if hp[3] != 1.0 - beta1:
            return False
    else:
        bc1, bc2 = -hp[0] / hp[7] if hp[7] else math.nan, hp[8] ** 2
    t = float(fused.step.reshape(()))
    if not (t >= 1 and t == int(t)) or fused.step.device.type != "cpu":
        return False
    want1, want2 = 1.0 - beta1 ** int(t), 1.0 - beta2 ** int(t)
    if lamb and (bc1 != want1 or bc2 != want2):
        return False
    if not lamb and not (math.isclose(bc1, want1, rel_tol=1e-12) and math.isclose(bc2, want2, rel_tol=1e-12)):
        return False
    dtype = p[0].dtype
    if p[0].device.type != "cpu" or dtype not in (torch.float32, torch.float64):
        return False
    return _remembered(fused.memo, "fused_layout", lambda: _all_of(dtype, (*p, *exp_avgs, *exp_avg_sqs)))


def _remembered(memo: dict | None, key: str, verdict: Callable[[], bool]) -> bool:
    """``verdict()``, kept in ``memo`` (a plan group's: valid while the plan is) under ``key``."""
    if memo is None:
        return verdict()
    got = memo.get(key)
    if got is None:
        got = memo[key] = verdict()
    return got


_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def _all_of(dtype: torch.dtype, tensors: Sequence[torch.Tensor]) -> bool:
    """Are all ``tensors`` contiguous tensors of ``dtype``? (C-level ``map`` passes: this runs on every step, over
    every param, moment and grad; a generator costs ~3x as much per tensor.)"""
    return all(map(_IS_CONTIGUOUS, tensors)) and all(map(operator.is_, map(_DTYPE, tensors), repeat(dtype)))


def bump_versions(*lists: Sequence[torch.Tensor | None]) -> None:
    """Bump ``_version`` of tensors written through raw addresses (a Triton kernel, torch's fused Adam
    kernel; torch's in-place ops do it themselves): autograd then detects a modified saved tensor, and
    autocast's weight cache a new weight. ``None`` entries are ignored; a spurious bump is harmless."""
    torch.autograd.graph.increment_version([t for lst in lists for t in lst if t is not None])


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


def _adam_fused(
    p: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    fused: FusedAdamArgs,
    inv_scale: float,
    *,
    l2_mode: bool,
    decoupled: bool,
) -> None:
    """Adam/AdamW in torch's fused CPU kernel (``p`` contiguous, in place), batch by batch: a batch's scaled
    grads (when they need a copy) and its model copies are written while its data is in cache. With neither
    (the kernel reads the caller's grads, no model copies) one call takes the whole list: batches would only
    add per-call host work (74 calls instead of 1 on a BERT-base-shaped list)."""
    lr, beta1, beta2, _, _, eps, wd = fused.hp64.tolist()[:7]
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    whole = (
        inv_scale == 1.0
        and _remembered(fused.memo, "grads_as_they_are", lambda: _reads_grads_as_they_are(p, grads))
        and all(map(operator.is_, models, repeat(None)))
    )
    decay = wd if (decoupled or l2_mode) else 0.0

    def run(pb: list, gb: list, mb: list, vb: list) -> None:
        kernel(
            pb, gb, mb, vb, [], [fused.step] * len(pb),
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=decay, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        bump_versions(pb, mb, vb)

    if whole:  # the caller's lists as they are (the layout verdict is the plan group's: no per-tensor pass)
        run(p, list(grads), list(exp_avgs), list(exp_avg_sqs))
        return
    for rows in _batches(p):
        pb, mb, vb = [p[i] for i in rows], [exp_avgs[i] for i in rows], [exp_avg_sqs[i] for i in rows]
        run(pb, _grads_for(pb, [grads[i] for i in rows], inv_scale, 1.0), mb, vb)
        _write_models(models, rows, pb)


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


def _lamb_fused(
    p: list[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    fused: FusedAdamArgs,
    scaling: tuple[float, float],
    *,
    lr: float,
    wd: float,
    trust: bool,
) -> None:
    """LAMB stage 1 in torch's fused Adam kernel, then the trust ratio and the update, batch by batch:
    ``buf = -wd p`` (or 0), ``buf -= (1 / bc1) m / (sqrt(v) / sqrt(bc2) + eps)`` (the kernel with lr = 1 and
    ``buf`` as its param), so ``buf = -u``; then ``p += ratio * buf`` with ``ratio = lr |p| / |buf|``
    (``|buf| = |u|``; float64 host numbers from the fp32 norms). Without the trust ratio (then ``wd == 0``)
    the step is ``p -= lr u``: the kernel runs on ``p`` itself with the learning rate, no buffer, no norms.
    ``scaling = (inv_scale, clip)``. Model copies are written per batch, from cache."""
    lr64, beta1, beta2, _, _, eps, *_ = fused.hp64.tolist()
    with_models = any(m is not None for m in models)
    for rows in _batches(p):
        pb, mb, vb = [p[i] for i in rows], [exp_avgs[i] for i in rows], [exp_avg_sqs[i] for i in rows]
        gb = _grads_for(pb, [grads[i] for i in rows], *scaling)
        steps = [fused.step] * len(rows)
        if not trust:
            torch._fused_adam_(
                pb, gb, mb, vb, [], steps,
                lr=lr64, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
            )  # fmt: skip
            if with_models:
                _write_models(models, rows, pb)
            continue
        flat, buf = _scratch_views("update", pb)
        if wd != 0.0:
            _scaled_into(flat, buf, pb, -wd)
        else:
            flat.zero_()
        torch._fused_adam_(
            buf, gb, mb, vb, [], steps,
            lr=1.0, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        ratios = [
            lr * math.sqrt(pp / uu) if pp != 0 and uu != 0 else lr
            for pp, uu in zip(_sumsq32(pb), _sumsq32(buf, tiled=flat if buf[0].dtype is torch.float32 else None))
        ]
        _add_scaled(pb, buf, flat, ratios)
        if with_models:
            _write_models(models, rows, pb)
    bump_versions(exp_avgs, exp_avg_sqs, [] if trust else p)  # once (``add_`` bumps ``p`` itself)
