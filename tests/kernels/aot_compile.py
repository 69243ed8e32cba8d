"""Compile every fp16kit Triton kernel for a CUDA GPU target without a GPU (run by test_gpu_compile.py).

Triton compiles to PTX and a cubin with its bundled ptxas, no device needed. Must run with
TRITON_INTERPRET=0 (interpreter mode replaces jitted functions). Each kernel is compiled with its module's
``LAUNCH`` options (``num_warps``, ``enable_fp_fusion``): the ones its launcher passes, so the PTX is the
PTX a GPU would run. Prints one JSON object: for each case, either {"ok": false, "error": "..."} or
{"ok": true, "v4_loads": n, "v4_stores": n, "fma": n, "ftz": n, "approx": n, "div_full": n, "registers": n,
"spill_stores": n, "spill_loads": n, "num_warps": n} where ``fma`` counts ``fma`` instructions in the PTX and
the register/spill figures are ``ptxas -v``'s (Triton's bundled ptxas, run again on the PTX with the flags
Triton uses).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp16kit.kernels.bf16_weights.modes import Epilogue
from fp16kit.kernels.engine import table as _table
from fp16kit.kernels.engine.chunks import chunk_span, load_chunk, row_pointer, store_chunk
from fp16kit.kernels.engine.step_scalars import StepFlags
from fp16kit.kernels.triton import adagrad as adagrad_kernel
from fp16kit.kernels.triton import adam as adam_kernel
from fp16kit.kernels.triton import copy as copy_kernel
from fp16kit.kernels.triton import histogram as histogram_kernel
from fp16kit.kernels.triton import l2norm as l2norm_kernel
from fp16kit.kernels.triton import lamb as lamb_kernel
from fp16kit.kernels.triton import novograd as novograd_kernel
from fp16kit.kernels.triton import sgd as sgd_kernel
from fp16kit.kernels.triton import unscale as unscale_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "doctor"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import aot_histogram  # (the histogram kernel's signature and constexprs, shared with its own test)

INT_ARGS = {"num_tensors", "num_chunks", "stream"}
#: the bf16 write epilogues (fp16kit/kernels/bf16_weights/modes.py): the 63-bit stochastic-rounding key, the row table
I64_ARGS = {"seed"}
#: Kernels outside the multi-tensor convention (all pointers fp32 unless named): their own signatures.
HISTOGRAM_SIG = {**aot_histogram.SIGNATURE}
I64_PTRS = {"ptrs", "numels", "chunk_start", "counts_ptr", "first_ptr", "row_idx_ptr"}
I32_PTRS = {"chunk_tensor"}
#: the device-resident step's counters (fp16kit/kernels/engine/step_scalars.py)
I32_STEP = {"ticket_ptr", "done_ptr", "bad_ptr"}
I64_STEP = {"chunk_counts", "first_chunk", "count_ptr", "nonfinite_count_ptr", "result_count_ptr", "v_ptrs"}
#: the legacy layout (a float32 hp vector) and the device-derived one
HP_LEGACY = dict(HP_DEVICE=False, LR_TENSOR=False, HAS_SCALE=False, BIAS_CORRECTION=False, ADVANCE=False)
HP_ON_DEVICE = dict(HP_DEVICE=True, LR_TENSOR=False, HAS_SCALE=True, BIAS_CORRECTION=True, ADVANCE=True)
#: the plain write epilogue (no bf16 mode), for the Adam kernel and LAMB stage 2 (stage 1 has WEIGHTS only)
PLAIN = dict(WEIGHTS=0, ROW_IDX=False)
#: the SGD/Adagrad/NovoGrad kernels' device-step switches (fp16kit/kernels/engine/results.py), off
APEX_LEGACY = dict(**HP_LEGACY, OWN_FLAG=False, FIRST=False, COUNT=False)
SUMSQ_PLAIN = dict(FINISH=False, NORM=True, OWN_FLAG=False, COUNT=False, SCALE_IS_GRAD_SCALE=False)


#: The optimizer kernels' argument bundles (tuples; fp16kit/kernels/engine/skeleton.py): their members' names, typed
#: by the rules of :func:`_arg_type`. ``step``: the pointers, then three float32 parts per host number of the
#: kernel's module (its ``HOST``).
BUNDLES = {
    "table": ("ptrs", "num_tensors", "numels", "chunk_tensor", "chunk_start", "num_chunks"),
    "results": ("bad_ptr", "result_ptr", "nonfinite_count_ptr", "result_count_ptr"),
    "weights": ("seed", "stream", "rng_step_ptr", "row_idx_ptr"),
    "state": ("book_ptr",),
    "sums": ("u_partials", "p_partials", "done_ptr", "chunk_counts", "first_chunk", "u_sumsq", "p_sumsq"),
}
STEP_POINTERS = ("step_ptr", "ticket_ptr", "lr_ptr", "scale_ptr")


def _arg_type(name):
    if name in INT_ARGS:
        return "i32"
    if name in I64_ARGS:
        return "i64"
    if name.endswith(("_hi", "_mid", "_lo")) or name == "check_factor":  # float32 launch arguments
        return "fp32"
    if name in I32_STEP:
        return "*i32"
    if name in I64_STEP or name in I64_PTRS:
        return "*i64"
    if name in I32_PTRS:
        return "*i32"
    return "*fp32"


def _bundle_type(fn, name):
    if name == "step":
        host = sys.modules[fn.fn.__module__].HOST
        members = STEP_POINTERS + tuple(f"{h}_{part}" for h in host for part in ("hi", "mid", "lo"))
    else:
        members = BUNDLES[name]
    return tuple(_arg_type(m) for m in members)


#: The kernels' constexpr named tuples (fp16kit/kernels/engine/skeleton.py): the cases here and in the tests name their
#: switches one by one (``HP_DEVICE=True``, ``WEIGHTS=1``), :func:`pack` puts them in their tuple.
GROUPS = {"STEP": StepFlags, "EPILOGUE": Epilogue}


def pack(fn, constexprs):
    """``constexprs`` with the switches of each named tuple the kernel takes (:data:`GROUPS`) packed into it (the
    switches a case does not name keep their defaults, all off)."""
    names = {p.name for p in fn.params}
    out = dict(constexprs)
    for group, cls in GROUPS.items():
        if group in names and group not in out:
            out[group] = cls(**{k: out.pop(k) for k in cls._fields if k in out})
    return out


def signature(fn, constexprs, overrides=None):
    sig = {}
    for p in fn.params:
        if overrides and p.name in overrides:
            sig[p.name] = overrides[p.name]
        elif p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in BUNDLES or p.name == "step":
            sig[p.name] = _bundle_type(fn, p.name)
        else:
            sig[p.name] = _arg_type(p.name)
    missing = {p.name for p in fn.params if p.is_constexpr} - set(constexprs)
    assert not missing, f"constexprs missing: {missing}"
    return sig


F16, BF16, F32 = tl.float16, tl.bfloat16, tl.float32
#: the launchers' real pointer types where they are not fp32: the scale is a float64 scalar for Python floats,
#: and norm partials are float64 (docs/kernels.md, "Norm range").
F64_SCALE = {"inv_scale_ptr": "*fp64", "pre_scale_ptr": "*fp64"}
F64_PARTIALS = {"partials_ptr": "*fp64", "out_ptr": "*fp64"}
#: the optimizer-step kernels are compiled with the chunk size the GPU uses (fp16kit/kernels/engine/table.py)
SB = _table.STEP_BLOCK_GPU


def _rows(p, g, model) -> dict:
    """The row dtypes' constexprs, as the launchers' ``apex_rows`` sets them: ``model`` None is no model copy
    (``MODEL_DTYPE`` then the params')."""
    return dict(P_DTYPE=p, G_DTYPE=g, MODEL_DTYPE=model or p, HAS_MODEL=model is not None)


def adam_case(p, g, model=None, *, l2=False, hp=HP_LEGACY, **extra) -> tuple:
    """An Adam kernel case: L2 mode or decoupled weight decay, the step's hyper-parameters ``hp``, ``extra`` (the
    write epilogue's switches, ``QSTATE``)."""
    return adam_kernel._adam_kernel, dict(**_rows(p, g, model), L2_MODE=l2, DECOUPLED=not l2, BLOCK=SB, ALIGNED=True,
                                          **extra, **hp)


def stage1_case(p, g, *, l2=False, hp=HP_LEGACY, **extra) -> tuple:
    """A LAMB stage-1 case; the per-tensor sums are finished in the launch exactly when the step is on the device
    (``launch_lamb_stage1``)."""
    return lamb_kernel._lamb_stage1_kernel, dict(P_DTYPE=p, G_DTYPE=g, L2_MODE=l2, DECOUPLED=not l2, BLOCK=SB,
                                                 ALIGNED=True, FINISH_SUMS=hp is HP_ON_DEVICE, **extra, **hp)


def stage2_case(p, model=None, *, hp=HP_LEGACY, **extra) -> tuple:
    """A LAMB stage-2 case (decoupled, with the trust ratio)."""
    consts = _rows(p, None, model)
    del consts["G_DTYPE"]
    return lamb_kernel._lamb_stage2_kernel, dict(**consts, DECOUPLED=True, TRUST=True, BLOCK=SB, ALIGNED=True, **extra,
                                                 **hp)


def apex_case(kernel, p, g, model=None, *, verify=False, hp=None, **modes) -> tuple:
    """An SGD/Adagrad/NovoGrad kernel case: its own switches ``modes``, the result check ``verify``, the device
    step's switches off (:data:`APEX_LEGACY`) but for ``hp``."""
    return kernel, dict(**_rows(p, g, model), **modes, VERIFY=verify, BLOCK=4096, ALIGNED=True,
                        **{**APEX_LEGACY, **(hp or {})})


CASES = {
    "unscale fp32 in place, aligned": (unscale_kernel._unscale_kernel,
                                       dict(IN_DTYPE=F32, OUT_DTYPE=F32, WITH_NORM=False, BLOCK=SB, ALIGNED=True)),
    "unscale fp16->fp32 +norm, aligned": (unscale_kernel._unscale_kernel,
                                          dict(IN_DTYPE=F16, OUT_DTYPE=F32, WITH_NORM=True, BLOCK=SB, ALIGNED=True),
                                          {**F64_SCALE, **F64_PARTIALS}),
    "unscale fp32->bf16, unaligned": (unscale_kernel._unscale_kernel,
                                      dict(IN_DTYPE=F32, OUT_DTYPE=BF16, WITH_NORM=False, BLOCK=SB, ALIGNED=False)),
    "copy fp32->fp16, aligned": (copy_kernel._copy_kernel,
                                 dict(SRC_DTYPE=F32, DST_DTYPE=F16, BLOCK=4096, ALIGNED=True)),
    "copy bf16->bf16, unaligned": (copy_kernel._copy_kernel,
                                   dict(SRC_DTYPE=BF16, DST_DTYPE=BF16, BLOCK=4096, ALIGNED=False)),
    "sumsq bf16 +check, aligned": (l2norm_kernel._sumsq_kernel,
                                   dict(IN_DTYPE=BF16, CHECK=True, BLOCK=SB, ALIGNED=True, **SUMSQ_PLAIN),
                                   {**F64_SCALE, **F64_PARTIALS}),
    "step check fp16, finished on the device": (
        l2norm_kernel._sumsq_kernel,
        dict(IN_DTYPE=F16, CHECK=True, BLOCK=SB, ALIGNED=True, FINISH=True, NORM=True, OWN_FLAG=True, COUNT=True,
             SCALE_IS_GRAD_SCALE=True),
        {**F64_PARTIALS}),
    "segment sums": (l2norm_kernel._segment_sum_kernel, {}),
    "segment sums fp64": (l2norm_kernel._segment_sum_kernel, {}, F64_PARTIALS),
    "lamb stage 1 (fp16 params, L2)": stage1_case(F16, F16, l2=True, WEIGHTS=0),
    "lamb stage 1 on the device (fp32, decoupled)": stage1_case(F32, F32, hp=HP_ON_DEVICE, WEIGHTS=0),
    "lamb stage 2 on the device (fp32 masters -> fp16 model)": stage2_case(F32, F16, hp=HP_ON_DEVICE, **PLAIN),
    "adam on the device (fp32)": adam_case(F32, F32, hp=HP_ON_DEVICE, **PLAIN),
    "lamb stage 2 (fp32 masters -> bf16 model)": stage2_case(F32, BF16, **PLAIN),
    "adam (fp32 masters -> fp16 model)": adam_case(F32, F16, F16, **PLAIN),
    "adam (fp16 params, L2)": adam_case(F16, F16, l2=True, **PLAIN),
    "lamb stage 1 (fp32 masters, fp16 grads, decoupled)": stage1_case(F32, F16, WEIGHTS=0),
    # the bf16 write epilogues: split (row 4 the int16 low halves) and stochastic rounding (Philox in registers)
    "adam on the device, bf16 split": adam_case(BF16, BF16, hp=HP_ON_DEVICE, WEIGHTS=1, ROW_IDX=False),
    "adam on the device, bf16 stochastic": adam_case(BF16, BF16, hp=HP_ON_DEVICE, WEIGHTS=2, ROW_IDX=True),
    "lamb stage 1 on the device, bf16 split": stage1_case(BF16, BF16, hp=HP_ON_DEVICE, WEIGHTS=1),
    "lamb stage 2 on the device, bf16 split": stage2_case(BF16, hp=HP_ON_DEVICE, WEIGHTS=1, ROW_IDX=False),
    "lamb stage 2 on the device, bf16 stochastic": stage2_case(BF16, hp=HP_ON_DEVICE, WEIGHTS=2, ROW_IDX=False),
    # FSDP2 shards (the sharded step's host-vector stage 2): the row table (row, first element's index) per tensor
    "lamb stage 2, bf16 stochastic with the row table": stage2_case(BF16, WEIGHTS=2, ROW_IDX=True),
    # 8-bit moments (state_bits=8): the QSTATE epilogue of the same kernels (fp16kit/kernels/state8/triton.py)
    "adam 8-bit moments on the device (fp32)": adam_case(F32, F32, hp=HP_ON_DEVICE, QSTATE=True),
    "adam 8-bit moments (fp32 masters -> bf16 model)": adam_case(F32, BF16, BF16, QSTATE=True, **PLAIN),
    "lamb stage 1 8-bit moments on the device (fp32, decoupled)": stage1_case(F32, F32, hp=HP_ON_DEVICE, QSTATE=True),
    "lamb stage 2 8-bit moments on the device (fp32 masters -> fp16 model)": stage2_case(
        F32, F16, hp=HP_ON_DEVICE, QSTATE=True),
    "sgd (fp32 masters -> fp16 model, nesterov)": apex_case(
        sgd_kernel._sgd_kernel, F32, F16, F16, WD=True, WD_AFTER=False, MOMENTUM=True, NESTEROV=True, FIRST_RUN=False),
    "adagrad (fp32 masters -> bf16 model, decoupled)": apex_case(
        adagrad_kernel._adagrad_kernel, F32, BF16, BF16, L2_MODE=False, DECOUPLED=True),
    "novograd (fp32 masters -> fp16 model)": apex_case(
        novograd_kernel._novograd_kernel, F32, F16, F16, REG_INSIDE=False),
    "sgd check-and-verify on the device (fp16 grads, tensor lr)": apex_case(
        sgd_kernel._sgd_kernel, F32, F16, F16, WD=True, WD_AFTER=False, MOMENTUM=True, NESTEROV=False, FIRST_RUN=False,
        verify=True, hp={**HP_ON_DEVICE, "LR_TENSOR": True, "ADVANCE": False, "OWN_FLAG": True, "FIRST": True,
                         "COUNT": True}),
    "adagrad update on the device (fp32)": apex_case(
        adagrad_kernel._adagrad_kernel, F32, F32, L2_MODE=True, DECOUPLED=False, hp=HP_ON_DEVICE),
    "novograd update on the device (fp32 masters -> bf16 model)": apex_case(
        novograd_kernel._novograd_kernel, F32, BF16, BF16, REG_INSIDE=False, hp=HP_ON_DEVICE),
    "novograd norms, moments, denominators on the device": (
        novograd_kernel._novograd_prepare_kernel,
        dict(LR_TENSOR=False, BIAS_CORRECTION=True, INIT_ZERO=False), {"partials_ptr": "*fp64"}),
    "novograd absmax bf16": (novograd_kernel._absmax_kernel, dict(IN_DTYPE=BF16, BLOCK=4096, ALIGNED=True)),
    **{
        f"exponent histogram {name}": (histogram_kernel._histogram_kernel, consts, HISTOGRAM_SIG)
        for name, consts in (
            ("fp32", aot_histogram.constexprs(torch.float32, True)),
            ("fp16", aot_histogram.constexprs(torch.float16, True)),
            ("bf16", aot_histogram.constexprs(torch.bfloat16, False)),
        )
    },
}

#: PTX that must not appear in any kernel: flush-to-zero, approximate math, and the non-IEEE full-range division.
FORBIDDEN = {"ftz": r"\.ftz\b", "approx": r"\.approx\b", "div_full": r"\bdiv\.full\b"}


def launch_options(fn, constexprs: dict | None = None) -> dict:
    """The options the kernel's launcher passes (its module's ``LAUNCH``; with ``QSTATE``, the ``*_state8`` entry
    where the module has one)."""
    launch = sys.modules[fn.fn.__module__].LAUNCH
    name = fn.fn.__name__
    if constexprs and constexprs.get("QSTATE") and f"{name}_state8" in launch:
        name = f"{name}_state8"
    return dict(launch[name])


def ptxas_usage(ptx: str, arch: int, fp_fusion: bool) -> dict:
    """``ptxas -v``'s register and spill figures for the kernel in ``ptx`` (Triton's bundled ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        cmd = [get_ptxas(arch).path, "-v", *([] if fp_fusion else ["--fmad=false"]), "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o", str(Path(tmp, "k.o"))]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(regs.group(1)) if regs else -1,
        "spill_stores": int(spills.group(1)) if spills else -1,
        "spill_loads": int(spills.group(2)) if spills else -1,
    }


_TL = {"fp32": F32, "fp16": F16, "bf16": BF16}

#: The negative control of the traffic check: a copy that also reads its destination (4 B per element too many),
#: which ``ptx_traffic.analyze`` must report (``tests/kernels/test_kernel_traffic.py``).
CONTROL = "control: fp32 copy that reads its destination"
LAUNCH = {"_control_kernel": {"num_warps": 16, "enable_fp_fusion": False}}


@triton.jit
def _control_kernel(ptrs, num_tensors, numels, chunk_tensor, chunk_start, num_chunks, BLOCK: tl.constexpr,
                    ALIGNED: tl.constexpr):
    for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        src = row_pointer(ptrs, 0, num_tensors, t, tl.float32, ALIGNED)
        dst = row_pointer(ptrs, 1, num_tensors, t, tl.float32, ALIGNED)
        store_chunk(dst, offs, load_chunk(src, offs, mask, full) + load_chunk(dst, offs, mask, full), mask, full)


def traffic_case(v) -> tuple:
    """``(fn, constexprs, overrides)`` of a ``traffic_cases.Variant``: the launcher's constexprs for that variant
    (aligned tables, the GPU chunk size; Adam and LAMB in AdamW form with the trust ratio: the math switches change
    no row a kernel reads or writes)."""
    hp = HP_ON_DEVICE if v.device else HP_LEGACY
    if v.kernel in ("adam", "lamb1", "lamb2"):
        p, g = _TL[v.param_dtype], _TL[v.grad_dtype]
        model = _TL[v.model_dtype] if v.model_dtype else p
        weights = {"split": 1, "stochastic": 2}.get(v.weights, 0)
        common = dict(P_DTYPE=p, DECOUPLED=True, BLOCK=SB, ALIGNED=True, QSTATE=v.bits == 8, **hp)
        if v.kernel == "adam":
            return adam_kernel._adam_kernel, dict(
                G_DTYPE=g, MODEL_DTYPE=model, HAS_MODEL=v.model_dtype is not None, L2_MODE=False, WEIGHTS=weights,
                ROW_IDX=v.row_idx, **common), {}
        if v.kernel == "lamb1":
            return lamb_kernel._lamb_stage1_kernel, dict(
                G_DTYPE=g, L2_MODE=False, WEIGHTS=weights, FINISH_SUMS=v.device, **common), {}
        return lamb_kernel._lamb_stage2_kernel, dict(
            MODEL_DTYPE=model, HAS_MODEL=v.model_dtype is not None, TRUST=True, WEIGHTS=weights, ROW_IDX=v.row_idx,
            **common), {}
    if v.kernel in ("check", "sumsq"):
        consts = dict(IN_DTYPE=_TL[v.weights], CHECK=True, BLOCK=SB, ALIGNED=True, **SUMSQ_PLAIN)
        if v.kernel == "check":
            consts.update(FINISH=True, NORM=v.norm, OWN_FLAG=True, COUNT=True, SCALE_IS_GRAD_SCALE=True)
        return l2norm_kernel._sumsq_kernel, consts, {**F64_SCALE, **F64_PARTIALS}
    if v.kernel == "unscale":
        return unscale_kernel._unscale_kernel, dict(IN_DTYPE=_TL[v.weights], OUT_DTYPE=_TL[v.out or v.weights],
                                                    WITH_NORM=False, BLOCK=SB, ALIGNED=True), {}
    if v.kernel == "copy":
        return copy_kernel._copy_kernel, dict(SRC_DTYPE=_TL[v.weights], DST_DTYPE=_TL[v.out], BLOCK=4096,
                                              ALIGNED=True), {}
    if v.kernel == "absmax":
        return novograd_kernel._absmax_kernel, dict(IN_DTYPE=_TL[v.weights], BLOCK=4096, ALIGNED=True), {}
    p, g = _TL[v.param_dtype], _TL[v.grad_dtype]
    flags = {**APEX_LEGACY, **(HP_ON_DEVICE if v.device else {})}
    if v.device and v.verify:  # the check-and-verify launch of a device step
        flags.update(ADVANCE=False, OWN_FLAG=True, FIRST=True, COUNT=True)
    common = dict(P_DTYPE=p, G_DTYPE=g, MODEL_DTYPE=_TL[v.model_dtype] if v.model_dtype else p,
                  HAS_MODEL=v.model_dtype is not None, VERIFY=v.verify, BLOCK=4096, ALIGNED=True, **flags)
    if v.kernel == "sgd":
        return sgd_kernel._sgd_kernel, dict(WD=True, WD_AFTER=False, MOMENTUM=True, NESTEROV=False, FIRST_RUN=False,
                                            **common), {}
    if v.kernel == "adagrad":
        return adagrad_kernel._adagrad_kernel, dict(L2_MODE=False, DECOUPLED=True, **common), {}
    return novograd_kernel._novograd_kernel, dict(REG_INSIDE=False, **common), {}


def _traffic_one(v, target) -> dict:
    import ptx_traffic

    if v == CONTROL:
        fn, constexprs, overrides = _control_kernel, dict(BLOCK=4096, ALIGNED=True), {}
    else:
        fn, constexprs, overrides = traffic_case(v)
    constexprs = pack(fn, constexprs)
    options = launch_options(fn, constexprs)
    src = ASTSource(fn=fn, signature=signature(fn, constexprs, overrides), constexprs=constexprs)
    ptx = triton.compile(src, target=target, options=options).asm["ptx"]
    block = constexprs.get("BLOCK", 4096)
    t = ptx_traffic.analyze(ptx, block=block, num_warps=options["num_warps"])
    return {
        "ok": True, "min": [t.min_load, t.min_store], "max": [t.max_load, t.max_store], "v4_loads": t.v4_loads,
        "v4_stores": t.v4_stores, "widths": list(t.vector_widths), "data": t.data_accesses,
        "uniform": t.uniform_accesses, "other": t.other_accesses, "num_warps": options["num_warps"], "block": block,
        **ptxas_usage(ptx, target.arch, options["enable_fp_fusion"]),
    }


def traffic(arch: int, names: list[str]) -> dict:
    """The ``traffic`` mode: for each named variant (``traffic_cases.py``), the PTX's bytes per element
    (``ptx_traffic.analyze``) and ``ptxas -v``'s registers and spills, compiled for ``sm_<arch>``."""
    import traffic_cases

    by_name = {v.name: v for v in traffic_cases.all_variants()}
    target = GPUTarget("cuda", arch, 32)
    out = {}
    for name in names:
        try:
            out[name] = _traffic_one(CONTROL if name == CONTROL else by_name[name], target)
        except Exception as err:  # report every failing variant, not only the first
            out[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "traffic":  # traffic ARCH NAME... (names: one per line on stdin if none)
        names = sys.argv[3:] or [line for line in sys.stdin.read().splitlines() if line]
        print(json.dumps(traffic(int(sys.argv[2]), names)))
        return
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", arch, 32)
    out = {}
    for name, (fn, constexprs, *overrides) in CASES.items():
        if any(p.name == "QSTATE" for p in fn.params):  # the Adam/LAMB kernels: fp32 moments unless a case says
            constexprs = {"QSTATE": False, **constexprs}
        # ... and the plain write epilogue unless a case names a bf16 mode (fp16kit/kernels/bf16_weights/modes.py)
        constexprs = pack(fn, {**{k: v for k, v in PLAIN.items() if any(p.name == k for p in fn.params)}, **constexprs})
        try:
            options = launch_options(fn, constexprs)
            src = ASTSource(fn=fn, signature=signature(fn, constexprs, *overrides), constexprs=constexprs)
            ptx = triton.compile(src, target=target, options=options).asm["ptx"]
            code = "\n".join(line.split("//")[0] for line in ptx.splitlines())  # instructions, not comments
            out[name] = {
                "ok": True,
                "v4_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
                "v4_stores": len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
                "fma": len(re.findall(r"^\s*(?:@!?%p\d+\s+)?fma\.", code, re.MULTILINE)),
                **{key: len(re.findall(pattern, code)) for key, pattern in FORBIDDEN.items()},
                **ptxas_usage(ptx, arch, options["enable_fp_fusion"]),
                "num_warps": options["num_warps"],
            }
        except Exception as err:  # report every failing kernel, not only the first
            out[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:2000]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
