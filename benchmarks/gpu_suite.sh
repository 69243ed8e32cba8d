#!/usr/bin/env bash
# The GPU suite in one command (docs/benchmarks.md, "GPU"): pytest -m gpu, the optimizer-step checks and
# benchmarks (launches, copies, host time, CUDA graphs, torch.compile, bandwidth), the default autocast engine on
# BERT-base (issue 23), the kernel benchmarks, the bf16 weight modes and 8-bit moments (issue 26) and the whole test
# suite, each under its own time limit: at most 8 minutes together (the limits add up to 480 s; the last
# H200 run's steps took 28-82 s each), so one run and a rerun fit 15 minutes of device time. The launch-configuration
# sweep is tuning, not a check: STEPS=gpu_tune runs it alone (170 s).
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
STEPS=${STEPS:-gpu_tests gpu_step autocast bench_kernels bench_bf16 bench_state8 suite_cpu}  # a subset: STEPS="gpu_tests gpu_step"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) log "$name: not selected"; return ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  log "$name: rc=$rc in $((SECONDS - t0)) s; $(tail -n 1 "$OUT/$name.log")"
}
step gpu_tests 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests
step gpu_step 60 "$PY" benchmarks/gpu_step.py --out "$OUT/gpu_step.md"
# issue 23: the default autocast engine vs torch.autocast, forward + backward, BERT-base and the small models
step autocast 75 "$PY" benchmarks/bench_autocast_default.py --device cuda --bert-base --dtype fp16 --iters 10 \
  --repeats 5 --out "$OUT/autocast.md"
step bench_kernels 30 "$PY" benchmarks/bench_kernels.py --out "$OUT/bench_kernels.md"
step bench_bf16 45 "$PY" benchmarks/bench_bf16_modes.py --quick --out "$OUT/bench_bf16_modes.md"
step bench_state8 30 "$PY" benchmarks/bench_state8.py --quick --out "$OUT/bench_state8.md"
step gpu_tune 170 "$PY" benchmarks/gpu_tune.py --budget 140 --out "$OUT/gpu_tune.md"
# The whole suite: CPU tests under the interpreter, GPU tests compiled (the interpreter is process-wide, so two runs).
step suite_cpu 120 env TRITON_INTERPRET=1 "$PY" -m pytest -q -n 14 -p no:cacheprovider tests -m "not gpu and not slow"
log "done"
