"""Every precision mode trains the demo's language model to within the seed spread of its reference (slow).

The configuration is ``benchmarks/convergence.py``'s CPU default (size ``bench``, 250 steps) at seed 0. Each mode
is compared with its reference (fp32 AdamW, or fp32 FusedLAMB for the LAMB modes) at the same seed: same initial
weights, same batches. ``MARGIN`` is the spread of the references' final validation loss over the three seeds that
``benchmarks/convergence.py`` measured (benchmarks/results/convergence.md; docs/which-mode.md states it and how it
was derived): a mode further from its reference than a change of seed moves the reference is a numerics
regression showing up in training. Every loss must also stay finite, and the bf16 modes must skip nothing.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.demo.lm import SIZES
from fp16kit.demo.lm_train import train_mode
from fp16kit.demo.modes import MODES, Hyper
from fp16kit.demo.text import load_corpus

STEPS = 250
#: The larger of the two references' ranges over seeds 0, 1, 2 of the final validation loss (fp32 AdamW: 0.181),
#: rounded up (docs/which-mode.md, "The margin the tests hold every mode to").
MARGIN = 0.2


@pytest.mark.slow
def test_every_mode_ends_within_the_seed_spread_of_its_reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        corpus = load_corpus()
        results = {name: train_mode(mode, corpus, SIZES["bench"], Hyper(), steps=STEPS, seed=0,
                                    device=torch.device("cpu"), eval_every=STEPS, val_windows=128, progress=False)
                   for name, mode in MODES.items()}
    finally:
        torch.set_num_threads(threads)
    report = {name: round(r.final_val - results[r.reference].final_val, 4) for name, r in results.items()}
    for name, r in results.items():
        assert r.finite and math.isfinite(r.final_val), name
        assert abs(r.final_val - results[r.reference].final_val) <= MARGIN, (name, report)
        if name.startswith("bf16"):
            assert r.skipped == 0, name
    for name in ("fp32", "fp32-lamb"):  # the references themselves learned: well below the unigram level
        assert results[name].final_val < 3.0, results[name].final_val
