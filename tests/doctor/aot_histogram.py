"""Compile the exponent-histogram kernel for a CUDA GPU target without a GPU (run by test_histogram_compile.py).

Must run with TRITON_INTERPRET=0. Prints one JSON object: per case {"ok": true, "v4_loads": n, "atomics": n}
or {"ok": false, "error": "..."}; ``atomics`` counts 64-bit atomic adds in the PTX.
"""

import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp16kit.kernels.engine.histogram_bins import _FORMATS
from fp16kit.kernels.histogram import MIN_EXP, NUM_BINS, ZERO_BIN
from fp16kit.kernels.triton import histogram as hk

SIGNATURE = {"ptrs": "*i64", "numels": "*i64", "chunk_tensor": "*i64", "chunk_start": "*i64", "num_chunks": "i32",
             "rows_ptr": "*i64", "out_ptr": "*i64"}


def constexprs(dtype, aligned):
    import torch

    int_dtype, exp_bits, mant_bits, bias = _FORMATS[dtype]
    return dict(INT_DTYPE=tl.int16 if int_dtype == torch.int16 else tl.int32,
                WIDTH=16 if int_dtype == torch.int16 else 32, EXP_BITS=exp_bits, MANT_BITS=mant_bits, BIAS=bias,
                MIN_EXP=MIN_EXP, ZERO_BIN=ZERO_BIN, NUM_BINS=NUM_BINS, PADDED_BINS=hk._PADDED_BINS, BLOCK=4096,
                ALIGNED=aligned)


def main() -> None:
    import torch

    target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
    out = {}
    for dtype, aligned in ((torch.float16, True), (torch.bfloat16, False), (torch.float32, True)):
        name = f"{dtype} {'aligned' if aligned else 'unaligned'}"
        consts = constexprs(dtype, aligned)
        sig = {**SIGNATURE, **{k: "constexpr" for k in consts}}
        try:
            src = ASTSource(fn=hk._histogram_kernel, signature=sig, constexprs=consts)
            ptx = triton.compile(src, target=target, options={"num_warps": 8}).asm["ptx"]
            out[name] = {
                "ok": True,
                "v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
                "atomics": len(re.findall(r"(?:atom|red)\.global(?:\.\w+)*\.add\.[us]64", ptx)),
            }
        except Exception as err:  # report every failing case
            out[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
