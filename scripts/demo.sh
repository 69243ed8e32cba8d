#!/usr/bin/env bash
# The main job: train a small model at every opt level and plot it (see `python -m fp16kit demo --help`).
# Sets up .venv first if needed. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh testing,demo
exec .venv/bin/python -m fp16kit demo "$@"
