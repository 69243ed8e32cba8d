#!/usr/bin/env bash
# Create (or reuse) .venv with a CPU build of torch, triton and fp16kit with its extras.
# Safe to run twice: it installs only what is missing. Never pulls a CUDA build of torch:
# torch is pinned to the CPU wheel and installed before anything that depends on it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FP16KIT_VENV:-.venv}
# The newest tested pair (docs/compat.md): torch's local CPU wheel and the Triton pinned here, never "the newest".
TORCH_VERSION=${FP16KIT_TORCH:-2.13.0}
TRITON_VERSION=${FP16KIT_TRITON:-3.9.0}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# pip, quiet, with its "is ignored" noise filtered out; returns pip's own exit status (the filter's is not
# the answer: grep exits 1 when it has nothing to print), so a failed install stops the script (set -e)
# before the done-stamp below is written.
pip_q() {
  local status
  set +e +o pipefail
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored"
  status=${PIPESTATUS[0]}
  set -e -o pipefail
  return "$status"
}
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU wheel)"
  pip_q "torch==$TORCH_VERSION"
fi
extras=${1:-testing,demo}
pins="$VENV/pins.txt"
printf 'triton==%s\n' "$TRITON_VERSION" > "$pins"
stamp="$VENV/.fp16kit-installed-$extras-$(cat pyproject.toml "$pins" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing fp16kit[$extras] (editable) with triton==$TRITON_VERSION"
  pip_q -c "$pins" -e ".[$extras]"
  "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" \
    || { echo "[setup] torch was changed by a dependency; refusing a non-CPU build" >&2; exit 1; }
  "$VENV/bin/python" -c "import importlib.metadata as m, platform, sys
sys.exit(0 if platform.system() != 'Linux' or m.version('triton') == '$TRITON_VERSION' else 1)" \
    || { echo "[setup] triton is not the pinned $TRITON_VERSION (the install failed?)" >&2; exit 1; }
  touch "$stamp"
fi
