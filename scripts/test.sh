#!/usr/bin/env bash
# Run the whole test suite on this machine (CPU; Triton kernels under TRITON_INTERPRET=1).
# Sets up .venv first if needed (see scripts/setup-venv.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh testing,demo
export TRITON_INTERPRET=1
# Two workers (pytest-xdist), one per core of the 2-core machines the suite is sized for; FP16KIT_TEST_WORKERS=0
# runs in one process (or pass -n 0: later options win).
exec .venv/bin/python -m pytest -q -n "${FP16KIT_TEST_WORKERS:-2}" "$@"
