"""One planner for every multi-tensor op: validate once, group once, remember the verdict (docs/kernels.md).

A call hands the planner ``k`` parallel tensor lists ("rows": 1 for ``l2norm``, 2 for ``unscale_and_check(out=)``
and ``copy_``, 4-6 for an optimizer step). The plan is what every launch path needs:

* the validation verdict: dense floating tensors, rows that pair up (length, shapes), one device, and written
  rows that overlap nothing they must not (``_checks.check_writes``), all raising the same ``ValueError`` /
  ``TypeError`` on every backend;
* kernel groups (contiguous fp16/bf16/fp32, the backend allows Triton; one group per dtype combination) and
  fallback groups (everything else), as index lists with a C-level picker each;
* per group, a :class:`fp16kit.kernels.engine.table.Tape` holding the address tables its launches used, and a ``memo``
  dict for other per-group facts an op derives once (e.g. which pairs are in place).

Cache. Plans are kept in a bounded LRU keyed by the spec, the backend, a per-row extra key and the rows'
``data_ptr()`` values (``tuple(map(Tensor.data_ptr, row))``: one C-level pass per row). A hit must also pass a
*guard* on the tensors' metadata (shape, strides, dtype, device, dispatch keys such as the negative bit), checked
in C++ by torch's own tensor guard (``torch._C._dynamo.guards.TensorGuards``, what ``torch.compile`` uses) or,
where that is unavailable, by comparing Python tuples. So a hit means: the same addresses and the same layouts as
when the plan was made, hence the same validation verdict (``check_writes`` depends only on addresses, shapes,
strides and element sizes), the same groups, and the same address tables. Whatever a user changes without
changing a tensor's identity (``p.data = other``, ``resize_``, ``as_strided_``, a dtype view through ``.data``)
changes an address or the metadata, so the plan is rebuilt; a freed tensor whose id and address are reused by a
tensor of another shape or dtype fails the guard. Entries hold integers, dtypes and device-side tables only,
never a user's tensor.

The guard is built when a key is seen the second time (the second call validates again), so lists that never
come back do not pay for it. From then on a repeated call costs one ``data_ptr`` pass and one guard check per row
(about 0.1 us per tensor on a CPU, measured in ``benchmarks/results/kernels_cpu.md``) plus O(groups) Python: no
per-tensor Python loop.

Three refinements (docs/kernels.md, "Planner and plan cache"): ``aux`` tensors (a call's flag and scale) are checked
on a miss and pinned by the guard; ``Spec.loose`` rows (an optimizer's grads, re-allocated every step) are left out
of the key, and a hit re-checks only that they share no byte with a written tensor (:func:`_apart`); and inside
:class:`vouched` a caller that has just checked the same lists' metadata with its own guard spares the planner's.
"""

from __future__ import annotations

import operator
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, pairwise
from typing import Any

import torch

from ..backend import Backend, select_backend
from .checks import KERNEL_DTYPES, _extent, check_pairs, check_tensor_list, check_writes, common_device
from .table import Tape

__all__ = ["CACHE_SIZE", "Group", "Plan", "Spec", "clear", "plan", "stats", "vouched"]

#: Plans kept by the LRU cache (one per distinct list of a model's call sites: a few dozen in practice).
CACHE_SIZE = 256

#: Counters read by tests and the benchmark: plans made (cache misses) and cache hits.
stats = {"plans": 0, "hits": 0}

_KERNEL_DTYPES = frozenset(KERNEL_DTYPES)
_F32 = torch.float32
_F64 = torch.float64
_data_ptr = torch.Tensor.data_ptr


@dataclass(frozen=True, eq=False)  # identity equality and hash: specs are module constants (a cheap cache key)
class Spec:
    """What one op's rows are. ``names``: each row's name in error messages; ``written``: rows the op writes
    (checked against each other and the read rows); ``key_rows``: rows whose dtypes make a kernel group's key;
    ``state_rows``: rows that must be fp32 for the kernels (optimizer state; ``state_dtypes``); ``optional``: a row
    that may hold ``None`` entries (model copies); ``keep_empty``: empty tensors go to the fallback (optimizer rows,
    a no-op there) instead of being dropped; ``math_key``: fallback groups are keyed by the math dtype of row 0 (float64
    or float32) instead of the key rows' dtypes; ``loose``: read rows whose addresses are not part of the cache
    key (an optimizer's grads, re-allocated every step): a hit re-checks only that they overlap no written
    tensor (the one fact of the validation that depends on their addresses; see the module docstring)."""

    fn: str
    names: tuple[str, ...]
    written: tuple[int, ...]
    key_rows: tuple[int, ...]
    state_rows: tuple[int, ...] = ()
    optional: int | None = None
    keep_empty: bool = False
    math_key: bool = False
    loose: tuple[int, ...] = ()
    #: The dtypes ``state_rows`` may have in a kernel group (``state_bits=8`` adds uint8: 8-bit moments).
    state_dtypes: frozenset = frozenset({torch.float32})


class Group:
    """Positions that run together (one launch set), and what the op remembers about them."""

    __slots__ = ("idx", "key", "memo", "pick", "tape", "whole")

    def __init__(self, idx: list[int], key: object, n: int) -> None:
        self.idx = idx
        self.key = key
        self.whole = len(idx) == n  # all positions, in order: picking returns the list itself
        self.tape = Tape()
        self.memo: dict[str, Any] = {}
        if self.whole:
            self.pick: Callable[[Sequence], list] = _as_list
        elif len(idx) == 1:
            i = idx[0]
            self.pick = lambda xs: [xs[i]]
        else:
            getter = operator.itemgetter(*idx)
            self.pick = lambda xs: list(getter(xs))


def _as_list(xs: Sequence) -> list:
    return xs if type(xs) is list else list(xs)


@dataclass(eq=False)
class Plan:
    """A validated plan: the device (None for empty lists), kernel and fallback groups, and ``neg_inputs``: some
    read tensor has the negative bit (the op resolves it per call into a temporary, which must not be launched
    from a tape: its address is new every call)."""

    device: torch.device | None
    kernel: list[Group] = field(default_factory=list)
    rest: list[Group] = field(default_factory=list)
    neg_inputs: bool = False


_EMPTY = Plan(None)


# ---------------------------------------------------------------------------------------------------------------
# metadata guards: shape, strides, dtype, device and dispatch keys of every tensor, compared in one call


def _py_meta(flat: Sequence[torch.Tensor]) -> tuple:
    return (
        tuple(map(torch.Tensor.size, flat)),
        tuple(map(torch.Tensor.stride, flat)),
        tuple(t.dtype for t in flat),
        tuple(t.device for t in flat),
        tuple(map(torch.Tensor.is_neg, flat)),
    )


class _PyGuard:
    """The portable guard: Python tuples of every tensor's metadata (slower than torch's C++ guard)."""

    __slots__ = ("meta",)

    def __init__(self, flat: Sequence[torch.Tensor]) -> None:
        self.meta = _py_meta(flat)

    def check(self, *flat: torch.Tensor) -> bool:
        return _py_meta(flat) == self.meta


def _torch_guard(flat: Sequence[torch.Tensor]) -> Any:
    """torch's C++ tensor guard (dtype, device, sizes, strides, dispatch keys, requires_grad); it keeps only
    metadata, not the tensors."""
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(
        *flat,
        dynamic_dims_sizes=[list(t.size()) for t in flat],
        dynamic_dims_strides=[list(t.stride()) for t in flat],
    )


def _pick_guard() -> Callable[[Sequence[torch.Tensor]], Any]:
    try:
        probe = [torch.zeros(2), torch.zeros(3, 2).t()]
        guard = _torch_guard(probe)
        if guard.check(*probe) and not guard.check(probe[0], probe[1].t()) and not guard.check(probe[1], probe[0]):
            return _torch_guard
    except Exception:  # a private torch API: any failure means "use the portable guard"
        pass
    return _PyGuard


#: How guards are made (tests switch it to ``_PyGuard`` to cover the portable path too).
make_guard: Callable[[Sequence[torch.Tensor]], Any] = _pick_guard()

_cache: OrderedDict[tuple, Any] = OrderedDict()


def clear() -> None:
    """Forget every cached plan (tests; a plan is never wrong, only possibly unused)."""
    _cache.clear()


def _ptr_or_none(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _present(row: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    return [t for t in row if t is not None]


class _Entry:
    """A cached plan, its guard (None until the key is seen again) and, for specs with loose rows, the loose
    rows' addresses at the last hit and what the overlap test needs (:func:`_loose_spans`)."""

    __slots__ = ("guard", "loose", "made", "spans", "token")

    def __init__(self, made: Plan, guard: Any, loose: tuple | None, spans: tuple | None, token: object) -> None:
        self.made, self.guard, self.loose, self.spans, self.token = made, guard, loose, spans, token


_local = threading.local()


class vouched:
    """``with vouched(token, lists):`` the caller vouches that, in this thread and until the block ends, the
    tensors in ``lists`` (the very list objects, compared by identity) have the metadata (dtype, shape, strides,
    device, dispatch keys) that ``token`` stands for: it has just checked them with its own guard (an
    optimizer's per-group verdict, ``fp16kit/optim/_base.py``). A plan for exactly those lists whose entry was
    made or last guard-checked under the same token then skips its own metadata guard (the same tensors' metadata
    checked twice per step); the address key and the loose-row test still run. ``token`` must be an object that
    changes whenever the metadata it stands for changes (a new verdict object per full check)."""

    __slots__ = ("lists", "prev", "token")

    def __init__(self, token: object, lists: Sequence[Sequence[torch.Tensor | None]]) -> None:
        self.token, self.lists = token, tuple(lists)

    def __enter__(self) -> None:
        self.prev = getattr(_local, "vouch", None)
        _local.vouch = self

    def __exit__(self, *exc: object) -> None:
        _local.vouch = self.prev


def _vouch_token(rows: Sequence[Sequence[torch.Tensor | None]]) -> object:
    v = getattr(_local, "vouch", None)
    if v is None or len(rows) > len(v.lists) or not all(map(operator.is_, rows, v.lists)):
        return None
    return v.token


def plan(
    spec: Spec,
    rows: Sequence[Sequence[torch.Tensor | None]],
    extra: tuple | None = None,
    aux: tuple[torch.Tensor, ...] = (),
    aux_key: object = None,
    check_aux: Callable[[torch.device | None], None] | None = None,
) -> Plan:
    """The validated plan for ``rows`` (cached; see the module docstring).

    ``extra``: an optional per-position key (e.g. SGD's "first use of the momentum buffer" flags) that splits
    groups further; it is part of the cache key. Raises the validation errors of ``_checks`` on a miss; a list
    that is not a list or tuple is validated (and converted) every call.

    ``aux``: the call's other tensor arguments (flags, scales), validated by ``check_aux(device)`` whenever the
    plan is not a hit; their metadata joins the hit's guard, so a hit means they passed that check with the
    same dtype, shape and device (``aux_key`` tells apart calls whose ``aux`` mean different arguments).
    """
    opt = spec.optional
    for r, row in enumerate(rows):
        if row.__class__ is not list and row.__class__ is not tuple and r != opt:
            check_tensor_list(spec.fn, spec.names[r], row)  # raises for a single tensor
            return _checked(_make(spec, [list(x) for x in rows], extra), check_aux)
    first = rows[0]
    if not first and all(not row for row in rows):
        return _checked(_EMPTY, check_aux)
    loose = spec.loose
    try:
        ptrs = tuple(
            len(row) if r in loose else tuple(map(_data_ptr, row) if r != opt else map(_ptr_or_none, row))
            for r, row in enumerate(rows)
        )
        device = first[0].device
    except (TypeError, AttributeError, IndexError, RuntimeError):
        # Not tensors, unpaired rows, tensors without storage (sparse): the full checks say what is wrong
        # (and a valid list that has no addresses is planned every call, uncached).
        return _checked(_make(spec, rows, extra), check_aux)
    backend = select_backend(device).backend
    key = (spec, backend, extra, aux_key, ptrs)
    entry = _cache.get(key)
    token = None if aux else _vouch_token(rows)
    if entry is not None and entry.guard is not None:
        try:
            if _hit(entry, rows, opt, ptrs, aux, loose, token):
                stats["hits"] += 1
                return entry.made
        except (TypeError, AttributeError, RuntimeError):
            pass  # a loose row or an aux argument that is not a tensor (the portable guard raises): the full checks
    made = _checked(_make(spec, rows, extra, backend), check_aux)
    # The guard (about 1 us per tensor to build) is made on the second sighting of a key: lists that never come
    # back (grads re-allocated at new addresses every step) pay the validation only.
    guard = None if entry is None else make_guard([*_flat(rows, opt, ptrs), *aux])
    spans = _loose_spans(spec, rows, made) if loose else None
    _cache[key] = _Entry(made, guard, _loose_ptrs(rows, loose) if loose else None, spans, token)
    _cache.move_to_end(key)
    while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
    return made


def _hit(entry: _Entry, rows: Sequence, opt: int | None, ptrs: tuple, aux: tuple, loose: tuple, token: object) -> bool:
    """Does the cached entry (its key matched) hold for this call? The guard, or the caller's vouch under the
    entry's token, for the metadata; for loose rows, their addresses unchanged or apart from every written span."""
    if not ((token is not None and entry.token is token) or entry.guard.check(*_flat(rows, opt, ptrs), *aux)):
        return False
    if token is not None:
        entry.token = token  # the guard passed, or vouched for by the same token: the metadata is the token's
    if not loose:
        return True
    now = _loose_ptrs(rows, loose)
    if now == entry.loose:
        return True
    if not _apart(entry.spans, now):
        return False
    entry.loose = now
    for g in entry.made.kernel:  # the recorded tables hold the old addresses: record anew
        g.tape = Tape()
    return True


def _checked(made: Plan, check_aux: Callable[[torch.device | None], None] | None) -> Plan:
    if check_aux is not None:
        check_aux(made.device)
    return made


def _loose_ptrs(rows: Sequence[Sequence[torch.Tensor | None]], loose: tuple[int, ...]) -> tuple:
    return tuple(tuple(map(_data_ptr, rows[r])) for r in loose)


#: Above this many tensors in a loose row, the overlap test runs as torch ops (a fixed ~10 us) instead of a
#: Python loop (~0.15 us per tensor).
_VECTOR_MIN = 64


def _loose_spans(spec: Spec, rows: Sequence[Sequence[torch.Tensor | None]], made: Plan) -> tuple | None:
    """What :func:`_apart` needs, from a validated call: the written tensors' byte spans sorted by start
    (``None`` when two of them interleave, e.g. ``x[0::2]`` and ``x[1::2]``: then the test cannot bisect and
    new loose addresses mean a full validation) and each loose tensor's byte extent (0 when empty). Extents
    follow from sizes, strides and dtype, which the guard pins, so they hold for every later hit."""
    if made.device is None:
        return None
    spans = []
    for r in spec.written:
        for t in rows[r]:
            if t is not None and t.numel():
                start = t.data_ptr()
                spans.append((start, start + _extent(t) * t.element_size()))
    spans.sort()
    if any(a[1] > b[0] for a, b in pairwise(spans)):
        return None
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    extents = tuple(tuple(_extent(t) * t.element_size() if t.numel() else 0 for t in rows[r]) for r in spec.loose)
    vectors = None
    if any(len(e) > _VECTOR_MIN for e in extents):
        vectors = (
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(ends, dtype=torch.int64),
            [torch.tensor(e, dtype=torch.int64) for e in extents],
        )
    return starts, ends, extents, vectors


def _apart(spans: tuple | None, loose_ptrs: tuple) -> bool:
    """No loose tensor (at its new address, with the extent the guard pinned) shares a byte with a written
    tensor. The written spans are sorted and disjoint, so for a loose span ``[s, e)`` only the last written span
    starting before ``e`` can reach into it. ``False`` means "run the full validation" (which names the
    problem, or finds e.g. an exact in-place pair that the span test alone cannot tell apart)."""
    if spans is None:
        return False
    starts, ends, extents, vectors = spans
    if not starts:
        return True
    for r, (ptrs, ext) in enumerate(zip(loose_ptrs, extents)):
        if len(ptrs) > _VECTOR_MIN:
            w_start, w_end, exts = vectors
            s = torch.tensor(ptrs, dtype=torch.int64)
            e = s + exts[r]
            j = torch.searchsorted(w_start, e).sub_(1)
            hit = (j >= 0) & (w_end[j.clamp_(min=0)] > s) & (exts[r] > 0)
            if hit.any():
                return False
            continue
        for s, n in zip(ptrs, ext):
            if n:
                j = bisect_left(starts, s + n) - 1
                if j >= 0 and ends[j] > s:
                    return False
    return True


def _flat(rows: Sequence[Sequence[torch.Tensor | None]], opt: int | None, ptrs: tuple) -> Any:
    """Every tensor of ``rows`` in one iterable (C-level chaining; ``None`` entries of the optional row left out)."""
    if opt is None or None not in ptrs[opt]:
        return chain.from_iterable(rows)
    return chain.from_iterable(row if r != opt else _present(row) for r, row in enumerate(rows))


def _make(
    spec: Spec,
    rows: Sequence[Sequence[torch.Tensor | None]],
    extra: tuple | None = None,
    backend: Backend | None = None,
) -> Plan:
    """Validate ``rows`` and group their positions (the cache miss)."""
    stats["plans"] += 1
    fn, names, opt = spec.fn, spec.names, spec.optional
    lists: list[list] = []
    for r, row in enumerate(rows):
        if r == opt:
            if isinstance(row, torch.Tensor):
                raise TypeError(f"{fn}: {names[r]} must be a list of tensors (or None entries), got a single tensor.")
            row = list(row)
            check_tensor_list(fn, names[r], _present(row))
            lists.append(row)
        else:
            allow = spec.state_dtypes if r in spec.state_rows else frozenset()
            lists.append(check_tensor_list(fn, names[r], row, allow))
    for r in range(1, len(lists)):
        if r == opt:
            _check_optional_pairs(fn, names[0], lists[0], names[r], lists[r])
        else:
            check_pairs(fn, names[0], lists[0], names[r], lists[r])
    present = [lists[r] if r != opt else _present(lists[r]) for r in range(len(lists))]
    device = common_device(fn, *present)
    if device is None:
        return _EMPTY
    _check_writes(spec, present)
    if backend is None:
        backend = select_backend(device).backend
    made = Plan(device)
    reads = [present[r] for r in range(len(present)) if r not in spec.written]
    made.neg_inputs = any(t.is_neg() for row in reads for t in row)
    _group(spec, lists, extra, backend is not Backend.TORCH, made)
    return made


def _check_optional_pairs(fn: str, a_name: str, a: list, b_name: str, b: list) -> None:
    if len(a) != len(b):
        raise ValueError(f"{fn}: {b_name} has {len(b)} entries but {a_name} has {len(a)}; they must pair up.")
    for i, (x, y) in enumerate(zip(a, b)):
        if y is not None and y.shape != x.shape:
            raise ValueError(
                f"{fn}: {b_name}[{i}] has shape {tuple(y.shape)} but {a_name}[{i}] has shape {tuple(x.shape)}."
            )


def _check_writes(spec: Spec, present: list[list[torch.Tensor]]) -> None:
    """The written rows against each other and the read rows (``_checks.check_writes``). One written row and at
    most one read row keep their own names in messages; several are numbered row by row."""
    written, names = spec.written, spec.names
    if not written:
        return
    reads = [r for r in range(len(present)) if r not in written]
    if len(written) == 1 and len(reads) <= 1:
        w = written[0]
        if reads:
            check_writes(spec.fn, names[w], present[w], names[reads[0]], present[reads[0]])
        else:
            check_writes(spec.fn, names[w], present[w])
        return
    fn = (
        f"{spec.fn} (written rows {', '.join(names[r] for r in written)} and read rows "
        f"{', '.join(names[r] for r in reads)}, numbered row after row)"
    )
    check_writes(
        fn, "written", [t for r in written for t in present[r]], "read", [t for r in reads for t in present[r]]
    )


def _group(spec: Spec, lists: list[list], extra: tuple | None, triton_ok: bool, made: Plan) -> None:
    """Positions grouped by dtype combination: kernel groups (Triton allowed; every tensor of the position
    contiguous fp16/bf16/fp32, state rows fp32, non-empty) and fallback groups. One plain loop (a miss only)."""
    n = len(lists[0])
    kernel: dict[object, list[int]] = {}
    rest: dict[object, list[int]] = {}
    ok = _KERNEL_DTYPES
    for i in range(n):
        x = lists[0][i]
        tail = () if extra is None else (extra[i],)
        empty = x.numel() == 0
        if empty and not spec.keep_empty:
            continue
        row = [lst[i] for r, lst in enumerate(lists) if lst[i] is not None and r not in spec.state_rows]
        fits = (
            triton_ok
            and not empty
            and all(t.dtype in ok and t.is_contiguous() for t in row)
            and all(lists[s][i].dtype in spec.state_dtypes and lists[s][i].is_contiguous() for s in spec.state_rows)
        )
        if fits:
            key = tuple(None if lists[r][i] is None else lists[r][i].dtype for r in spec.key_rows) + tail
            kernel.setdefault(key, []).append(i)
        else:
            if spec.math_key:
                key = (_F64 if x.dtype == _F64 else _F32, *tail)
            else:
                key = tuple(None if lists[r][i] is None else lists[r][i].dtype for r in spec.key_rows) + tail
            rest.setdefault(key, []).append(i)
    made.kernel = [Group(idx, key, n) for key, idx in kernel.items()]
    made.rest = [Group(idx, key, n) for key, idx in rest.items()]
