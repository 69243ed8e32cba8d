#!/usr/bin/env bash
# Run the whole test suite on this machine (CPU; Triton kernels under TRITON_INTERPRET=1).
# Sets up .venv first if needed (see scripts/setup-venv.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh testing,demo
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q "$@"
