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

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .rounding import round_to
from .rows import ApexRows
from .skeleton import chunk_rows_one_state, load_param_grad, skip_and_stop, store_span, table_row
from .step_scalars import DeviceStep, finish_ticket, step_advance
from .table import chunk_table, triton_dtype


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
    span,
    bad,
    P_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    VERIFY: tl.constexpr,
):
    """The end of one chunk (``span``, ``skeleton.chunk_rows_one_state``) of an update: with ``VERIFY``,
    ``bad`` (int32 lanes) or-ed with "a value this chunk would store is inf/NaN" and nothing stored; else the fp32
    ``state`` (``HAS_STATE``), the param rounded to ``P_DTYPE`` and the model copy (``HAS_MODEL``) stored. Returns
    ``bad``."""
    new_p = round_to(p, P_DTYPE)
    if VERIFY:
        out = nonfinite(new_p)
        if HAS_STATE:
            out = out | nonfinite(state)
        if HAS_MODEL:
            out = out | nonfinite(round_to(p, MODEL_DTYPE))
        bad = tl.maximum(bad, (span[2] & out).to(tl.int32))
    else:
        if HAS_STATE:
            store_span(state_ptr, span, state)
        store_span(p_ptr, span, new_p)
        if HAS_MODEL:
            store_span(model_ptr, span, round_to(p, MODEL_DTYPE))
    return bad


@triton.jit
def chunk_start(table, c, inv_scale, gbad, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                ALIGNED: tl.constexpr, VERIFY: tl.constexpr, STEP: tl.constexpr):
    """``(span, p_ptr, s_ptr, p, g, gbad)``, how an SGD/Adagrad/NovoGrad pass starts chunk ``c``: its rows
    (``skeleton.chunk_rows_one_state``), its param and unscaled gradient (``load_param_grad``) and the check
    pass's lanes (:func:`check_grad`)."""
    span, p_ptr, g_ptr, s_ptr = chunk_rows_one_state(table, c, P_DTYPE, G_DTYPE, BLOCK, ALIGNED)
    p, g = load_param_grad(p_ptr, g_ptr, span, inv_scale)
    gbad = check_grad(gbad, g, span, VERIFY, STEP)
    return span, p_ptr, s_ptr, p, g, gbad


@triton.jit
def chunk_end(table, span, p, state, p_ptr, state_ptr, bad, P_DTYPE: tl.constexpr, MODEL_DTYPE: tl.constexpr,
              HAS_STATE: tl.constexpr, HAS_MODEL: tl.constexpr, ALIGNED: tl.constexpr, VERIFY: tl.constexpr):
    """How an SGD/Adagrad/NovoGrad pass ends a chunk: :func:`check_or_store` with the model copy's row (3)."""
    model_ptr = table_row(table, 3, span[0], MODEL_DTYPE, ALIGNED)
    return check_or_store(p, state, p_ptr, state_ptr, model_ptr, span, bad, P_DTYPE, MODEL_DTYPE, HAS_STATE, HAS_MODEL,
                          VERIFY)


@triton.jit
def entry_flag(found_inf_ptr, OWN_FLAG: tl.constexpr):
    """The skip flag as a device step's check-and-verify launch finds it: 0 for the optimizer's own flag (written
    whole by this launch, so its old value is not read), else the handed-over (or an earlier launch's) value."""
    if OWN_FLAG:
        return tl.zeros((), dtype=tl.float32)
    else:
        return tl.load(found_inf_ptr).to(tl.float32)


@triton.jit
def pass_start(found_inf_ptr, num_chunks, BLOCK: tl.constexpr, VERIFY: tl.constexpr, STEP: tl.constexpr):
    """``(entry, skip, stop, bad, gbad)`` at the start of an SGD/Adagrad/NovoGrad pass: the flag as found
    (:func:`entry_flag`), whether the step is skipped, the chunk loop's end (0 when skipped: nothing read or
    written) and the zeroed result and grad lanes. A device step's check-and-verify launch is the check pass too,
    so it does not read an own flag's old value."""
    entry = entry_flag(found_inf_ptr, STEP.OWN_FLAG)
    if VERIFY and STEP.HP_DEVICE:
        skip, stop = entry != 0, tl.where(entry != 0, 0, num_chunks)
    else:
        skip, stop = skip_and_stop(found_inf_ptr, num_chunks)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    return entry, skip, stop, bad, bad


@triton.jit
def check_grad(gbad, g, span, VERIFY: tl.constexpr, STEP: tl.constexpr):
    """The check pass's lanes in a device step's check-and-verify launch: ``gbad`` or-ed with "the unscaled
    gradient ``g`` is inf/NaN" in the chunk ``span`` (unchanged elsewhere)."""
    if VERIFY and STEP.HP_DEVICE:
        gbad = tl.maximum(gbad, (span[2] & nonfinite(g)).to(tl.int32))
    return gbad


@triton.jit
def pass_end(found_inf_ptr, step, results, gbad, bad, neg_lr, entry, skip, VERIFY: tl.constexpr, STEP: tl.constexpr):
    """The end of an SGD/Adagrad/NovoGrad pass: a device step's check-and-verify finish
    (:func:`finish_check_and_verify`, with the step bundle's ticket ``step[1]``), the host-vector result check's
    raise (:func:`raise_found_inf`), or, after a device step's update that was not skipped, the step counter's
    advance (``_step_scalars.step_advance``)."""
    if VERIFY and STEP.HP_DEVICE:
        finish_check_and_verify(found_inf_ptr, results, step[1], gbad, bad, lr_arms(neg_lr), entry, STEP.FIRST,
                                STEP.COUNT)
    elif VERIFY:
        raise_found_inf(found_inf_ptr, bad, lr_arms(neg_lr))
    elif STEP.HP_DEVICE and not skip:
        step_advance(step, STEP.ADVANCE)


@triton.jit
def finish_check_and_verify(found_inf_ptr, results, ticket_ptr, gbad, rbad, armed, entry, FIRST: tl.constexpr,
                            COUNT: tl.constexpr):
    """The end of a device step's check-and-verify launch (the check pass and the result check in one read of
    the grads; docs/optim.md, "The step on the device"). ``results``: the bundle ``(bad_ptr, result_ptr,
    nonfinite_count_ptr, result_count_ptr)`` (:func:`step_arguments`). Every program or-s its lanes into ``bad_ptr``
    (int32 ``[2]``: ``[0]`` an unscaled grad is inf/NaN, ``[1]`` a stored value would be); the program that takes
    the last ticket (``_step_scalars.finish_ticket``) then, as the two passes of the host-vector step do:

    * raises ``found_inf`` for a non-finite grad (the check pass), else, when the result check is ``armed`` (a
      valid ``lr``), for a non-finite result; the flag is written whole, ``max(entry, ...)``;
    * writes ``result_ptr`` (float32 ``[1]``): 1 when the result check raised the flag (stored whole by the
      ``FIRST`` launch of the step, else or-ed in), and adds it to ``result_count_ptr`` (int64 ``[1]``);
    * with ``COUNT`` (the optimizer's own flag), adds 1 to ``nonfinite_count_ptr`` when this launch raised it.

    It resets ``bad_ptr`` for the next step."""
    bad_ptr, result_ptr, nonfinite_count_ptr, result_count_ptr = results
    tl.atomic_max(bad_ptr, tl.max(gbad, axis=0), sem="acq_rel")
    tl.atomic_max(bad_ptr + 1, tl.max(rbad, axis=0) * armed, sem="acq_rel")
    tl.debug_barrier()
    if finish_ticket(ticket_ptr):
        grads_bad = tl.atomic_xchg(bad_ptr, 0, sem="acq_rel") != 0
        results_bad = tl.atomic_xchg(bad_ptr + 1, 0, sem="acq_rel") != 0
        clear = entry == 0
        raised_r = clear & ~grads_bad & results_bad
        raised = clear & (grads_bad | results_bad)
        tl.store(found_inf_ptr, tl.where(raised, 1.0, entry))
        if FIRST:
            tl.store(result_ptr, raised_r.to(tl.float32))
        else:
            tl.store(result_ptr, tl.maximum(tl.load(result_ptr, cache_modifier=".cg"), raised_r.to(tl.float32)))
        tl.store(result_count_ptr, tl.load(result_count_ptr, cache_modifier=".cg") + raised_r.to(tl.int64))
        if COUNT:
            tl.store(nonfinite_count_ptr, tl.load(nonfinite_count_ptr, cache_modifier=".cg") + raised.to(tl.int64))


@dataclass(eq=False)
class StepVerify:
    """What a device step's check-and-verify launches write besides ``found_inf`` (:func:`finish_check_and_verify`):
    ``result`` (float32 ``[1]``, 1 when the result check raised the flag this step), ``result_count`` (int64 ``[1]``,
    the optimizer's ``result_skips``), ``nonfinite_count`` (int64 ``[1]``, ``nonfinite_skips``; None when the flag
    is a loss scaler's), ``own_flag`` (the flag is the optimizer's own, written whole by the first launch).
    ``launches`` counts the step's check-and-verify launches so far (one per kernel group)."""

    result: torch.Tensor
    result_count: torch.Tensor
    nonfinite_count: torch.Tensor | None
    own_flag: bool
    launches: int = 0


def apex_rows(rows: ApexRows) -> tuple[Any, dict[str, Any]]:
    """``(table, constexprs)`` of an SGD, Adagrad or NovoGrad launch over ``rows`` (``engine/rows.py``; ``models``
    None without model copies). The address table: params, grads, the state (the params again for SGD without
    momentum), the model copies (the params again without them); the params, the state and the model copies
    written. The constexprs of its rows: the param, grad and model-copy dtypes, whether there are model copies, the
    table's chunk size and alignment."""
    params, grads, states, models = rows
    written = (0,) + ((2,) if states else ()) + ((3,) if models is not None else ())
    table = chunk_table([params, grads, states[0] if states else params, params if models is None else models],
                        written=written)
    p_dtype = triton_dtype(params[0].dtype)
    model_dtype = p_dtype if models is None else triton_dtype(models[0].dtype)
    return table, {"P_DTYPE": p_dtype, "G_DTYPE": triton_dtype(grads[0].dtype), "MODEL_DTYPE": model_dtype,
                   "HAS_MODEL": models is not None, "BLOCK": table.block, "ALIGNED": table.aligned}


def step_arguments(
    hp: torch.Tensor | DeviceStep, table: Any, names: Sequence[str], verify: bool, check: StepVerify | None
) -> tuple[Any, tuple, tuple, dict]:
    """``(hp_ptr, step, results, constexprs)`` of the SGD, Adagrad and NovoGrad kernels: ``DeviceStep.arguments``
    (``engine/step_scalars.py``: the step bundle ``step``), then the bundle ``results`` of the check-and-verify finish's
    four pointers (:func:`finish_check_and_verify`; placeholders outside it)."""
    device_verify = verify and isinstance(hp, DeviceStep)
    if device_verify:
        if check is None:
            raise RuntimeError("a device step's result check needs its StepVerify")
        hp = dataclasses.replace(hp, advance=True)  # for the table's ticket (the launch advances nothing)
    hp_ptr, scalars, flags = DeviceStep.arguments(hp, table, names)
    if not device_verify or check is None:
        return hp_ptr, scalars, (hp_ptr,) * 4, flags
    bad = table.scratch_buffer("verify_bad", 2, torch.int32, zero=True)
    first = check.launches == 0
    check.launches += 1
    counts = check.nonfinite_count
    results = (bad, check.result, bad if counts is None else counts, check.result_count)
    step = flags["STEP"]._replace(ADVANCE=False, OWN_FLAG=check.own_flag and first, FIRST=first,
                                  COUNT=counts is not None)
    return hp_ptr, scalars, results, {"STEP": step}
