"""Device functions: exact widening to fp32, and round-to-nearest-even narrowing, on every backend.

Compiled Triton on a GPU converts fp32 -> bf16 with round-to-nearest-even, but Triton's interpreter
truncates (docs/specs/kernels.md). Rounding by hand on the bit pattern gives the same bits everywhere,
and the same bits as torch's ``Tensor.to(torch.bfloat16)``:

    bits  = bitcast<uint32>(y)
    bf16  = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16      # ties go to the even mantissa
    NaN   -> 0x7FC0                                          # torch's canonical bf16 NaN

Overflow is handled by the same formula: values past bf16's max finite round up into the exponent
field and become inf, exactly as IEEE rounding requires. fp16 and fp32 outputs use Triton's own cast,
which is round-to-nearest-even in both the compiler and the interpreter.

Widening bf16 -> fp32 is exact in IEEE arithmetic (bf16 is the top half of an fp32), but Triton's
interpreter flushes bf16 subnormals to zero on that conversion; ``to_fp32`` widens bf16 by shifting
the bit pattern, which is exact everywhere and costs nothing on a GPU.
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


@triton.jit
def to_fp32(x):
    """``x`` (fp16, bf16 or fp32) widened to fp32 exactly, subnormals included."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)
