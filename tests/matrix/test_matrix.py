"""The configuration matrix (docs/guarantees.md, "The configuration matrix"): every crossing of the axes of
``axes.py`` that exists is a cell; an accepted cell passes the four oracles of ``harness.py``, a refused one
raises the error its entry names. The default suite runs a seeded sample that covers every entry of every axis
(``FP16KIT_MATRIX_SEED`` picks another sample; the seed is printed in the header); ``-m slow`` runs the full set.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch

from . import axes, harness
from .axes import Cell

SEED = int(os.environ.get("FP16KIT_MATRIX_SEED", "20261129"))


def _marks(c: Cell) -> list:
    marks = []
    if c.backend.name == "interp":
        marks.append(pytest.mark.interpreter)
    found = axes.defects(c)
    if found:
        raises = tuple({e for d in found for e in d.raises})
        marks.append(pytest.mark.xfail(strict=True, raises=raises, reason="; ".join(d.reason for d in found)))
    return marks


def _params(cells: list[Cell]) -> list:
    return [pytest.param(c, id=c.id, marks=_marks(c)) for c in cells]


SAMPLE = axes.sample(SEED)


def _want_slow(config) -> bool:
    return "slow" in (config.option.markexpr or "") or os.environ.get("FP16KIT_SLOW") == "1"


def pytest_generate_tests(metafunc):
    """The slow set is built only when it runs (building it takes a few seconds of covering-array search)."""
    if "full_cell" in metafunc.fixturenames:
        cells = axes.full() if _want_slow(metafunc.config) else []
        metafunc.parametrize("full_cell", _params(cells))


@pytest.fixture(scope="module")
def pg():
    """A one-process gloo group for the ZeRO-1 path (the sharded code path with nothing to share)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    made = False
    with tempfile.TemporaryDirectory() as tmp:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
            made = True
        try:
            yield dist.group.WORLD
        finally:
            if made:
                dist.destroy_process_group()


_RUNS: dict[str, harness.Run] = {}


def _run(c: Cell, pg) -> harness.Run:
    if c.id not in _RUNS:
        if len(_RUNS) > 64:
            _RUNS.clear()
        _RUNS[c.id] = harness.run_cell(c, pg if c.path.name == "zero1" else None)
    return _RUNS[c.id]


def check_cell(c: Cell, pg) -> None:
    if c.path.name == "compiled":
        torch._dynamo.reset()  # each cell compiles its own step (no cache limit reached across cells)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refused = axes.refusal(c)
        if refused is not None:
            with pytest.raises(refused.exc, match=refused.match):
                run = harness.build(c, pg if c.path.name == "zero1" else None)
                harness.checked_step(run, harness.grads_for(run, 0, "finite"))
            return
        run = _run(c, pg)
        for twin, how in harness.twins(c):
            if axes.invalid(twin) is None:
                harness.compare(run, _run(twin, pg), how)


@pytest.mark.parametrize("seed", [SEED], ids=lambda s: f"seed={s}")
def test_sample_covers_every_entry(seed):
    """The default sample crosses every entry of every axis at least once (its seed is in this test's id)."""
    print(f"\nmatrix seed {SEED} (FP16KIT_MATRIX_SEED): {len(SAMPLE)} sampled cells")
    for axis, entries in axes.AXES.items():
        seen = {str(getattr(c, axis)) for c in SAMPLE}
        assert seen == {str(e) for e in entries}, axis


@pytest.mark.parametrize("cell", _params(SAMPLE))
def test_cell(cell, pg):
    check_cell(cell, pg)


@pytest.mark.slow
def test_cell_full(full_cell, pg):
    check_cell(full_cell, pg)


@pytest.mark.parametrize("cell", [pytest.param(c, id=f"{c.opt}-{c.extra[0]}", marks=_marks(c))
                                  for c in axes.error_cells()])
def test_error_input(cell):
    """Every optimizer refuses hyper-parameters outside float32's range at construction, naming the value."""
    bad = cell.extra[0]
    with pytest.raises(bad.refusal.exc, match=bad.refusal.match):
        harness._make_opt(cell, harness._params(cell), None, **bad.kwargs)
