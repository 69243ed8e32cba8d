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
        advance_step(...)                                        # fp16kit/kernels/_step_scalars.py

Loads widen exactly to fp32 and stores round to nearest even on every backend (``_rounding.py``); full chunks are
unmasked and vectorize (``_chunks.py``).
"""

import triton
import triton.language as tl

from ._chunks import chunk_span, load_chunk, row_pointer, store_chunk
from ._rounding import round_to, to_fp32


@triton.jit
def skip_and_stop(found_inf_ptr, num_chunks):
    """``(skip, stop)``: the step is skipped when the flag is set; then the chunk loop runs to 0, not ``num_chunks``."""
    skip = tl.load(found_inf_ptr) != 0
    return skip, tl.where(skip, 0, num_chunks)


@triton.jit
def chunk_rows(ptrs, num_tensors, numels, chunk_tensor, chunk_start, c, P_DTYPE: tl.constexpr,
               G_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Chunk ``c``'s span (``chunk_span``) and the addresses of its param, grad and two fp32 state rows."""
    t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
    p_ptr = row_pointer(ptrs, 0, num_tensors, t, P_DTYPE, ALIGNED)
    g_ptr = row_pointer(ptrs, 1, num_tensors, t, G_DTYPE, ALIGNED)
    m_ptr = row_pointer(ptrs, 2, num_tensors, t, tl.float32, ALIGNED)
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
