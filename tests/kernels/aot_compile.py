"""Compile every fp16kit Triton kernel for a CUDA GPU target without a GPU (run by test_gpu_compile.py).

Triton compiles to PTX and a cubin with its bundled ptxas, no device needed. Must run with
TRITON_INTERPRET=0 (interpreter mode replaces jitted functions). Prints one JSON object: for each case,
either {"ok": true, "v4_loads": n, "v4_stores": n} or {"ok": false, "error": "..."}.
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

from fp16kit.kernels import adam_kernel, copy_kernel, l2norm_kernel, lamb_kernel, unscale_kernel

INT_ARGS = {"num_tensors", "num_chunks"}
I64_PTRS = {"ptrs", "numels", "chunk_start", "counts_ptr", "first_ptr"}
I32_PTRS = {"chunk_tensor"}


def signature(fn, constexprs, overrides=None):
    sig = {}
    for p in fn.params:
        if overrides and p.name in overrides:
            sig[p.name] = overrides[p.name]
        elif p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in INT_ARGS:
            sig[p.name] = "i32"
        elif p.name in I64_PTRS:
            sig[p.name] = "*i64"
        elif p.name in I32_PTRS:
            sig[p.name] = "*i32"
        else:
            sig[p.name] = "*fp32"
    missing = {p.name for p in fn.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"constexprs missing: {missing}"
    return sig


F16, BF16, F32 = tl.float16, tl.bfloat16, tl.float32
#: the launchers' real pointer types where they are not fp32: the scale is a float64 scalar for Python floats,
#: and norm partials are float64 (docs/kernels.md, "Norm range").
F64_SCALE = {"inv_scale_ptr": "*fp64", "pre_scale_ptr": "*fp64"}
F64_PARTIALS = {"partials_ptr": "*fp64", "out_ptr": "*fp64"}
CASES = {
    "unscale fp32 in place, aligned": (unscale_kernel._unscale_kernel,
                                       dict(IN_DTYPE=F32, OUT_DTYPE=F32, WITH_NORM=False, BLOCK=4096, ALIGNED=True)),
    "unscale fp16->fp32 +norm, aligned": (unscale_kernel._unscale_kernel,
                                          dict(IN_DTYPE=F16, OUT_DTYPE=F32, WITH_NORM=True, BLOCK=4096, ALIGNED=True),
                                          {**F64_SCALE, **F64_PARTIALS}),
    "unscale fp32->bf16, unaligned": (unscale_kernel._unscale_kernel,
                                      dict(IN_DTYPE=F32, OUT_DTYPE=BF16, WITH_NORM=False, BLOCK=4096, ALIGNED=False)),
    "copy fp32->fp16, aligned": (copy_kernel._copy_kernel,
                                 dict(SRC_DTYPE=F32, DST_DTYPE=F16, BLOCK=4096, ALIGNED=True)),
    "copy bf16->bf16, unaligned": (copy_kernel._copy_kernel,
                                   dict(SRC_DTYPE=BF16, DST_DTYPE=BF16, BLOCK=4096, ALIGNED=False)),
    "sumsq bf16 +check, aligned": (l2norm_kernel._sumsq_kernel,
                                   dict(IN_DTYPE=BF16, CHECK=True, BLOCK=4096, ALIGNED=True),
                                   {**F64_SCALE, **F64_PARTIALS}),
    "segment sums": (l2norm_kernel._segment_sum_kernel, dict(BLOCK=1024)),
    "segment sums fp64": (l2norm_kernel._segment_sum_kernel, dict(BLOCK=1024), F64_PARTIALS),
    "lamb stage 1 (fp16 params, L2)": (
        lamb_kernel._lamb_stage1_kernel,
        dict(P_DTYPE=F16, G_DTYPE=F16, L2_MODE=True, DECOUPLED=False, BLOCK=4096, ALIGNED=True)),
    "lamb stage 2 (fp32 masters -> bf16 model)": (
        lamb_kernel._lamb_stage2_kernel,
        dict(P_DTYPE=F32, MODEL_DTYPE=BF16, HAS_MODEL=True, DECOUPLED=True, TRUST=True, BLOCK=4096, ALIGNED=True)),
    "adam (fp32 masters -> fp16 model)": (
        adam_kernel._adam_kernel,
        dict(P_DTYPE=F32, G_DTYPE=F16, MODEL_DTYPE=F16, HAS_MODEL=True, L2_MODE=False, DECOUPLED=True, BLOCK=4096,
             ALIGNED=True)),
}


def main() -> None:
    target = GPUTarget("cuda", int(sys.argv[1]) if len(sys.argv) > 1 else 90, 32)
    out = {}
    for name, (fn, constexprs, *overrides) in CASES.items():
        try:
            src = ASTSource(fn=fn, signature=signature(fn, constexprs, *overrides), constexprs=constexprs)
            ptx = triton.compile(src, target=target, options={"num_warps": 8}).asm["ptx"]
            out[name] = {
                "ok": True,
                "v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
                "v4_stores": len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
            }
        except Exception as err:  # report every failing kernel, not only the first
            out[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
