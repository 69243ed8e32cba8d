"""Device function: where chunk ``c`` of an address table lies (see ``_table.py`` for the layout)."""

import triton
import triton.language as tl


@triton.jit
def chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK: tl.constexpr):
    """``(t, offs, mask)``: chunk ``c`` covers ``offs`` (``BLOCK`` element offsets) of tensor ``t``;
    ``mask`` is false past the tensor's end."""
    t = tl.load(chunk_tensor + c)
    offs = tl.load(chunk_start + c) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    return t, offs, mask
