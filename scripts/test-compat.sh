#!/usr/bin/env bash
# Run the whole test suite on one torch + triton pair, in a venv of its own.
#
#   bash scripts/test-compat.sh TORCH_VERSION TRITON_VERSION [pytest arguments...]
#   bash scripts/test-compat.sh 2.11.0 3.6.0          # the oldest supported pair (docs/compat.md)
#   bash scripts/test-compat.sh 2.13.0 3.9.0 tests/kernels
#
# Builds (or reuses) .venv-compat-<torch>-<triton> (gitignored) with exactly those two versions, fp16kit (editable)
# and its testing/demo extras, then runs pytest with TRITON_INTERPRET=1 (Triton kernels on CPU tensors). torch
# builds on PyPI other than the local CPU wheel are CUDA builds (several GB); they run on a CPU as well.
# The versions are pip constraints: a pair outside pyproject.toml's bounds fails to install (that is the answer).
# Set FP16KIT_COMPAT_ANY=1 to install such a pair anyway (fp16kit then warns once at import).
# PYTHON picks the interpreter that makes the venv (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
TORCH_VERSION=$1
TRITON_VERSION=$2
shift 2
PY=${PYTHON:-python3}
VENV=.venv-compat-$TORCH_VERSION-$TRITON_VERSION
if [ ! -x "$VENV/bin/python" ]; then
  echo "[compat] creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip_i() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" || true; }
pins="$VENV/pins.txt"
printf 'torch==%s\ntriton==%s\n' "$TORCH_VERSION" "$TRITON_VERSION" > "$pins"
stamp="$VENV/.installed-$(cat pyproject.toml "$pins" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  echo "[compat] installing torch==$TORCH_VERSION triton==$TRITON_VERSION and fp16kit (a CUDA build of torch: GBs, once)"
  pip_i -c "$pins" "torch==$TORCH_VERSION" "triton==$TRITON_VERSION"
  if [ "${FP16KIT_COMPAT_ANY:-0}" = 1 ]; then
    pip_i -c "$pins" -e . --no-deps
    pip_i -c "$pins" numpy tqdm hypothesis pytest scikit-learn matplotlib
  else
    pip_i -c "$pins" -e ".[testing,demo]"
  fi
  touch "$stamp"
fi
got=$("$VENV/bin/python" -c "import torch, triton; print(torch.__version__.split('+')[0], triton.__version__)")
if [ "$got" != "$TORCH_VERSION $TRITON_VERSION" ]; then
  echo "[compat] $VENV has torch/triton $got, not $TORCH_VERSION $TRITON_VERSION (the install failed?)" >&2
  exit 1
fi
echo "[compat] $(date -u +%Y-%m-%d) torch $TORCH_VERSION, triton $TRITON_VERSION, $("$VENV/bin/python" -V)"
export TRITON_INTERPRET=1
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${FP16KIT_TEST_WORKERS:-2}" "$@"
