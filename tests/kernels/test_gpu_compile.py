"""Every Triton kernel compiles for an H100 (sm_90) without a GPU, and the aligned paths vectorize.

Triton compiles to PTX and a cubin with its bundled ptxas; no device is needed. This is the CI guard for
code that otherwise only runs in the interpreter here: a kernel that the interpreter accepts but the
compiler rejects fails this test. On full chunks of 16-byte-aligned tables, the unscale, copy and
norm kernels must use 16-byte vector loads (``ld.global.v4``), the precondition for reaching the memory
roofline; without that the compiler emits one scalar load per element. The LAMB and Adam kernels are held to
the same standard.

Each kernel is compiled with the options its launcher pins (``LAUNCH`` in its module), with Triton's default
FMA contraction switched ON in the environment, so a launcher that forgot to pin ``enable_fp_fusion`` shows up
as FMAs here. The PTX must have no ``.ftz``, no ``.approx`` and no ``div.full`` (IEEE results, subnormals kept),
the FMA count per kernel is fixed (a change must be deliberate: update ``FMA`` below and say why), and
``ptxas -v`` must report no spills and at most 128 registers at the launch's ``num_warps`` (docs/kernels.md,
"GPU readiness").
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("aot_compile.py")


@pytest.fixture(scope="module")
def compiled() -> dict:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton with its NVIDIA backend is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), "90"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_kernel_compiles_for_sm90(compiled):
    failed = {name: r["error"] for name, r in compiled.items() if not r["ok"]}
    assert not failed, failed
    assert len(compiled) == len(FMA)


#: FMA instructions per kernel in the sm_90 PTX. Every launcher pins ``enable_fp_fusion=False`` (bit-identical
#: results to the interpreter, the torch fallback and the float64 reference; the kernels are memory-bound), so
#: every count is 0. Before pinning (Triton's default, contraction on), e.g. Adam had 64-80, LAMB stage 1 64,
#: stage 2 32, SGD 64, Adagrad/NovoGrad 48, the norm paths 8 each.
FMA = {
    "unscale fp32 in place, aligned": 0,
    "unscale fp16->fp32 +norm, aligned": 0,
    "unscale fp32->bf16, unaligned": 0,
    "copy fp32->fp16, aligned": 0,
    "copy bf16->bf16, unaligned": 0,
    "sumsq bf16 +check, aligned": 0,
    "segment sums": 0,
    "segment sums fp64": 0,
    "lamb stage 1 (fp16 params, L2)": 0,
    "lamb stage 2 (fp32 masters -> bf16 model)": 0,
    "adam (fp32 masters -> fp16 model)": 0,
    "adam (fp16 params, L2)": 0,
    "lamb stage 1 (fp32 masters, fp16 grads, decoupled)": 0,
    "sgd (fp32 masters -> fp16 model, nesterov)": 0,
    "adagrad (fp32 masters -> bf16 model, decoupled)": 0,
    "novograd (fp32 masters -> fp16 model)": 0,
    "novograd absmax bf16": 0,
    "exponent histogram fp32": 0,
    "exponent histogram fp16": 0,
    "exponent histogram bf16": 0,
    # the device-resident step (fp16kit/kernels/engine/step_scalars.py): float64 scalar math, no contraction either
    "step check fp16, finished on the device": 0,
    "lamb stage 1 on the device (fp32, decoupled)": 0,
    "lamb stage 2 on the device (fp32 masters -> fp16 model)": 0,
    "adam on the device (fp32)": 0,
    "sgd check-and-verify on the device (fp16 grads, tensor lr)": 0,
    "adagrad update on the device (fp32)": 0,
    "novograd update on the device (fp32 masters -> bf16 model)": 0,
    "novograd norms, moments, denominators on the device": 0,
    # the bf16 write epilogues (fp16kit/kernels/bf16_weights/modes.py): integer bit arithmetic and Philox, no FMA
    "adam on the device, bf16 split": 0,
    "adam on the device, bf16 stochastic": 0,
    "lamb stage 1 on the device, bf16 split": 0,
    "lamb stage 2 on the device, bf16 split": 0,
    "lamb stage 2 on the device, bf16 stochastic": 0,
    "lamb stage 2, bf16 stochastic with the row table": 0,
    # 8-bit moments (state_bits=8): the QSTATE epilogue
    "adam 8-bit moments on the device (fp32)": 0,
    "adam 8-bit moments (fp32 masters -> bf16 model)": 0,
    "lamb stage 1 8-bit moments on the device (fp32, decoupled)": 0,
    "lamb stage 2 8-bit moments on the device (fp32 masters -> fp16 model)": 0,
}
MAX_REGISTERS = 128
#: Kernels over the register budget on an older (still supported) Triton, with the reason. Triton 3.6 (the GPU
#: images' pair, docs/compat.md) allocates about twice the registers of 3.9 throughout; this one goes past 128.
OVER_BUDGET_BEFORE_TRITON_3_7 = {"lamb stage 2 (fp32 masters -> bf16 model)": "232 registers, no spills, on Triton 3.6"}
#: Kernels that spill on an older Triton, with the reason (a slower kernel there, not a wrong one; none on 3.9).
SPILLS_BEFORE_TRITON_3_7 = {
    "lamb stage 2 on the device, bf16 stochastic": "4 spill stores / 4 spill loads at 8 warps on Triton 3.6 (the "
                                                   "Philox rounds' registers); 0 on Triton 3.9",
    "lamb stage 2, bf16 stochastic with the row table": "the same Philox epilogue as the device-step case above "
                                                        "(not measured on Triton 3.6); 0 on Triton 3.9",
}


def _old_triton() -> bool:
    from fp16kit import _versions

    got = _versions.parse(_versions.installed_version("triton") or "")
    return got is not None and got < (3, 7)


@pytest.mark.parametrize("case", sorted(FMA))
def test_ptx_is_ieee_with_a_fixed_fma_count(compiled, case):
    result = compiled[case]
    assert (result["ftz"], result["approx"], result["div_full"]) == (0, 0, 0), result
    assert result["fma"] == FMA[case], f"{case}: {result['fma']} FMA instructions, recorded {FMA[case]}"


@pytest.mark.parametrize("case", sorted(FMA))
def test_ptxas_no_spills_and_at_most_128_registers(compiled, case):
    result = compiled[case]
    assert result["registers"] > 0, f"ptxas -v output not understood: {result}"
    if case in SPILLS_BEFORE_TRITON_3_7 and _old_triton() and (result["spill_stores"], result["spill_loads"]) != (0, 0):
        pytest.xfail(SPILLS_BEFORE_TRITON_3_7[case])
    assert (result["spill_stores"], result["spill_loads"]) == (0, 0), result
    if case in OVER_BUDGET_BEFORE_TRITON_3_7 and _old_triton() and result["registers"] > MAX_REGISTERS:
        pytest.xfail(OVER_BUDGET_BEFORE_TRITON_3_7[case])
    assert result["registers"] <= MAX_REGISTERS, result


@pytest.mark.parametrize(
    "case,loads,stores",
    [
        ("unscale fp32 in place, aligned", True, True),
        ("unscale fp16->fp32 +norm, aligned", True, True),
        ("copy fp32->fp16, aligned", True, True),
        ("sumsq bf16 +check, aligned", True, False),
        ("lamb stage 1 (fp16 params, L2)", True, True),
        ("lamb stage 2 (fp32 masters -> bf16 model)", True, True),
        ("adam (fp32 masters -> fp16 model)", True, True),
    ],
)
def test_aligned_full_chunks_use_vector_memory_ops(compiled, case, loads, stores):
    result = compiled[case]
    assert (result["v4_loads"] > 0) == loads, result
    assert (result["v4_stores"] > 0) == stores, result


def test_unaligned_tables_do_not_claim_alignment(compiled):
    # Without the alignment promise the compiler must not emit 16-byte accesses (they would fault).
    for case in ("unscale fp32->bf16, unaligned", "copy bf16->bf16, unaligned"):
        assert compiled[case]["v4_loads"] == 0 and compiled[case]["v4_stores"] == 0
