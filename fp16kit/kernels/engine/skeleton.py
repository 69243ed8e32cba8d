"""Device functions: what every optimizer kernel does around its update rule (apex's ``multi_tensor_*_kernel.cu``
share one load / math / store skeleton the same way).

An optimizer kernel takes its arguments in bundles (tuples, one kernel argument each; Triton flattens them into
the launch's parameter list in order): ``table`` (``ChunkTable.leading_args()``: ``ptrs, num_tensors, numels,
chunk_tensor, chunk_start, num_chunks``), ``step`` (``DeviceStep.arguments``' scalars, read by
``_step_scalars.step_host64`` and its siblings) and, for Adam and LAMB, the epilogues' ``weights``
(``_bf16_weights.launch_arguments``) and ``state`` (``_state8.state_rows``). A chunk's place is the bundle ``span =
(t, offs, mask, full)`` (``chunk_span``). The compile-time switches come in named tuples too: ``STEP``
(``_step_scalars.StepFlags``) and, for Adam and LAMB, ``EPILOGUE`` (``_bf16_weights.Epilogue``). The device
functions take the bundles whole, so a new epilogue adds to the bundle its host helper builds and to the device
functions that read it, not a parameter to every kernel, device function and launcher.

An optimizer kernel over an address table (rows ``0`` params or fp32 masters, ``1`` grads, then state rows, and
``4`` the low-precision model copy in master-weights mode) is::

    skip, stop = skip_and_stop(found_inf_ptr, table[5])          # a set flag: zero iterations, nothing written
    for c in range(pid, stop, tl.num_programs(0)):
        span, p_ptr, g_ptr, m_ptr, v_ptr = chunk_rows(table, c, ...)
        p, m, v = load_param_moments(p_ptr, m_ptr, v_ptr, span)
        g = load_grad(g_ptr, span)
        ... the update rule ...
        store_param(table, span, p_ptr, p, ...)                  # the param and, with masters, the model copy
                                                                 # (Adam/LAMB: _bf16_weights.store_weights)
    end_pass(skip, step, STEP)                                   # step_advance (engine/step_scalars.py) unless skipped

apex's optimizers (``triton/sgd.py``, ``triton/adagrad.py``, ``triton/novograd.py``) have one state row: rows ``0``
params, ``1`` grads, ``2`` the state (momentum buffer, sum of squares, exp_avg), ``3`` the model copy. Their
hyper-parameters are a host-built float32 vector ``hp = [lr, ..., inv_scale]`` or, in a device step
(``STEP.HP_DEVICE``), the step bundle; their pass starts and ends in ``engine/results.py`` (the result check needs a
``VERIFY`` twin of the store; its pointers are the bundle ``results``)::

    neg_lr = hp_neg_lr(hp_ptr, step, STEP)                      # -hp[0]
    x = hp_value(hp_ptr, step, i, STEP)                         # hp[i], i = 1, 2, ... (host number i)
    inv_scale = hp_inv_scale(hp_ptr, last, step, STEP)          # hp[last]
    entry, skip, stop, bad, gbad = pass_start(...)             # results.py: skip_and_stop, or the check pass's flag
    for c in range(pid, stop, tl.num_programs(0)):
        span, p_ptr, s_ptr, p, g, gbad = chunk_start(table, c, inv_scale, gbad, ...)  # engine/results.py
                                                               # (rows, param and unscaled grad, the check's lanes)
        s = load_chunk(s_ptr, ...)                             # (SGD: only with momentum, after the first use)
        ... the update rule ...
        bad = chunk_end(table, span, p, s, p_ptr, s_ptr, bad, ...)  # engine/results.py: check_or_store, model row 3
    pass_end(found_inf_ptr, step, results, ...)                # results.py: finish the check, or advance the step

As in ``chunk_rows``, every row's address is loaded before the chunk's data: the address loads are independent and
overlap, where an address loaded next to its data would wait for the loads before it (the compiled code keeps the
source's order: an address-and-load helper made each row a round trip of its own in the sm_90 PTX).

Loads widen exactly to fp32 and stores round to nearest even on every backend (``engine/rounding.py``); full chunks are
unmasked and vectorize (``engine/chunks.py``).
"""

import triton
import triton.language as tl

from .chunks import chunk_span, load_chunk, row_pointer, store_chunk
from .rounding import round_to, to_fp32
from .step_scalars import step_advance, step_host64, step_inv_scale64, step_lr64


@triton.jit
def skip_and_stop(found_inf_ptr, num_chunks):
    """``(skip, stop)``: the step is skipped when the flag is set; then the chunk loop runs to 0, not ``num_chunks``."""
    skip = tl.load(found_inf_ptr) != 0
    return skip, tl.where(skip, 0, num_chunks)


@triton.jit
def end_pass(skip, step, STEP: tl.constexpr):
    """After a pass's chunks: a step that was not skipped advances the step bundle's counter (``step_advance``)."""
    if not skip:
        step_advance(step, STEP.ADVANCE)


@triton.jit
def table_row(table, row, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """``row_pointer`` of the table bundle: the address of tensor ``t`` in row ``row``, typed ``DTYPE``."""
    return row_pointer(table[0], row, table[1], t, DTYPE, ALIGNED)


@triton.jit
def chunk_rows_one_state(table, c, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                         ALIGNED: tl.constexpr):
    """``(span, p_ptr, g_ptr, s_ptr)``: chunk ``c``'s span (``chunk_span``: ``(t, offs, mask, full)``) and the
    addresses of its param (row 0), grad (row 1) and one fp32 state (row 2) rows: the apex optimizers' table."""
    span = chunk_span(c, table[3], table[4], table[2], BLOCK, ALIGNED)
    p_ptr = table_row(table, 0, span[0], P_DTYPE, ALIGNED)
    g_ptr = table_row(table, 1, span[0], G_DTYPE, ALIGNED)
    s_ptr = table_row(table, 2, span[0], tl.float32, ALIGNED)
    return span, p_ptr, g_ptr, s_ptr


@triton.jit
def chunk_rows(table, c, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Chunk ``c``'s span and the addresses of its param, grad and two fp32 state rows (2 and 3)."""
    span, p_ptr, g_ptr, m_ptr = chunk_rows_one_state(table, c, P_DTYPE, G_DTYPE, BLOCK, ALIGNED)
    v_ptr = table_row(table, 3, span[0], tl.float32, ALIGNED)
    return span, p_ptr, g_ptr, m_ptr, v_ptr


@triton.jit
def load_span(ptr, span):
    """``load_chunk`` of the chunk ``span``."""
    return load_chunk(ptr, span[1], span[2], span[3])


@triton.jit
def store_span(ptr, span, value):
    """``store_chunk`` of the chunk ``span``."""
    store_chunk(ptr, span[1], value, span[2], span[3])


@triton.jit
def load_param_moments(p_ptr, m_ptr, v_ptr, span):
    """The chunk's param (widened to fp32) and its two fp32 state values."""
    p = to_fp32(load_span(p_ptr, span))
    m = load_span(m_ptr, span)
    v = load_span(v_ptr, span)
    return p, m, v


@triton.jit
def load_grad(g_ptr, span):
    """The chunk's gradient, widened to fp32 (still scaled)."""
    return to_fp32(load_span(g_ptr, span))


@triton.jit
def store_param(table, span, p_ptr, p, P_DTYPE: tl.constexpr, MODEL_DTYPE: tl.constexpr, HAS_MODEL: tl.constexpr,
                ALIGNED: tl.constexpr):
    """Write the updated param (rounded to its dtype) and, in master-weights mode, the model copy (row 4)."""
    store_span(p_ptr, span, round_to(p, P_DTYPE))
    if HAS_MODEL:
        model_ptr = table_row(table, 4, span[0], MODEL_DTYPE, ALIGNED)
        store_span(model_ptr, span, round_to(p, MODEL_DTYPE))


@triton.jit
def load_param_grad(p_ptr, g_ptr, span, inv_scale):
    """``(p, g)``: the chunk's param widened to fp32 and its gradient widened and unscaled, ``g * inv_scale``."""
    p = to_fp32(load_span(p_ptr, span))
    return p, load_grad(g_ptr, span) * inv_scale


@triton.jit
def hp_neg_lr(hp_ptr, step, STEP: tl.constexpr):
    """``-lr`` (fp32) of an SGD/Adagrad/NovoGrad pass: ``-hp[0]`` of the host-built vector, or in a device step the
    float64 ``lr`` of the step bundle (``step_lr64``: the host number, or the tensor ``lr`` with ``LR_TENSOR``)
    rounded once."""
    if STEP.HP_DEVICE:  # noqa: SIM108  (a compile-time branch: the other side's arguments are placeholders)
        neg_lr = -step_lr64(step, STEP.LR_TENSOR).to(tl.float32)
    else:
        neg_lr = -tl.load(hp_ptr).to(tl.float32)
    return neg_lr


@triton.jit
def hp_value(hp_ptr, step, i: tl.constexpr, STEP: tl.constexpr):
    """Hyper-parameter ``i`` of an SGD/Adagrad/NovoGrad pass as fp32: ``hp[i]`` of the host-built vector, or in a
    device step the step bundle's host number ``i`` (the launcher lists them in the vector's order;
    ``step_host64``: ``hi + mid + lo`` in float64) rounded once, as the host vector's entry was (so both steps are
    bit for bit the same)."""
    if STEP.HP_DEVICE:  # noqa: SIM108  (a compile-time branch)
        x = step_host64(step, i).to(tl.float32)
    else:
        x = tl.load(hp_ptr + i).to(tl.float32)
    return x


@triton.jit
def hp_inv_scale(hp_ptr, i, step, STEP: tl.constexpr):
    """``1 / scale`` (fp32) of an SGD/Adagrad/NovoGrad pass: ``hp[i]`` (the vector's last entry), or in a device
    step ``step_inv_scale64`` (the GradScaler's scale read on the device; 1 without ``HAS_SCALE``) rounded once."""
    if STEP.HP_DEVICE:
        inv_scale = step_inv_scale64(step, STEP.HAS_SCALE).to(tl.float32)
    else:
        inv_scale = tl.load(hp_ptr + i).to(tl.float32)
    return inv_scale
