"""Device functions: what every optimizer kernel does around its update rule (apex's ``multi_tensor_*_kernel.cu``
share one load / math / store skeleton the same way).

An optimizer kernel over an address table (rows ``0`` params or fp32 masters, ``1`` grads, then state rows, and
``4`` the low-precision model copy in master-weights mode) is::

    skip, stop = skip_and_stop(found_inf_ptr, num_chunks)       # a set flag: zero iterations, nothing written
    for c in range(pid, stop, tl.num_programs(0)):
        t, offs, mask, full, p_ptr, g_ptr, m_ptr, v_ptr = chunk_rows(...)
        p, m, v = load_param_moments(p_ptr, m_ptr, v_ptr, offs, mask, full)
        g = load_grad(g_ptr, offs, mask, full)
        ... the update rule ...
        store_param(..., p, ...)                                 # the param and, with masters, the model copy
                                                                 # (Adam/LAMB: _bf16_weights.store_weights)
    if not skip:
        advance_step(...)                                        # fp16kit/kernels/engine/step_scalars.py

apex's optimizers (``triton/sgd.py``, ``triton/adagrad.py``, ``triton/novograd.py``) have one state row: rows ``0``
params, ``1`` grads, ``2`` the state (momentum buffer, sum of squares, exp_avg), ``3`` the model copy. Their
hyper-parameters are a host-built float32 vector ``hp = [lr, ..., inv_scale]`` or, in a device step (``HP_DEVICE``),
launch arguments; their pass starts and ends in ``engine/results.py`` (the result check needs a ``VERIFY`` twin of the
store)::

    neg_lr = hp_neg_lr(hp_ptr, lr_ptr, lr_hi, lr_mid, lr_lo, HP_DEVICE, LR_TENSOR)  # -hp[0]
    x = hp_value(hp_ptr, i, x_hi, x_mid, x_lo, HP_DEVICE)                      # hp[i], i = 1, 2, ...
    inv_scale = hp_inv_scale(hp_ptr, last, scale_ptr, HP_DEVICE, HAS_SCALE)     # hp[last]
    entry, skip, stop, bad, gbad = pass_start(...)              # results.py: skip_and_stop, or the check pass's flag
    for c in range(pid, stop, tl.num_programs(0)):
        t, offs, mask, full, p_ptr, g_ptr, s_ptr = chunk_rows_one_state(...)
        p, g = load_param_grad(p_ptr, g_ptr, offs, mask, full, inv_scale)
        gbad = check_grad(gbad, g, mask, VERIFY, HP_DEVICE)
        s = load_chunk(s_ptr, offs, mask, full)                # (SGD: only with momentum, after the first use)
        ... the update rule ...
        bad = check_or_store(p, s, p_ptr, s_ptr, row_pointer(ptrs, 3, ...), ...)  # results.py: or store
    pass_end(...)                                              # results.py: finish the check, or advance the step

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
from .step_scalars import inv_scale64, join3, lr64


@triton.jit
def skip_and_stop(found_inf_ptr, num_chunks):
    """``(skip, stop)``: the step is skipped when the flag is set; then the chunk loop runs to 0, not ``num_chunks``."""
    skip = tl.load(found_inf_ptr) != 0
    return skip, tl.where(skip, 0, num_chunks)


@triton.jit
def chunk_rows_one_state(ptrs, num_tensors, numels, chunk_tensor, chunk_start, c, P_DTYPE: tl.constexpr,
                         G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Chunk ``c``'s span (``chunk_span``) and the addresses of its param (row 0), grad (row 1) and one fp32 state
    (row 2) rows: the apex optimizers' table."""
    t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
    p_ptr = row_pointer(ptrs, 0, num_tensors, t, P_DTYPE, ALIGNED)
    g_ptr = row_pointer(ptrs, 1, num_tensors, t, G_DTYPE, ALIGNED)
    s_ptr = row_pointer(ptrs, 2, num_tensors, t, tl.float32, ALIGNED)
    return t, offs, mask, full, p_ptr, g_ptr, s_ptr


@triton.jit
def chunk_rows(ptrs, num_tensors, numels, chunk_tensor, chunk_start, c, P_DTYPE: tl.constexpr,
               G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Chunk ``c``'s span (``chunk_span``) and the addresses of its param, grad and two fp32 state rows (2 and 3)."""
    t, offs, mask, full, p_ptr, g_ptr, m_ptr = chunk_rows_one_state(ptrs, num_tensors, numels, chunk_tensor,
                                                                    chunk_start, c, P_DTYPE, G_DTYPE, BLOCK, ALIGNED)
    v_ptr = row_pointer(ptrs, 3, num_tensors, t, tl.float32, ALIGNED)
    return t, offs, mask, full, p_ptr, g_ptr, m_ptr, v_ptr


@triton.jit
def load_param_moments(p_ptr, m_ptr, v_ptr, offs, mask, full):
    """The chunk's param (widened to fp32) and its two fp32 state values."""
    p = to_fp32(load_chunk(p_ptr, offs, mask, full))
    m = load_chunk(m_ptr, offs, mask, full)
    v = load_chunk(v_ptr, offs, mask, full)
    return p, m, v


@triton.jit
def load_grad(g_ptr, offs, mask, full):
    """The chunk's gradient, widened to fp32 (still scaled)."""
    return to_fp32(load_chunk(g_ptr, offs, mask, full))


@triton.jit
def store_param(ptrs, num_tensors, t, p_ptr, offs, mask, full, p, P_DTYPE: tl.constexpr, MODEL_DTYPE: tl.constexpr,
                HAS_MODEL: tl.constexpr, ALIGNED: tl.constexpr):
    """Write the updated param (rounded to its dtype) and, in master-weights mode, the model copy (row 4)."""
    store_chunk(p_ptr, offs, round_to(p, P_DTYPE), mask, full)
    if HAS_MODEL:
        model_ptr = row_pointer(ptrs, 4, num_tensors, t, MODEL_DTYPE, ALIGNED)
        store_chunk(model_ptr, offs, round_to(p, MODEL_DTYPE), mask, full)


@triton.jit
def load_param_grad(p_ptr, g_ptr, offs, mask, full, inv_scale):
    """``(p, g)``: the chunk's param widened to fp32 and its gradient widened and unscaled, ``g * inv_scale``."""
    p = to_fp32(load_chunk(p_ptr, offs, mask, full))
    return p, load_grad(g_ptr, offs, mask, full) * inv_scale


@triton.jit
def hp_neg_lr(hp_ptr, lr_ptr, lr_hi, lr_mid, lr_lo, HP_DEVICE: tl.constexpr, LR_TENSOR: tl.constexpr):
    """``-lr`` (fp32) of an SGD/Adagrad/NovoGrad pass: ``-hp[0]`` of the host-built vector, or in a device step the
    float64 ``lr`` (``lr64``: the launch argument, or the tensor ``lr`` with ``LR_TENSOR``) rounded once."""
    if HP_DEVICE:  # a compile-time branch: the other side's arguments are placeholders
        neg_lr = -lr64(lr_hi, lr_mid, lr_lo, lr_ptr, LR_TENSOR).to(tl.float32)
    else:
        neg_lr = -tl.load(hp_ptr).to(tl.float32)
    return neg_lr


@triton.jit
def hp_value(hp_ptr, i, hi, mid, lo, HP_DEVICE: tl.constexpr):
    """Hyper-parameter ``i`` of an SGD/Adagrad/NovoGrad pass as fp32: ``hp[i]`` of the host-built vector, or in a
    device step the float64 launch argument ``hi + mid + lo`` (``split3``/``join3``) rounded once, as the host
    vector's entry was (so both steps are bit for bit the same)."""
    if HP_DEVICE:  # noqa: SIM108  (a compile-time branch)
        x = join3(hi, mid, lo).to(tl.float32)
    else:
        x = tl.load(hp_ptr + i).to(tl.float32)
    return x


@triton.jit
def hp_inv_scale(hp_ptr, i, scale_ptr, HP_DEVICE: tl.constexpr, HAS_SCALE: tl.constexpr):
    """``1 / scale`` (fp32) of an SGD/Adagrad/NovoGrad pass: ``hp[i]`` (the vector's last entry), or in a device
    step ``inv_scale64`` (the GradScaler's scale read on the device; 1 without ``HAS_SCALE``) rounded once."""
    if HP_DEVICE:  # noqa: SIM108  (a compile-time branch)
        inv_scale = inv_scale64(scale_ptr, HAS_SCALE).to(tl.float32)
    else:
        inv_scale = tl.load(hp_ptr + i).to(tl.float32)
    return inv_scale
