#!/usr/bin/env bash
# The GPU suite in one command (docs/benchmarks.md, "GPU"): every target of the optimizer-step issue in one run,
# each step under its own time limit, the limits adding up to at most 8 minutes (480 s: one run and a rerun fit 15
# minutes of device time; checked by tests/test_gpu_suite_script.py):
#   gpu_tests   pytest -m gpu: CUDA-graph capture of every optimizer and of the replayed step in every low-byte mode
#               (split, stochastic, 8-bit moments), the bound launcher bit for bit, compiled steps, no host copies
#   gpu_step    launches and copies per step; host time per step at 200 and 1000 params against torch's fused AdamW,
#               full path / replay / replay + bound launches; graphs; torch.compile; CUDA vs CPU agreement;
#               bandwidth on BERT-large's list (FusedAdam vs torch speed, FusedLAMB / torch time, % of copy)
#   gpu_traffic every weights mode x fp32 / 8-bit moments: time, bytes, GB/s, % of copy, / master mode, / torch
#   bench_kernels  unscale in place against torch's _amp_foreach_non_finite_check_and_unscale_, copy, norms
#   bert_step   the end-to-end BERT-base b32x128 fp16 training step: fp16kit autocast + GradScaler + FusedLAMB
#               against torch.autocast + GradScaler + fused AdamW
#   autocast    the default autocast engine against torch.autocast, forward + backward, BERT-base and small models
# Not in the default (select with STEPS=...): bench_bf16, bench_state8 (CPU-side detail of the low-byte modes;
# their GPU figures are gpu_traffic's), gpu_tune (the launch sweep, tuning: 170 s alone), suite_cpu (the CPU
# suite, which CI runs; 120 s were not enough for it on the last GPU run).
# Results go under $OUT (default: a new temporary folder). Uses the python that has torch (PYTHON=...),
# with this checkout on PYTHONPATH: nothing is installed.
#   bash benchmarks/gpu_suite.sh            # on a machine with a CUDA GPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0
log() { echo "[gpu_suite $(date +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
log "OUT=$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"; } \
  2>&1 | tee -a "$OUT/summary.txt"
STEPS=${STEPS:-gpu_tests gpu_step gpu_traffic bench_kernels bert_step autocast}  # a subset: STEPS="gpu_tests gpu_step"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) log "$name: not selected"; return ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  log "$name: rc=$rc in $((SECONDS - t0)) s; $(tail -n 1 "$OUT/$name.log")"
}
step gpu_tests 140 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
step gpu_step 75 "$PY" benchmarks/gpu_step.py --out "$OUT/gpu_step.md"
step gpu_traffic 100 "$PY" benchmarks/gpu_traffic.py --out "$OUT/gpu_traffic.md"
step bert_step 60 "$PY" benchmarks/gpu_bert_step.py --out "$OUT/bert_step.md"
# issue 23: the default autocast engine vs torch.autocast, forward + backward, BERT-base and the small models
step autocast 70 "$PY" benchmarks/bench_autocast_default.py --device cuda --bert-base --dtype fp16 --iters 10 \
  --repeats 5 --out "$OUT/autocast.md"
step bench_kernels 25 "$PY" benchmarks/bench_kernels.py --out "$OUT/bench_kernels.md"
step bench_bf16 45 "$PY" benchmarks/bench_bf16_modes.py --quick --out "$OUT/bench_bf16_modes.md"
step bench_state8 30 "$PY" benchmarks/bench_state8.py --quick --out "$OUT/bench_state8.md"
step gpu_tune 170 "$PY" benchmarks/gpu_tune.py --budget 140 --out "$OUT/gpu_tune.md"
# The whole suite: CPU tests under the interpreter, GPU tests compiled (the interpreter is process-wide, so two runs).
step suite_cpu 120 env TRITON_INTERPRET=1 "$PY" -m pytest -q -n 14 -p no:cacheprovider tests -m "not gpu and not slow"
log "done"
