"""A DeepLearningExamples-style BERT pretraining script (``dle_bert_pretraining.py`` beside this file: apex imports,
``_amp_state.loss_scalers[0]._overflow_buf`` / ``update_scale()``, ``amp_C.multi_tensor_scale``, ``apex_C.unflatten``,
``flat_dist_call``, O2 + FusedLAMB, gradient accumulation, clipping of the masters, DLE's checkpoint/resume) runs
unmodified through ``python -m fp16kit run``, trains, and a run resumed from its step-3 checkpoint ends in the same
bits as the straight run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("dle_bert_pretraining.py")
REPO = Path(__file__).resolve().parents[2]


def _run(out: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "FP16KIT_BACKEND": "torch"}  # as the rest of the suite: the torch fallback (the interpreter is slow)
    proc = subprocess.run([sys.executable, "-m", "fp16kit", "run", str(SCRIPT), "--output_dir", str(out), "--fp16",
                           *args], capture_output=True, text=True, timeout=300, env=env, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("mode", [["--allreduce_post_accumulation"], []], ids=["allreduce_post_accumulation", "plain"])
def test_dle_style_script_trains_and_resumes_bit_for_bit(tmp_path, mode) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    straight.mkdir()
    resumed.mkdir()
    log = _run(straight, *mode, "--overflow_at_step", "9")
    losses = [float(line.split()[-1]) for line in log.splitlines() if line.startswith("step ")]
    assert sum(losses[-2:]) < sum(losses[:2])  # it learns (four batches, seen again and again)
    if mode:  # the update_scale() path decided the skips (DLE's init scale 2**20 overflows at first, and step 9)
        assert "skipped step, loss scale now" in log and "skipped_steps 0" not in log
    shutil.copy(straight / "ckpt_3.pt", resumed / "ckpt_3.pt")
    _run(resumed, *mode, "--overflow_at_step", "9", "--resume_from_checkpoint", "--resume_step", "3")
    a = torch.load(straight / "ckpt_6.pt", weights_only=False)
    b = torch.load(resumed / "ckpt_6.pt", weights_only=False)
    # torch's Optimizer.load_state_dict adds flags the fresh optimizer's groups lack ('differentiable': False)
    for ga, gb in zip(a["optimizer"]["param_groups"], b["optimizer"]["param_groups"]):
        for extra in gb.keys() - ga.keys():
            assert not gb.pop(extra), extra
    _same(a, b, "ckpt_6")
    assert a["amp"]["loss_scaler0"]["fp16kit"]["steps_skipped"] >= 1
