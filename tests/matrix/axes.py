"""The one table of the configuration matrix: eight axes, each a list of small entries, and the rules that
say which crossings exist (``invalid``), which are refused by design (``Refusal``: the exception type and a
message fragment the cell must raise) and which hit a known defect (``KNOWN_DEFECTS``: the cells must fail as the
entry says, so a fix makes them fail the test until its entry is removed).

A new optimizer, weights mode, layout or path joins by adding one entry to its axis (and, if it refuses
something, a line to its entry's ``refuse``): every oracle of ``harness.py`` then crosses it.

Which cells run (docs/guarantees.md, "The configuration matrix"):

* the default suite: ``sample``, a seeded covering of every entry and, within about a minute, pairs of entries;
* ``-m slow``: runs (below), each taking every gradient kind as a step of its own (so one run decides the five
  cells that differ only in ``grads``), chosen as a complete pairwise covering array of the seven other axes
  (``pairwise_runs``: every two entries that can meet do meet, in a run that also crosses them with every
  gradient kind), plus ``FP16KIT_MATRIX_SLICE=i/n`` slice ``i`` of the full product (``product_slice``: the
  ``n`` slices partition the accepted cells; ``all`` runs the whole product) and every refused cell.

The product is 5646 runs (28230 cells); ``.ci/run`` runs it whole (``FP16KIT_MATRIX_SLICE=all``). No axis can be
dropped as independent of the others: each meets another in code that reads both (the layout decides which rows the
kernels take and the path how those rows step; the backend decided whether Dynamo could trace the apex steps; a
scaler's scale decides whether a huge gradient skips; the weights mode and the moments share the 8-bit rows'
write-back). Dynamo and the Triton interpreter are its cost: a compiled run ~1-2 s, an interpreted one ~0.6 s.
The grads axis is the one that costs nothing, by batching: a step's oracles start from the actual state before it,
so its verdict is its own cell's whatever the steps before it were.
"""
from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------- the entries


class _Named:
    """An axis value shown (in test ids and cell names) by its ``name``."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Refusal:
    """A crossing refused by design: constructing or stepping the cell raises ``exc`` matching ``match``."""

    exc: type[BaseException]
    match: str
    #: the axes that decide it (a refused cell's other axes do not reach the error: refused_cells collapses them)
    axes: tuple[str, ...] = ("opt", "weights", "moments", "path")


@dataclass(frozen=True)
class Optimizer(_Named):
    name: str
    kind: str  #: the float64 reference it is checked against: adam, lamb, sgd, adagrad, novograd, larc
    bf16_modes: bool = False  #: master_weights="split"/"stochastic"
    state8: bool = False  #: state_bits=8
    zero1: bool = False  #: process_group= (ZeRO-1)
    functional: bool = False  #: adam_step_ / lamb_step_
    compiled: bool = False  #: torch.compile(opt.step) is documented (docs/optim.md, "torch.compile")
    #: does a finite gradient whose unscaled magnitude is ``m`` skip the step (the square guard, or a result
    #: check that sees the update overflow)?
    huge_skips: Callable[[float], bool] = lambda m: False

@dataclass(frozen=True)
class Weights(_Named):
    name: str
    dtype: torch.dtype
    master: bool | str  #: the master_weights argument (False, True, "split", "stochastic")

@dataclass(frozen=True)
class Moments:
    bits: int

    def __str__(self) -> str:
        return f"m{self.bits}"


@dataclass(frozen=True)
class Layout(_Named):
    name: str
    doc: str
    #: shapes of the params (the first is the layout's own tensor; a trailing small vector keeps a second row)
    large: bool = False  #: holds a tensor of >= 4096 elements (8-bit moments apply)
    noncontiguous: bool = False

@dataclass(frozen=True)
class Grads(_Named):
    name: str

@dataclass(frozen=True)
class Scaler(_Named):
    name: str

@dataclass(frozen=True)
class Backend(_Named):
    name: str
    select: str  #: the argument of fp16kit.kernels.use_backend

@dataclass(frozen=True)
class Path(_Named):
    name: str
    doc: str

def _adam_guard(m: float) -> bool:
    return m >= 2.0**63  # docs/optim.md, "Finite gradients whose square would overflow"


def _square_overflows(m: float) -> bool:
    return m * m > torch.finfo(torch.float32).max  # Adagrad's sum / NovoGrad's norm: the result check skips


# ---------------------------------------------------------------------------------------------- the table

OPTIMIZERS = [
    Optimizer("FusedAdam", "adam", bf16_modes=True, state8=True, zero1=True, functional=True, compiled=True,
              huge_skips=_adam_guard),
    # max_grad_norm=1.0: a huge gradient is clipped, not skipped (the guard is for max_grad_norm=0)
    Optimizer("FusedLAMB", "lamb", bf16_modes=True, state8=True, zero1=True, functional=True, compiled=True),
    # compiled: "compiled and sharded steps keep the host-vector step" (docs/optim.md, apex's optimizers on the device)
    Optimizer("FusedSGD", "sgd", compiled=True),
    Optimizer("FusedAdagrad", "adagrad", compiled=True, huge_skips=_square_overflows),
    Optimizer("FusedNovoGrad", "novograd", compiled=True),  # its second moment is a per-tensor norm: 1e25 fits
    Optimizer("FusedMixedPrecisionLamb", "lamb", compiled=True),
    Optimizer("LARC", "larc"),  # around FusedSGD, as apex's recipes use it
]

WEIGHTS = [
    Weights("fp32", torch.float32, False),
    Weights("fp16master", torch.float16, True),
    Weights("bf16master", torch.bfloat16, True),
    Weights("split", torch.bfloat16, "split"),
    Weights("stochastic", torch.bfloat16, "stochastic"),
]

MOMENTS = [Moments(32), Moments(8)]

LAYOUTS = [
    Layout("contiguous", "a small contiguous matrix and a vector"),
    Layout("transposed", "a transposed 65x64 weight (param and grad strided)", large=True, noncontiguous=True),
    Layout("channels_last", "a 16x16x4x4 conv weight in channels_last", large=True, noncontiguous=True),
    Layout("sliced", "every other column of a 65x128 tensor (a strided view as the param)", large=True,
           noncontiguous=True),
    Layout("ampO2", "amp O2's fp16/bf16 model copy of a channels_last conv net (masters contiguous)", large=True,
           noncontiguous=True),
    Layout("shared", "two params that are views of one storage"),
    Layout("below8", "a 63x65 matrix: 4095 elements, one below the 8-bit threshold"),
    Layout("above8", "a 64x64 matrix: 4096 elements, at the 8-bit threshold", large=True),
    Layout("empty", "a 0x5 param beside a vector"),
    Layout("copied_group", "a second group built by copying the first group's dict (minus params)"),
    Layout("step_2e31", "every group's step counter loaded from a checkpoint at 2**31"),
]

GRADS = [Grads("finite"), Grads("inf"), Grads("nan"), Grads("huge"), Grads("none")]

SCALERS = [Scaler("noscaler"), Scaler("fp16kitscaler"), Scaler("torchscaler")]

BACKENDS = [Backend("torch", "torch"), Backend("interp", "auto")]

PATHS = [
    Path("host", "eager step; on the Triton backend the host-vector step (FusedOptimizer._on_device off)"),
    Path("device", "eager device-resident step (Triton backend only)"),
    Path("functional", "adam_step_ / lamb_step_ over lists"),
    Path("compiled", "torch.compile(opt.step, backend='eager')"),
    Path("zero1", "process_group= of a one-process gloo group (the sharded code path)"),
]

AXES: dict[str, list] = {
    "opt": OPTIMIZERS,
    "weights": WEIGHTS,
    "moments": MOMENTS,
    "layout": LAYOUTS,
    "grads": GRADS,
    "scaler": SCALERS,
    "backend": BACKENDS,
    "path": PATHS,
}


@dataclass(frozen=True)
class Cell:
    opt: Optimizer
    weights: Weights
    moments: Moments
    layout: Layout
    grads: Grads
    scaler: Scaler
    backend: Backend
    path: Path
    extra: tuple = field(default=(), compare=False)

    @property
    def id(self) -> str:
        return "-".join(str(getattr(self, a)) for a in AXES)

    def replace(self, **kw) -> Cell:
        values = {a: getattr(self, a) for a in AXES}
        values.update(kw)
        return Cell(**values)


def by_name(axis: str, name: str):
    return next(e for e in AXES[axis] if e.name == name) if axis != "moments" else Moments(int(name))


# ---------------------------------------------------------------------------------------------- the rules


def invalid(c: Cell) -> str | None:
    """Why a crossing does not exist (it is not generated), or None."""
    o, w, path, lay = c.opt, c.weights, c.path.name, c.layout.name
    if path == "device" and c.backend.name != "interp":
        return "the device-resident step runs on the Triton backend only"
    if path == "functional" and not o.functional:
        return "the functional API is adam_step_ and lamb_step_"
    if path == "functional" and (c.moments.bits == 8 or isinstance(w.master, str)):
        return "the functional API takes fp32 moments and (optionally) fp16/bf16 model copies of fp32 masters"
    if path == "functional" and c.scaler.name != "noscaler":
        return "a GradScaler steps an optimizer, not a function (the functional API takes inv_scale/found_inf)"
    if path == "compiled" and not o.compiled:
        return "torch.compile is documented for FusedAdam/FusedLAMB (and subclasses) and apex's SGD/Adagrad/NovoGrad"
    if o.name == "FusedMixedPrecisionLamb" and isinstance(w.master, str):
        return "FusedMixedPrecisionLamb has no master_weights argument (its masters: reduced_precision_dtype)"
    if lay == "ampO2" and (w.master is not True or path in ("functional", "zero1", "compiled")):
        return "amp O2 makes fp16/bf16 model params with fp32 masters, and steps the optimizer eagerly"
    if lay == "ampO2" and c.scaler.name != "noscaler":
        return "amp O2 brings its own loss scaler"
    if lay == "ampO2" and o.name in ("FusedMixedPrecisionLamb", "LARC"):
        return "amp O2's fused master path is FusedAdam's and FusedLAMB's (others keep masters in their groups)"
    if lay == "ampO2" and o.kind in ("sgd", "adagrad", "novograd"):
        return "amp O2's fused master path is FusedAdam's and FusedLAMB's (others keep masters in their groups)"
    if lay == "step_2e31" and o.kind in ("sgd", "larc", "adagrad"):
        return "FusedSGD and FusedAdagrad keep no step counter"
    if lay in ("copied_group", "step_2e31") and path == "functional":
        return "the functional API has no param groups"
    if c.moments.bits == 8 and path == "functional":
        return "see above"
    return None


def refusal(c: Cell) -> Refusal | None:
    """The error a crossing must raise by design (a refused cell), or None (an accepted cell)."""
    o, w = c.opt, c.weights
    # (in the order they fire: an unknown keyword before the constructor's own checks)
    if c.moments.bits == 8 and not o.state8:
        return Refusal(TypeError, "unexpected keyword argument 'state_bits'")
    if c.path.name == "zero1" and not o.zero1:
        return Refusal(TypeError, "unexpected keyword argument 'process_group'")
    if isinstance(w.master, str) and not o.bf16_modes:
        return Refusal(ValueError, f"master_weights='{w.master}' is not understood")
    if o.name == "LARC" and w.dtype == torch.float16 and c.scaler.name == "torchscaler":
        # LARC rewrites the grads itself, so a scaler unscales them first; torch's refuses fp16 grads (fp16kit's
        # GradScaler unscales them)
        return Refusal(ValueError, "Attempting to unscale FP16 gradients", ("opt", "weights", "scaler"))
    if c.path.name == "compiled" and c.moments.bits == 8:
        return Refusal(NotImplementedError, "torch.compile of a state_bits=8 step")
    return None


@dataclass(frozen=True)
class ErrorInput(_Named):
    """A constructor argument every optimizer must refuse (torch's ``ErrorOptimizerInput``)."""

    name: str
    kwargs: dict
    refusal: Refusal

#: bounds every optimizer checks at construction (docs/optim.md, "Validation"): a float32 update needs float32
#: hyper-parameters
ERROR_INPUTS = [
    ErrorInput("lr=1e39", {"lr": 1e39}, Refusal(ValueError, r"lr=1e\+39")),
    ErrorInput("weight_decay=1e300", {"weight_decay": 1e300}, Refusal(ValueError, r"weight_decay=1e\+300")),
]


def error_cells() -> list[Cell]:
    """One cell per optimizer and error input (the other axes at their first entry); ``extra`` names the input."""
    base = Cell(OPTIMIZERS[0], WEIGHTS[0], MOMENTS[0], LAYOUTS[0], GRADS[0], SCALERS[0], BACKENDS[0], PATHS[0])
    return [Cell(o, *[getattr(base, a) for a in list(AXES)[1:]], extra=(e,)) for o in OPTIMIZERS for e in ERROR_INPUTS]


@dataclass(frozen=True)
class Defect:
    """A known defect: the cells ``applies`` selects fail today, one of their failure messages matching ``match`` (a
    regular expression; a refused or error-input cell: any exception, the test is ``xfail(strict=True)``)."""

    reason: str
    applies: Callable[[Cell], bool]
    match: str = ""


KNOWN_DEFECTS: list[Defect] = []  #: each: its reason, the cells it applies to, what they raise (none known today)


def defects(c: Cell) -> list[Defect]:
    return [d for d in KNOWN_DEFECTS if d.applies(c)]


# ---------------------------------------------------------------------------------------------- the cells


def all_cells() -> Iterator[Cell]:
    """Every crossing of the axes that exists (accepted and refused), in table order."""
    for values in itertools.product(*AXES.values()):
        c = Cell(*values)
        if invalid(c) is None:
            yield c


@functools.cache
def _accepted() -> tuple[Cell, ...]:
    return tuple(c for c in all_cells() if refusal(c) is None)


def accepted_cells() -> list[Cell]:
    """Every accepted cell, in table order (computed once: ~5 s of crossing the axes)."""
    return list(_accepted())


def refused_cells() -> list[Cell]:
    """One refused cell per distinct refusal and the axes that decide it (optimizer, weights, moments, path): the
    other axes do not reach a refusal raised at construction or at the first step, so they stay at their first
    entry (the Triton backend where the path needs it)."""
    out, seen = [], set()
    for c in all_cells():
        r = refusal(c)
        if r is None:
            continue
        key = (r, *(str(getattr(c, a)) for a in r.axes))
        if key in seen:
            continue
        seen.add(key)
        rep = c.replace(**{a: AXES[a][0] for a in AXES if a not in r.axes})
        if c.path.name == "device":
            rep = rep.replace(backend=BACKENDS[1])
        out.append(rep if invalid(rep) is None and refusal(rep) == r else c)
    return out


#: rough seconds per cell on the 2-core CI box, twins included (the sample's time budget)
def cost(c: Cell) -> float:
    if refusal(c) is not None:
        return 0.05 if c.path.name != "compiled" else 4.0
    t = 0.3 if c.layout.large else 0.15
    if c.backend.name == "interp" or c.path.name == "device":
        t = 6.0 if c.layout.large else 2.5
    elif c.path.name in ("host", "zero1", "functional") and c.layout.name != "ampO2":
        t += 6.0 if c.layout.large else 2.5  # the twin on the Triton backend
    if c.path.name == "compiled":  # Dynamo: apex's steps break the graph at their passes (more frames to compile)
        t += (6.0 if c.opt.kind in ("adam", "lamb") else 12.0) * (1 if c.backend.name == "torch" else 2)
    return t


def _tuples(c: Cell, strength: int, over: tuple[str, ...] = tuple(AXES)) -> set:
    return set(itertools.combinations([(a, str(getattr(c, a))) for a in over], strength))


def covering(cells: list[Cell], rng: random.Random, strength: int, budget_s: float = float("inf"),
             have: list[Cell] = (), pool: int = 400, price: Callable[[Cell], float] = cost,
             over: tuple[str, ...] = tuple(AXES)) -> list[Cell]:
    """Greedy covering array (AETG-style): each round draws ``pool`` candidates and takes the one that crosses
    most not-yet-crossed ``strength``-tuples of entries per second of its ``cost``, until no candidate adds a
    tuple or ``budget_s`` is spent."""
    seen = set().union(*(_tuples(c, strength, over) for c in have)) if have else set()
    left = cells[:]
    chosen: list[Cell] = []
    spent = 0.0
    misses = 0
    while left and misses < 3:
        cand = rng.sample(range(len(left)), min(pool, len(left)))
        gain, i = max((len(_tuples(left[i], strength, over) - seen) / price(left[i]), i) for i in cand)
        if gain == 0 or spent + price(left[i]) > budget_s:
            misses += 1
            continue
        misses = 0
        c = left.pop(i)
        chosen.append(c)
        seen |= _tuples(c, strength, over)
        spent += price(c)
    return chosen


def sample(seed: int, budget_s: float = 55.0) -> list[Cell]:
    """The default suite's deterministic sample: every entry of every axis in an accepted cell, then pairs of
    entries not yet crossed, cheapest per new pair first, until about ``budget_s`` seconds; plus the refused cells
    that are cheap (construction-time refusals) and one compiled refusal."""
    rng = random.Random(seed)
    acc = accepted_cells()
    refused = [c for c in refused_cells() if c.path.name != "compiled"]
    refused += covering([c for c in refused_cells() if c.path.name == "compiled"], rng, 1)[:1]
    first = covering(acc, rng, 1)
    spent = sum(cost(c) for c in first + refused)
    return first + covering([c for c in acc if c not in set(first)], rng, 2, budget_s - spent, first) + refused


# ---------------------------------------------------------------------------------------------- runs (the slow set)
#
# A run takes every gradient kind as a step of its own (``harness.BATCH``), each step held to its own oracles from
# the actual state before it, so one run decides the five cells that differ only in ``grads`` (validity and
# refusals never depend on ``grads``: ``test_runs_partition_the_accepted_cells``). A family is the runs that differ
# only in backend and path: every twin of oracle 2 is in the run's family, so a family runs in one test and each
# of its runs is computed once.

RUN_AXES = tuple(a for a in AXES if a != "grads")


@functools.cache
def _runs() -> tuple[Cell, ...]:
    return tuple(c for c in _accepted() if c.grads == GRADS[0])


def runs() -> list[Cell]:
    """One run per accepted cell with ``grads`` at its first entry (the run stands for its five cells)."""
    return list(_runs())


def cells_of(run: Cell) -> list[Cell]:
    return [run.replace(grads=g) for g in GRADS]


def family(c: Cell) -> str:
    return "-".join(str(getattr(c, a)) for a in ("opt", "weights", "moments", "layout", "scaler"))


def run_cost(c: Cell) -> float:
    """Relative cost of one batched run alone (no twin): wall seconds on the 2-core box at a load of ~6 (CPU seconds
    are about a third to a fifth of it). It weighs runs in the covering array; it is not a time budget."""
    if c.layout.name == "ampO2":
        return 5.0
    interp = c.backend.name == "interp"
    t = (3.0 if c.layout.large else 2.0) if interp else 0.8
    if c.path.name == "device":
        t += 0.5
    if c.path.name == "compiled":  # Dynamo (apex's steps break the graph at their passes: more frames to compile)
        t += (6.0 if c.opt.kind in ("adam", "lamb") else 12.0) * (2 if interp else 1)
    return t


def twin_cells(c: Cell) -> list[Cell]:
    """The runs oracle 2 compares ``c`` with (``harness.twins``, restated here so the cost model needs no harness)."""
    out = []
    if c.path.name in ("host", "zero1", "functional") and c.layout.name != "ampO2":
        out.append(c.replace(backend=next(b for b in BACKENDS if b != c.backend)))
    if c.path.name in ("device", "compiled"):
        out.append(c.replace(path=PATHS[0]))
    return [t for t in out if invalid(t) is None]


def family_cost(members: list[Cell]) -> float:
    """A family test's seconds: each distinct run (members and their twins) once."""
    distinct = {c.id: c for m in members for c in [m, *twin_cells(m)]}
    return sum(run_cost(c) for c in distinct.values())


def families(chosen: list[Cell]) -> dict[str, list[Cell]]:
    out: dict[str, list[Cell]] = {}
    for c in chosen:
        out.setdefault(family(c), []).append(c)
    return out


def pairwise_runs() -> list[Cell]:
    """Every pair of entries of the seven run axes crossed in some run (a strength-2 covering array, seed 0); with
    the gradient kinds in every run, every pair crossed with every gradient kind."""
    return covering(runs(), random.Random(0), 2, price=lambda c: run_cost(c) + sum(map(run_cost, twin_cells(c))),
                    over=RUN_AXES)


def slice_of(text: str | None) -> tuple[int, int] | None:
    """``FP16KIT_MATRIX_SLICE``: ``"i/n"`` (slice i of n, 0-based), ``"all"`` (n = 1) or unset/empty (none)."""
    if not text:
        return None
    if text == "all":
        return (0, 1)
    i, n = (int(x) for x in text.split("/"))
    if not 0 <= i < n:
        raise ValueError(f"FP16KIT_MATRIX_SLICE={text!r}: want i/n with 0 <= i < n, or 'all'")
    return (i, n)


def product_slice(i: int, n: int) -> list[Cell]:
    """Slice ``i`` of ``n`` of the full product: every run of the families whose position in table order is ``i``
    modulo ``n`` (a family's runs stay together, so its twins are computed once). The ``n`` slices partition the
    accepted cells: ``n`` CI jobs (or ``n`` consecutive nightly runs) run the whole matrix."""
    names = _family_names()
    keep = set(names[i::n])
    return [c for c in _runs() if family(c) in keep]


@functools.cache
def _family_names() -> list[str]:
    return list(families(list(_runs())))


def full(part: tuple[int, int] | None = None) -> tuple[list[Cell], list[Cell]]:
    """The slow set: ``(runs, refused cells)``: the pairwise array of runs, plus slice ``part`` of the full product
    (``FP16KIT_MATRIX_SLICE``), and every refused cell."""
    chosen = pairwise_runs()
    if part is not None:
        have = {c.id for c in chosen}
        chosen += [c for c in product_slice(*part) if c.id not in have]
    return chosen, refused_cells()
