"""Torch implementation of Adam and LAMB with 8-bit moments (``state_bits=8``): the math of the Triton kernels under
``QSTATE`` (``triton/adam.py``, ``triton/lamb.py``), built on the fp32 torch twins
(``fp16kit/kernels/fallback/adam.py``, ``fp16kit/kernels/fallback/lamb.py``). The float64 reference is
``fp16kit/numerics/reference/state8.py``.

Per step, for the positions whose moments are 8-bit (uint8 codes, ``state8.uses_state8``): dequantize m and v into
fp32 temporaries, run the fp32 rule on them, quantize the new moments back (``state8.quantize``). Positions with
fp32 moments (small tensors) run the fp32 rule on their own state. Adam updates p from the new fp32 moments; LAMB
computes ``u`` and its norms from the moments as stored (quantized, then dequantized), as the kernel does. The
masked (device-flag) sequence of the fp32 twins is used throughout, so the moments, codes and absmax match the
kernels' bit for bit (under ``state_bits=8`` every fallback row takes this path, fp32-state rows included); with
``found_inf`` set nothing is written (codes and absmax included).

On the CPU (the skip read on the host, unless ``fallback.step.masked_commits()``) the 8-bit rows run chunk by chunk,
``_CHUNK`` elements at a time, so that a chunk's temporaries stay in L2: dequantize, the same operations of that
sequence in place on the temporaries (no masked commits: the skip is known clear), quantize straight into the codes
and absmax (``state8.quantize_into``, whose code is a table look-up, not a search); LAMB's ``u`` is written into
whole tensors, so its norms are summed as before. ``tests/optim/test_state8_cpu_path.py`` checks the two paths
bit for bit.

Rows whose moments are 8-bit but whose param, grad or model copy is not contiguous (a channels_last conv weight, a
transposed weight, amp O2's model copy of one) step on contiguous copies of those tensors, written back after the
step (:func:`_dense_rows`): the codes are laid out in the param's logical (contiguous) order, the same rule on the
same elements in the same order, so the result is the contiguous run's bit for bit (``tests/test_trust_round4.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..fallback import adam as fb_adam
from ..fallback import lamb as fb_lamb
from ..fallback import step as fb_step
from ..fallback.step import Rows
from .rule import QBLOCK, absmax_of, dequantize, quantize, quantize_into

_U8 = torch.uint8


def _dequantized(codes: Sequence[torch.Tensor], signed: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The moments in fp32 (8-bit ones dequantized into new tensors, fp32 ones as they are) and the 8-bit
    positions."""
    quant = [i for i, c in enumerate(codes) if c.dtype == _U8]
    values = list(codes)
    for i in quant:
        values[i] = dequantize(codes[i], absmax_of(codes[i]), signed)
    return values, quant


def _requantize(
    codes: Sequence[torch.Tensor],
    values: list[torch.Tensor],
    quant: list[int],
    signed: bool,
    skip: torch.Tensor,
    stored: bool = False,
) -> None:
    """Quantize ``values[i]`` into the 8-bit moment ``codes[i]`` for ``i`` in ``quant`` (kept where ``skip``); with
    ``stored``, replace ``values[i]`` by the values as stored."""
    for i in quant:
        q, a = quantize(values[i], signed)
        old = absmax_of(codes[i])
        codes[i].copy_(torch.where(skip, codes[i], q))
        old.copy_(torch.where(skip, old, a))
        if stored:
            values[i] = dequantize(q, a, signed)


def _dense_rows(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None], list[tuple]]:
    """``(params, grads, models, back)``: the lists with every 8-bit row's non-contiguous param, grad and model copy
    replaced by a contiguous copy, and ``back``, the ``(tensor, copy)`` pairs to copy home after
    the step (a skipped step leaves the copies as they were: writing them back changes no bit)."""
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    if all(p.is_contiguous() and g.is_contiguous() and (m is None or m.is_contiguous())
           for p, g, m in zip(params, grads, models)):
        return list(params), list(grads), list(models), back
    params, grads, models = list(params), list(grads), list(models)
    for i, m in enumerate(exp_avgs):
        if m.dtype != _U8:
            continue
        grads[i] = grads[i].contiguous()
        for xs in (params, models):
            x = xs[i]
            if x is not None and not x.is_contiguous():
                xs[i] = x.contiguous()
                back.append((x, xs[i]))
    return params, grads, models, back


def _on_dense_rows(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn(rows, ...)`` (``rows``: :data:`fp16kit.kernels.fallback.step.Rows`) on :func:`_dense_rows`' lists, then
    the contiguous copies written back into the caller's tensors."""

    @functools.wraps(fn)
    def run(rows: Rows, *args: Any, **kw: Any) -> None:
        params, grads, exp_avgs, exp_avg_sqs, models = rows
        params, grads, models, back = _dense_rows(params, grads, exp_avgs, models)
        fn((params, grads, exp_avgs, exp_avg_sqs, models), *args, **kw)
        for dst, src in back:
            dst.copy_(src)

    return run


@_on_dense_rows
def adam8_(rows: Rows, hp: torch.Tensor, found_inf: torch.Tensor, *, l2_mode: bool, decoupled: bool) -> None:
    """One Adam/AdamW step (``triton/adam.py``) over moments that may be 8-bit (``rows``:
    :data:`fp16kit.kernels.fallback.step.Rows`; non-contiguous 8-bit rows on contiguous copies:
    :func:`_on_dense_rows`)."""
    params, grads, exp_avgs, exp_avg_sqs, models = rows
    if not params:
        return
    host_skip = fb_step._skip(found_inf, None)  # a bool on the CPU (unless masked_commits())
    if host_skip is True:
        return  # a skipped step writes nothing
    if host_skip is False:
        plain, chunked = _cpu_rows(params, grads, exp_avgs, models)
        if plain:
            pick = _picker(plain)
            fb_adam.adam_(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), pick(models), hp,
                                 found_inf, l2_mode=l2_mode, decoupled=decoupled, host_branch=False)
        scalars = hp.unbind()
        for i, start, stop, blocks in chunked:
            views = _chunk(i, start, stop, params, grads, models)
            m = dequantize(exp_avgs[i].view(-1)[start:stop], absmax_of(exp_avgs[i])[blocks], True)
            v = dequantize(exp_avg_sqs[i].view(-1)[start:stop], absmax_of(exp_avg_sqs[i])[blocks], False)
            _adam_chunk(views, m, v, scalars, l2_mode, decoupled)
            quantize_into(m, exp_avgs[i].view(-1)[start:stop], absmax_of(exp_avgs[i])[blocks], True)
            quantize_into(v, exp_avg_sqs[i].view(-1)[start:stop], absmax_of(exp_avg_sqs[i])[blocks], False)
        return
    m, quant = _dequantized(exp_avgs, True)
    v, _ = _dequantized(exp_avg_sqs, False)
    fb_adam.adam_(params, grads, m, v, models, hp, found_inf, l2_mode=l2_mode, decoupled=decoupled,
                         host_branch=False)
    skip = found_inf.reshape(()) != 0
    _requantize(exp_avgs, m, quant, True, skip)
    _requantize(exp_avg_sqs, v, quant, False, skip)


def _adam_chunk(
    views: list[torch.Tensor | None], m: torch.Tensor, v: torch.Tensor, scalars: Sequence[torch.Tensor],
    l2_mode: bool, decoupled: bool,
) -> None:
    """``fb_adam.adam_terms`` (the masked sequence of ``fb_adam.adam_``) on one chunk ``views = [p, g,
    model]`` whose skip is known clear: m and v (temporaries) updated in place, p and the model copy written without
    the masked commits' ``where``. Bit for bit that sequence (``tests/optim/test_state8_cpu_path.py``)."""
    p, g, model = views
    math = scalars[0].dtype
    (pm,), _, _, (step,) = fb_adam.adam_terms(
        fb_step._math([p], math), [g], [m], [v], scalars, l2_mode, decoupled, in_place=True
    )
    if pm is p:
        new = torch.sub(p, step, out=p)
    else:
        new = pm - step
        p.copy_(new)
    if model is not None:
        model.copy_(new)


#: Elements per chunk of the CPU path: a chunk's fp32 temporaries (about a dozen: dequantized m and v, the Adam/LAMB
#: terms, the quotients of the quantizer) stay in the per-core L2 cache from the dequantization to the quantization.
_CHUNK = 1 << 16
assert _CHUNK % QBLOCK == 0


def _cpu_rows(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
) -> tuple[list[int], list[tuple[int, int, int, slice]]]:
    """The CPU path's schedule: the rows stepped whole (fp32 moments), and the chunks ``(row, start, stop, absmax
    blocks)`` of the 8-bit rows, ``_CHUNK`` elements each (block aligned: a chunk's blocks are the tensor's). The
    8-bit rows' tensors are contiguous here (:func:`_dense_rows`): a chunk is a flat view of each."""
    plain, chunks = [], []
    for i, (p, g, m, model) in enumerate(zip(params, grads, exp_avgs, models)):
        if m.dtype != _U8:
            plain.append(i)
            continue
        if not (p.is_contiguous() and g.is_contiguous() and (model is None or model.is_contiguous())):
            raise AssertionError("fp16kit: an 8-bit row reached the chunked CPU path with a non-contiguous tensor")
        n = p.numel()
        for start in range(0, n, _CHUNK):
            stop = min(start + _CHUNK, n)
            chunks.append((i, start, stop, slice(start // QBLOCK, -(-stop // QBLOCK))))
    return plain, chunks


def _picker(rows: list[int]):
    return lambda xs: [xs[i] for i in rows]


def _chunk(i: int, start: int, stop: int, *lists: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Elements ``[start, stop)`` of row ``i`` of each list (flat views: writes land in the tensors)."""
    return [None if xs[i] is None else xs[i].view(-1)[start:stop] for xs in lists]


def lamb8_stage1(
    lists: tuple[Sequence[torch.Tensor], ...],
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LAMB's stage 1 over moments that may be 8-bit (``lists``: ``(params, grads, exp_avgs, exp_avg_sqs)``): the new
    moments committed (quantized where 8-bit; kept where ``found_inf``), and ``(p, u)``: the params in fp32 and the
    update direction from the moments as stored."""
    params, grads, exp_avgs, exp_avg_sqs = lists
    skip = found_inf.reshape(()) != 0
    scalars = hp.unbind()
    # p is only read here (the caller writes p - ratio * u): contiguous copies of the 8-bit rows need no write-back
    p, grads, _, _ = _dense_rows(fb_step._math(params, hp.dtype), grads, exp_avgs, [None] * len(params))
    if fb_step._skip(found_inf, None) is False:  # the CPU (unless masked_commits()), not skipped
        return p, _lamb8_direction_cpu(p, (grads, exp_avgs, exp_avg_sqs), scalars, (l2_mode, decoupled))
    _, _, _, _, _, eps, wd, bc1, bc2, _, _ = scalars
    m_old, quant = _dequantized(exp_avgs, True)
    v_old, _ = _dequantized(exp_avg_sqs, False)
    m, v, u = fb_lamb.lamb_direction(p, (grads, m_old, v_old), scalars[1:], (l2_mode, decoupled), in_place=False)
    m, v = list(m), list(v)
    _requantize(exp_avgs, m, quant, True, skip, stored=True)
    _requantize(exp_avg_sqs, v, quant, False, skip, stored=True)
    if quant:
        u = fb_lamb.lamb_u(p, m, v, eps, wd, bc1, bc2, decoupled)
    plain = [i for i in range(len(params)) if i not in set(quant)]
    fb_step._commit([exp_avgs[i] for i in plain], [m[i] for i in plain], skip)
    fb_step._commit([exp_avg_sqs[i] for i in plain], [v[i] for i in plain], skip)
    return p, list(u)


def _lamb8_direction_cpu(
    p: list[torch.Tensor], rows: tuple[Sequence[torch.Tensor], ...], scalars: Sequence[torch.Tensor],
    modes: tuple[bool, bool],
) -> list[torch.Tensor]:
    """:func:`lamb8_stage1` on the CPU, the step not skipped (``p``: the params in the math dtype, ``rows``:
    ``(grads, exp_avgs, exp_avg_sqs)``, ``scalars``: ``hp.unbind()``, ``modes``: ``(l2_mode, decoupled)``): the
    moments committed, and ``u``. The fp32-moment rows
    whole, the 8-bit rows chunk by chunk (dequantize, the rule, quantize into the state, ``u`` from the stored
    values into a whole-tensor ``u``: the norms are taken over whole tensors as before). The same operations on
    the same elements: bit for bit."""
    l2_mode, decoupled = modes
    grads, exp_avgs, exp_avg_sqs = rows
    _, _, _, _, _, eps, wd, bc1, bc2, _, _ = scalars
    u: list[torch.Tensor] = [torch.empty_like(t) for t in p]
    plain, chunked = _cpu_rows(p, grads, exp_avgs, [None] * len(p))
    if plain:
        pick = _picker(plain)
        m, v, u_plain = fb_lamb.lamb_direction(pick(p), tuple(map(pick, rows)), scalars[1:], modes, in_place=False)
        fb_step._commit(pick(exp_avgs), m, False)
        fb_step._commit(pick(exp_avg_sqs), v, False)
        for i, t in zip(plain, u_plain):
            u[i] = t
    for i, start, stop, blocks in chunked:
        pc, gc = _chunk(i, start, stop, p, grads)
        codes_m, codes_v = exp_avgs[i].view(-1)[start:stop], exp_avg_sqs[i].view(-1)[start:stop]
        absmax_m, absmax_v = absmax_of(exp_avgs[i])[blocks], absmax_of(exp_avg_sqs[i])[blocks]
        m = dequantize(codes_m, absmax_m, True)
        v = dequantize(codes_v, absmax_v, False)
        fb_lamb.lamb_moments([pc], ([gc], [m], [v]), scalars[1:], l2_mode, in_place=True)
        quantize_into(m, codes_m, absmax_m, True)
        quantize_into(v, codes_v, absmax_v, False)
        # u from the moments as stored (lamb_u's sequence), straight into the whole-tensor u
        uc = torch.div(dequantize(codes_m, absmax_m, True), bc1, out=u[i].view(-1)[start:stop])
        denom = dequantize(codes_v, absmax_v, False)
        denom /= bc2
        denom.sqrt_()
        denom += eps
        uc /= denom
        if decoupled:
            uc += pc * wd
    return u


def lamb8_(
    rows: Rows, hp: torch.Tensor, found_inf: torch.Tensor, *, l2_mode: bool, decoupled: bool, trust: bool
) -> None:
    """Both LAMB stages (``triton/lamb.py``) over moments that may be 8-bit; ``u`` from the stored moments.
    ``rows``: :data:`fp16kit.kernels.fallback.step.Rows`."""
    params, models = rows[0], rows[4]
    if not params:
        return
    p, u = lamb8_stage1(rows[:4], hp, found_inf, l2_mode=l2_mode, decoupled=decoupled)
    torch._foreach_mul_(u, fb_lamb._trust_ratios(p, u, hp[0], trust))
    fb_step._write_params(params, models, torch._foreach_sub(p, u), found_inf.reshape(()) != 0)
