"""The configuration matrix (docs/guarantees.md, "The configuration matrix"): every crossing of the axes of
``axes.py`` that exists is a cell; an accepted cell passes the four oracles of ``harness.py``, a refused one
raises the error its entry names. The default suite runs a seeded sample that covers every entry of every axis
(``FP16KIT_MATRIX_SEED`` picks another sample; the seed is in a test id), each cell a run of three steps;
``-m slow`` runs the pairwise array of runs (every gradient kind a step of each run), grouped by family so that
a run's twins are computed once, plus ``FP16KIT_MATRIX_SLICE`` (``i/n`` or ``all``) of the full product. Every
verdict is a cell's: a failure names each cell it concerns.
"""
from __future__ import annotations

import os
import re
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
    if found and (axes.refusal(c) is not None or c.extra):  # (an accepted cell's defects: ``judge``)
        marks.append(pytest.mark.xfail(strict=True, reason="; ".join(d.reason for d in found)))
    return marks


def _params(cells: list[Cell]) -> list:
    return [pytest.param(c, id=c.id, marks=_marks(c)) for c in cells]


SAMPLE = axes.sample(SEED)


def _want_slow(config) -> bool:
    return "slow" in (config.option.markexpr or "") or os.environ.get("FP16KIT_SLOW") == "1"


def pytest_generate_tests(metafunc):
    """The slow set is built only when it runs (building it takes a few seconds of covering-array search)."""
    if "full_cell" in metafunc.fixturenames or "family_runs" in metafunc.fixturenames:
        slow = _want_slow(metafunc.config)
        chosen, refused = axes.full(axes.slice_of(os.environ.get("FP16KIT_MATRIX_SLICE"))) if slow else ([], [])
        if "full_cell" in metafunc.fixturenames:
            metafunc.parametrize("full_cell", _params(refused))
        else:
            metafunc.parametrize("family_runs", [
                pytest.param(members, id=f"{name}/" + "+".join(f"{c.backend}-{c.path}" for c in members),
                             marks=[pytest.mark.interpreter] if any(_marks(c) for c in members) else [])
                for name, members in axes.families(chosen).items()])


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


_RUNS: dict[tuple, harness.Run] = {}


def _run(c: Cell, pg, kinds: tuple[str, ...]) -> harness.Run:
    """A cell's run, kept for the cells whose twin it is (the slow set keeps twins on one worker: ``xdist_group``)."""
    key = (c.id, kinds)
    if key not in _RUNS:
        if len(_RUNS) > 64:
            _RUNS.clear()
        if c.path.name == "compiled":
            torch._dynamo.reset()  # each run compiles its own step (no cache limit reached across runs)
        _RUNS[key] = harness.run_cell(c, pg if c.path.name == "zero1" else None, kinds)
    return _RUNS[key]


def verdicts(c: Cell, pg, batched: bool = False) -> dict[str, list[str]]:
    """Every oracle of ``c``'s run (a single cell's three steps, or with ``batched`` a run whose steps are the five
    gradient kinds, ``harness.BATCH``) and of its twins: the failures by the id of the cell each step stands for
    (``{}``: every cell passes)."""
    kinds = harness.schedule(c, batched)

    def cell_of(x: Cell, k: int) -> str:
        return (x.replace(grads=axes.by_name("grads", kinds[k])) if batched else x).id

    out: dict[str, list[str]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = _run(c, pg, kinds)
        for k, msg in run.failures:
            out.setdefault(cell_of(c, k), []).append(msg)
        for twin, how in harness.twins(c):
            if axes.invalid(twin) is not None:
                continue
            other = _run(twin, pg, kinds)
            for k, msg in other.failures:
                out.setdefault(cell_of(twin, k), []).append(f"(as the twin of {c.id}) {msg}")
            for k, msg in harness.compare(run, other, how):
                out.setdefault(cell_of(c, k), []).append(f"against {twin.id}: {msg}")
    return out


def judge(failed: dict[str, list[str]], cells: list[Cell]) -> None:
    """Fail naming every cell whose verdict is wrong: a failure outside ``KNOWN_DEFECTS``, or a known defect's cell
    that passes (fixed: remove its entry) or fails otherwise than its entry says."""
    wrong = []
    for c in {c.id: c for c in cells}.values():  # a run's cell may also stand as a twin's: judged once
        known = axes.defects(c)
        msgs = failed.pop(c.id, [])
        if known and not any(re.search(d.match, m) for d in known for m in msgs):
            wrong.append(f"{c.id}: a known defect ({'; '.join(d.reason for d in known)}) "
                         + ("no longer fails: remove its entry" if not msgs else f"fails otherwise: {msgs[0]}"))
        elif msgs and not known:
            wrong.append(f"{c.id}: " + "\n    ".join(msgs))
    wrong += [f"{cid}: " + "\n    ".join(msgs) for cid, msgs in failed.items()]  # twins outside ``cells``
    assert not wrong, f"{len(wrong)} cell(s) failed:\n" + "\n".join(wrong)


def check_cell(c: Cell, pg) -> None:
    refused = axes.refusal(c)
    if refused is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(refused.exc, match=refused.match):
                run = harness.build(c, pg if c.path.name == "zero1" else None)
                harness.checked_step(run, harness.grads_for(run, 0, "finite"))
        return
    judge(verdicts(c, pg), [c])


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
    """Every refused cell raises the error its entry names."""
    check_cell(full_cell, pg)


@pytest.mark.slow
def test_family(family_runs, pg):
    """The slow set's runs of one family (the runs that differ in backend and path only), each taking every gradient
    kind as a step of its own: every oracle of every run and twin; a failure names each cell it concerns."""
    failed: dict[str, list[str]] = {}
    for run in family_runs:
        for cid, msgs in verdicts(run, pg, batched=True).items():
            failed.setdefault(cid, []).extend(msgs)
    judge(failed, [c for r in family_runs for x in [r, *axes.twin_cells(r)] for c in axes.cells_of(x)])


def test_runs_partition_the_accepted_cells():
    """The slow set's bookkeeping: a run's five cells (one per gradient kind) are all accepted, the runs' cells are
    exactly the accepted cells, each run's twins are in its family, and the slices of the full product partition
    the runs (so ``FP16KIT_MATRIX_SLICE=i/n`` for every ``i`` runs every accepted cell)."""
    runs = axes.runs()
    cells = [c.id for r in runs for c in axes.cells_of(r)]
    assert len(cells) == len(set(cells))
    assert set(cells) == {c.id for c in axes.accepted_cells()}
    assert all(axes.family(t) == axes.family(r) for r in runs for t in axes.twin_cells(r))
    n = 7
    parts = [c.id for i in range(n) for c in axes.product_slice(i, n)]
    assert sorted(parts) == sorted(r.id for r in runs)
    assert [c.id for c in axes.product_slice(0, 1)] == [r.id for r in runs]
    with pytest.raises(ValueError, match="FP16KIT_MATRIX_SLICE"):
        axes.slice_of("7/7")


@pytest.mark.parametrize("cell", [pytest.param(c, id=f"{c.opt}-{c.extra[0]}", marks=_marks(c))
                                  for c in axes.error_cells()])
def test_error_input(cell):
    """Every optimizer refuses hyper-parameters outside float32's range at construction, naming the value."""
    bad = cell.extra[0]
    with pytest.raises(bad.refusal.exc, match=bad.refusal.match):
        harness._make_opt(cell, harness._params(cell), None, **bad.kwargs)
