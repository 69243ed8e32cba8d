"""``benchmarks/gpu_suite.sh`` (issue 20, item 7): the GPU suite must fit one device call and a rerun in 15 minutes.

Checked without a GPU: the default steps' time limits add up to at most 8 minutes, every default step names a
script that exists, and the script runs end to end on this machine with no step selected (it still writes its
summary under ``$OUT``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.sh"


def _steps() -> tuple[list[str], dict[str, tuple[int, list[str]]]]:
    text = SCRIPT.read_text().replace("\\\n", " ")  # continued lines joined
    default = re.search(r"STEPS=\$\{STEPS:-([^}]*)\}", text)
    assert default, "gpu_suite.sh lost its default STEPS"
    steps = {}
    for line in re.findall(r"^step (.+)$", text, flags=re.M):
        name, limit, *command = shlex.split(line)
        steps[name] = (int(limit), command)
    return default.group(1).split(), steps


def test_default_steps_fit_eight_minutes():
    default, steps = _steps()
    assert set(default) <= set(steps), f"default STEPS names steps the script lacks: {set(default) - set(steps)}"
    total = sum(steps[name][0] for name in default)
    assert total <= 8 * 60, f"the default steps may take {total} s, more than 8 minutes"


def test_default_steps_run_scripts_that_exist():
    default, steps = _steps()
    root = SCRIPT.parents[1]
    for name in default:
        scripts = [arg for arg in steps[name][1] if arg.endswith(".py")]
        for script in scripts:
            assert (root / script).is_file(), f"step {name} runs {script}, which does not exist"


def test_script_runs_with_no_step_selected(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "STEPS": "none", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "gpu_tests: not selected" in summary and "done" in summary
