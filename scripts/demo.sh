#!/usr/bin/env bash
# The main job: train a small byte-level transformer language model on the Python standard library's sources once
# per precision mode (fp32, torch and fp16kit autocast + GradScaler, amp O2, bf16 with fp32 / split / no masters,
# fp32 or 8-bit moments); prints one table and writes one picture (see `python -m fp16kit demo --help`;
# `--task digits` runs the older opt-level demo on scikit-learn's digits). About 45 s of CPU time on one core.
# Sets up .venv first if needed. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh testing,demo
exec .venv/bin/python -m fp16kit demo "$@"
