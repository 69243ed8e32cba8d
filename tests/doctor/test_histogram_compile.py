"""The exponent-histogram kernel compiles for an H100 (sm_90) without a GPU: 16-bit integer loads of the bit
patterns, ``tl.histogram`` with a mask, and 64-bit atomic adds, none of which the interpreter can vouch for.
Aligned full chunks use 16-byte vector loads, unaligned tables must not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("aot_histogram.py")


def test_histogram_kernel_compiles_for_sm90():
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton with its NVIDIA backend is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), "90"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(cases) == 3 and all(c["ok"] for c in cases.values()), cases
    for name, c in cases.items():
        assert c["atomics"] > 0, name  # int64 counts are added atomically, not as floats
        assert (c["v4_loads"] > 0) == name.endswith(" aligned"), (name, c)
