"""Device function: round fp32 values to the output dtype, round-to-nearest-even on every backend.

Compiled Triton on a GPU converts fp32 -> bf16 with round-to-nearest-even, but Triton's interpreter
truncates (specs/kernels.md). Rounding by hand on the bit pattern gives the same bits everywhere,
and the same bits as torch's ``Tensor.to(torch.bfloat16)``:

    bits  = bitcast<uint32>(y)
    bf16  = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16      # ties go to the even mantissa
    NaN   -> 0x7FC0                                          # torch's canonical bf16 NaN

Overflow is handled by the same formula: values past bf16's max finite round up into the exponent
field and become inf, exactly as IEEE rounding requires. fp16 and fp32 outputs use Triton's own cast,
which is round-to-nearest-even in both the compiler and the interpreter.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(y, OUT_DTYPE: tl.constexpr):
    """``y`` (fp32) rounded to ``OUT_DTYPE`` with round-to-nearest-even."""
    if tl.bfloat16 == OUT_DTYPE:
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(OUT_DTYPE)
