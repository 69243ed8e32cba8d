"""Device functions the SGD, Adagrad and NovoGrad kernels share for their result check (``VERIFY``).

A finite gradient can still make a non-finite update (``g * g`` in Adagrad's sum, a momentum buffer or a
weight pushed past float32's or fp16's range by a large ``lr`` or ``momentum``). Each of these kernels runs
twice per step: first with ``VERIFY`` on, computing every value the step would store (params rounded to
their dtype, model copies, state) and storing none, only raising ``found_inf`` when one of them would be
inf/NaN; then, in stream order, the real pass, which reads that flag and writes nothing when it is set.
So a step is taken whole or not at all (docs/guarantees.md, 2.15).

A tensor ``lr`` that is NaN, inf or negative makes every result non-finite or meaningless; that step is
skipped by the optimizer's own ``hparam_skips`` check, so the result check stays disarmed for it
(``armed`` is 0): ``found_inf`` is the loss scaler's, raised only for what a smaller scale could fix.
"""

import triton
import triton.language as tl

from ._chunks import store_chunk
from ._rounding import round_to


@triton.jit
def nonfinite(x):
    """True where ``x`` (fp16, bf16 or fp32) is inf or NaN (``|x| < inf`` is false for both)."""
    return ~(tl.abs(x.to(tl.float32)) < float("inf"))


@triton.jit
def lr_arms(neg_lr):
    """1 when ``-neg_lr`` is a valid learning rate (finite, >= 0), else 0 (NaN compares false)."""
    return ((neg_lr <= 0) & (neg_lr > -float("inf"))).to(tl.int32)


@triton.jit
def raise_found_inf(found_inf_ptr, bad, armed):
    """``found_inf = max(found_inf, 1)`` when any lane of ``bad`` (int32, per lane) is set and ``armed``."""
    tl.atomic_max(found_inf_ptr, (tl.max(bad, axis=0) * armed).to(tl.float32))


@triton.jit
def check_or_store(
    p,
    state,
    p_ptr,
    state_ptr,
    model_ptr,
    offs,
    mask,
    full,
    bad,
    P_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    VERIFY: tl.constexpr,
):
    """The end of one chunk of an update: with ``VERIFY``, ``bad`` (int32 lanes) or-ed with "a value this chunk
    would store is inf/NaN" and nothing stored; else the fp32 ``state`` (``HAS_STATE``), the param rounded to
    ``P_DTYPE`` and the model copy (``HAS_MODEL``) stored. Returns ``bad``."""
    new_p = round_to(p, P_DTYPE)
    if VERIFY:
        out = nonfinite(new_p)
        if HAS_STATE:
            out = out | nonfinite(state)
        if HAS_MODEL:
            out = out | nonfinite(round_to(p, MODEL_DTYPE))
        bad = tl.maximum(bad, (mask & out).to(tl.int32))
    else:
        if HAS_STATE:
            store_chunk(state_ptr, offs, state, mask, full)
        store_chunk(p_ptr, offs, new_p, mask, full)
        if HAS_MODEL:
            store_chunk(model_ptr, offs, round_to(p, MODEL_DTYPE), mask, full)
    return bad
