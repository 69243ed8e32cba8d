"""Device functions: where chunk ``c`` of an address table lies, and loads/stores that vectorize.

A masked load with an arbitrary bound (``offs < numel``) cannot be vectorized: the compiler must treat
every element's mask separately. So a chunk that lies wholly inside its tensor (``full``, all but the
last chunk of each tensor) is loaded and stored without a mask; only the tail chunk is masked. When the
launcher has checked that every address in the table is 16-byte aligned (``ALIGNED``), the pointers and
the chunk start (a multiple of ``BLOCK``) carry alignment hints, and full chunks compile to 16-byte vector
loads and stores (checked by ``tests/kernels/test_gpu_compile.py`` on the generated PTX).
"""

import triton
import triton.language as tl

from fp16kit._versions import patch_triton_interpreter

patch_triton_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4 (every kernel imports this module)


@triton.jit
def chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """``(t, offs, mask, full)``: chunk ``c`` covers ``offs`` (``BLOCK`` element offsets) of tensor ``t``;
    ``mask`` is false past the tensor's end; ``full`` says the whole chunk is inside the tensor."""
    t = tl.load(chunk_tensor + c)
    start = tl.load(chunk_start + c)
    if ALIGNED:
        start = tl.multiple_of(start, BLOCK)
    offs = start + tl.arange(0, BLOCK)
    n = tl.load(numels + t)
    return t, offs, offs < n, start + BLOCK <= n


@triton.jit
def row_pointer(ptrs, row, num_tensors, t, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The address of tensor ``t`` in table row ``row``, typed as a ``DTYPE`` pointer."""
    p = tl.load(ptrs + row * num_tensors + t).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def load_chunk(ptr, offs, mask, full):
    """The chunk's elements (0 past the tensor's end); unmasked, so vectorizable, for a full chunk."""
    # A real branch, not a conditional expression: both loads must not be issued for a tail chunk.
    if full:  # noqa: SIM108
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def store_chunk(ptr, offs, value, mask, full):
    """Store the chunk's elements (none past the tensor's end); unmasked for a full chunk."""
    if full:
        tl.store(ptr + offs, value)
    else:
        tl.store(ptr + offs, value, mask=mask)
