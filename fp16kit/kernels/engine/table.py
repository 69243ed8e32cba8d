"""Address tables: how one Triton launch walks a whole list of tensors.

A multi-tensor kernel gets, instead of one pointer, an int64 tensor of ``data_ptr()`` values (one row
per tensor list, e.g. row 0 = inputs, row 1 = outputs) and a *chunk map*: chunk ``c`` covers elements
``[chunk_start[c], chunk_start[c] + BLOCK)`` of tensor ``chunk_tensor[c]``. A fixed ("persistent") grid
of programs strides over the chunks, so a list of 390 tensors costs one launch per dtype group, and a
list of tiny tensors does not become a huge grid.

Tables are cached by the tensors' addresses and sizes. Parameters and optimizer state never move, so
their tables are built once; gradients re-allocated after ``zero_grad(set_to_none=True)`` get new
addresses, which is a cache miss, never a stale table.

No host sync, hit or miss (docs/kernels.md, "GPU readiness"): a table is packed on the host, in pinned memory,
and uploaded with one non-blocking copy (:func:`upload`); the pinned buffer is kept in the table, so it outlives
the copy. The cache holds ``CACHE_SIZE`` tables, far more than the (parameter group x dtype) lists of a model,
so a steady training step builds none.

CUDA graphs: a captured kernel keeps the table's device addresses. So a table build during stream capture is an
error (run one eager step before capturing, which builds every table), and a table used during capture is
*held*: the LRU never evicts it (it would free memory that replays still read) until
:func:`release_graph_tables` is called, after the graphs that use it are deleted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "ChunkTable",
    "Tape",
    "chunk_table",
    "group_by",
    "index_tensor",
    "num_programs",
    "playing",
    "release_graph_tables",
    "triton_dtype",
    "upload",
    "verify_rows",
]

#: Elements per chunk. Large blocks suit both targets: on a GPU 4096 elements keep every warp busy
#: with 16-32 B per thread per tensor; in the interpreter the cost is per program and per loop
#: iteration, nearly independent of block size.
BLOCK = 4096

#: Programs in the persistent grid under the interpreter: each costs ~20 ms there. Two (not one) so
#: that the cross-program paths (atomics, per-chunk partials) are exercised by CPU tests too.
INTERPRETER_PROGRAMS = 2

#: Tables kept by the LRU cache. A table is a few int64s per tensor and chunk, so 1024 of them cost little
#: memory, and no realistic model has that many (parameter group x dtype x call site) lists: a step over more
#: than the old limit of 64 missed on every call.
CACHE_SIZE = 1024


@dataclass(frozen=True)
class ChunkTable:
    """Device-side description of ``num_lists`` parallel tensor lists cut into ``BLOCK``-sized chunks.

    ``ptrs[l * num_tensors + t]`` is the address of tensor ``t`` of list ``l``.
    """

    ptrs: torch.Tensor  # int64 [num_lists * num_tensors]
    numels: torch.Tensor  # int64 [num_tensors]
    chunk_tensor: torch.Tensor  # int32 [num_chunks]
    chunk_start: torch.Tensor  # int64 [num_chunks]
    chunk_counts: torch.Tensor  # int64 [num_tensors]: chunks per tensor, for per-tensor reductions
    first_chunk: torch.Tensor  # int64 [num_tensors]: index of each tensor's first chunk
    num_tensors: int
    num_chunks: int
    block: int
    aligned: bool  # every address is a multiple of 16 bytes: kernels may use 16-byte vector loads
    host: torch.Tensor | None = None  # the pinned source of the (non-blocking) upload, alive as long as the table
    #: Device buffers that live as long as the table (made at first use, never inside a step after that): the
    #: ticket counter and per-tensor chunk counters of the kernels that finish a step on the device
    #: (``fp16kit/kernels/engine/step_scalars.py``), which leave them zeroed after every launch.
    scratch: dict = field(default_factory=dict, compare=False, repr=False)

    def leading_args(self) -> tuple:
        """The table's kernel arguments, in the order every chunked kernel takes them first."""
        return (self.ptrs, self.num_tensors, self.numels, self.chunk_tensor, self.chunk_start, self.num_chunks)

    def scratch_buffer(self, name: str, numel: int, dtype: torch.dtype, *, zero: bool = False) -> torch.Tensor:
        """The table's buffer ``name``: at least ``numel`` elements of ``dtype`` on the table's device, made once
        per size. A call that needs more than an earlier one under the same name (the same grads checked with and
        without a norm) gets a new buffer; the old one is kept alive with the table (a captured graph may still
        write it), never handed out again, and never written past its end."""
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            if buf is not None:
                self.scratch.setdefault("retired", []).append(buf)
            make = torch.zeros if zero else torch.empty
            buf = self.scratch[name] = make(max(numel, 1), dtype=dtype, device=self.ptrs.device)
        return buf

    def scratch_ticket(self) -> torch.Tensor:
        """The int32 ticket counter of the launches over this table (zero between launches)."""
        return self.scratch_buffer("ticket", 1, torch.int32, zero=True)


_tables: OrderedDict[tuple, ChunkTable] = OrderedDict()
#: Counters read by tests and the host-cost benchmark: tables built (cache misses), tables handed out from a tape.
stats = {"builds": 0, "tape_hits": 0}


@dataclass(eq=False)
class Tape:
    """The tables one planned group of launches used, in call order (``fp16kit/kernels/engine/plan.py``).

    A cached plan owns one tape per kernel group. While the tape plays (:func:`playing`), :func:`chunk_table`
    hands out the recorded table for a call with the same shape (number of rows, tensors per row, block, written
    rows) without computing the cache key, which costs several tensor attribute reads per tensor. That is only
    sound because the planner plays a tape solely for the very tensors it fingerprinted when it recorded it
    (same addresses, sizes, strides, dtypes: the plan cache's key); a call with other tensors records anew.
    """

    entries: list[tuple[tuple, tuple, ChunkTable]] = field(default_factory=list)


_local = threading.local()


class playing:
    """``with playing(tape):`` the launches inside record into / replay from ``tape`` (this thread only)."""

    __slots__ = ("tape",)

    def __init__(self, tape: Tape | None) -> None:
        self.tape = tape

    def __enter__(self) -> None:
        _local.tape, _local.pos = self.tape, 0

    def __exit__(self, *exc: object) -> None:
        _local.tape = None
#: Tables (and index tensors) used during CUDA graph capture: out of the caches' reach until
#: release_graph_tables().
_graph_tables: dict[tuple, object] = {}


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never on other devices)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def chunk_table(
    lists: Sequence[Sequence[torch.Tensor]], block: int = BLOCK, *, written: tuple[int, ...] = ()
) -> ChunkTable:
    """The (cached) table for parallel lists of contiguous tensors on one device.

    All lists have the same length, tensor ``t`` has the same number of elements in each list, and each list
    has one dtype. A kernel walks ``numels[t]`` elements from every row's address: these conditions are what
    keeps it inside the tensors' storage, so they are verified (:func:`verify_rows`) whenever a table is built.
    ``written`` names the rows the kernel writes: no element of them may be shared by two entries, nor with a
    read row other than as the identical in-place view (``_checks.check_writes``), because two programs would
    race on it. The cache key holds every tensor's address, size, dtype and contiguity (and ``written``), so a
    hit was verified too.

    Raises ``RuntimeError`` for a build during CUDA graph capture; a table used during capture is held until
    :func:`release_graph_tables` (module docstring). Inside ``with playing(tape):`` (a cached plan's launches,
    ``fp16kit/kernels/engine/plan.py``) the table recorded on the tape for this call is handed out without computing
    the key; a call of another shape records anew.
    """
    tape: Tape | None = getattr(_local, "tape", None)
    if tape is not None:
        sig = (len(lists), len(lists[0]), block, written)
        pos = _local.pos
        _local.pos = pos + 1
        if pos < len(tape.entries) and tape.entries[pos][0] == sig:
            _, key, table = tape.entries[pos]
            stats["tape_hits"] += 1
            if _capturing(key[0]):
                _graph_tables[key] = table
            return table
        key, table = _lookup(lists, block, written)
        del tape.entries[pos:]
        tape.entries.append((sig, key, table))
        return table
    return _lookup(lists, block, written)[1]


def _lookup(
    lists: Sequence[Sequence[torch.Tensor]], block: int, written: tuple[int, ...]
) -> tuple[tuple, ChunkTable]:
    """``(key, table)``: the cached table for ``lists``, built (and verified) on a miss."""
    first = lists[0]
    device = first[0].device
    # The list structure is part of the key: the flat address tuple of two lists of one tensor equals that of one
    # list of two tensors, and a table read with the wrong ``num_tensors`` takes a numel for an address.
    key = (
        device,
        block,
        written,
        len(first),
        tuple((t.data_ptr(), t.numel(), t.dtype, t.is_contiguous()) for tensors in lists for t in tensors),
    )
    capturing = _capturing(device)
    table = _tables.get(key) or _graph_tables.get(key)
    if table is None:
        if capturing:
            raise RuntimeError(_CAPTURE_ERROR.format(what="an address table"))
        verify_rows(lists, device, written)
        table = _build(lists, block, device)
        stats["builds"] += 1
        _tables[key] = table
    else:
        _tables[key] = table
        _tables.move_to_end(key)
    if capturing:
        _graph_tables[key] = table
    while len(_tables) > CACHE_SIZE:
        _tables.popitem(last=False)
    return key, table


_CAPTURE_ERROR = (
    "fp16kit: {what} would be built during CUDA graph capture (a host-to-device copy from a host buffer that "
    "replays would not refresh). Run one step eagerly before capturing so that every table exists, and capture "
    "with the same tensors (no re-allocated grads: zero_grad(set_to_none=False))."
)
_indices: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}


def index_tensor(idx: Sequence[int], device: torch.device) -> torch.Tensor:
    """``idx`` as an int64 tensor on ``device``, uploaded once (:func:`upload`, no host sync) and cached, so that
    a repeated call (e.g. ``l2norm`` scattering a mixed-dtype list's groups) copies nothing. The same capture
    rules as :func:`chunk_table`: a miss during CUDA graph capture raises, a hit is held for the graph."""
    key = (device, tuple(idx))
    hit = _indices.get(key) or _graph_tables.get(key)
    if hit is None:
        if _capturing(device):
            raise RuntimeError(_CAPTURE_ERROR.format(what="an index tensor"))
        if len(_indices) >= CACHE_SIZE:
            _indices.clear()
        hit = _indices[key] = upload(list(idx), device)
    if _capturing(device):
        _graph_tables[key] = hit
    return hit[0]


def release_graph_tables() -> int:
    """Let the LRU cache evict the tables held for captured CUDA graphs again; call it once the graphs that
    used them are deleted. Returns how many were held."""
    count = len(_graph_tables)
    _graph_tables.clear()
    return count


def upload(values: list[int] | torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``values`` (a list of ints or a CPU tensor) on ``device`` without a host sync, and its pinned host source.

    A ``.to("cuda")`` of pageable memory makes torch synchronize the stream after the copy; a non-blocking copy
    from pinned memory does not. Keep the returned host tensor alive until the copy is done (a table keeps it for
    its lifetime; torch's pinned-memory allocator also holds the block until the copy's stream passes it).
    Returns ``(device_tensor, None)`` for a non-CUDA device (the copy is synchronous there anyway).
    """
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device), None
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True), host


def verify_rows(
    lists: Sequence[Sequence[torch.Tensor]], device: torch.device, written: tuple[int, ...] = ()
) -> None:
    """What the address table relies on, checked before any launch: parallel lists of equal length; tensor ``t``
    has the same number of elements in every list; one dtype per list; one device; contiguous tensors; rows in
    ``written`` share no element with each other or with a read row, except as the identical in-place view. A
    violation is a bug in the caller (the public ops route other layouts to the torch fallback), reported as a
    ``ValueError`` instead of a kernel reading or writing outside a tensor or two programs racing."""
    first = lists[0]
    for r, tensors in enumerate(lists):
        if len(tensors) != len(first):
            raise ValueError(f"address table: list {r} has {len(tensors)} tensors but list 0 has {len(first)}.")
        dtype = tensors[0].dtype if tensors else None
        for t, (x, ref) in enumerate(zip(tensors, first)):
            problem = None
            if x.numel() != ref.numel():
                problem = f"has {x.numel()} elements but list 0's tensor has {ref.numel()}"
            elif x.dtype != dtype:
                problem = f"has dtype {x.dtype} but the list's dtype is {dtype}"
            elif x.device != device:
                problem = f"is on {x.device}, not {device}"
            elif not x.is_contiguous():
                problem = f"is not contiguous (strides {x.stride()})"
            if problem:
                raise ValueError(
                    f"address table: list {r}, tensor {t} {problem}; a kernel would address memory outside it. "
                    f"Route such tensors to the torch fallback, or fix the caller's pairing."
                )
    if written:
        from .checks import check_writes

        # One check over all rows (entries numbered row-major): the written entries against each other and against
        # the read rows; a read row that is a written row's own list (a placeholder row) is that row, not a reader.
        reads = [q for q in range(len(lists)) if q not in written and all(lists[q] is not lists[r] for r in written)]
        fn = f"address table (rows {list(written)} written, rows {reads} read, {len(first)} tensors per row)"
        check_writes(
            fn, "written", [x for r in written for x in lists[r]], "read", [x for q in reads for x in lists[q]]
        )


def _build(lists: Sequence[Sequence[torch.Tensor]], block: int, device: torch.device) -> ChunkTable:
    num_tensors = len(lists[0])
    ptrs = torch.tensor([t.data_ptr() for tensors in lists for t in tensors], dtype=torch.int64)
    numels = torch.tensor([t.numel() for t in lists[0]], dtype=torch.int64)
    counts = (numels + block - 1) // block
    chunk_tensor = torch.repeat_interleave(torch.arange(num_tensors, dtype=torch.int32), counts)
    first_chunk = torch.cumsum(counts, 0) - counts
    chunk_start = (torch.arange(int(counts.sum()), dtype=torch.int64) - first_chunk[chunk_tensor.long()]) * block
    # One non-blocking host-to-device copy per table from pinned memory (no host sync); tables are cached.
    packed, host = upload(torch.cat([ptrs, numels, chunk_start, counts, first_chunk, chunk_tensor.long()]), device)
    n_ptrs, n_chunks = ptrs.numel(), chunk_start.numel()
    ptrs_d, rest = packed[:n_ptrs], packed[n_ptrs:]
    numels_d, rest = rest[:num_tensors], rest[num_tensors:]
    chunk_start_d, rest = rest[:n_chunks], rest[n_chunks:]
    counts_d, rest = rest[:num_tensors], rest[num_tensors:]
    first_d, chunk_tensor_d = rest[:num_tensors], rest[num_tensors:].int()
    return ChunkTable(
        ptrs=ptrs_d,
        numels=numels_d,
        chunk_tensor=chunk_tensor_d,
        chunk_start=chunk_start_d,
        chunk_counts=counts_d,
        first_chunk=first_d,
        num_tensors=num_tensors,
        num_chunks=n_chunks,
        block=block,
        aligned=bool((ptrs % 16 == 0).all()),
        host=host,
    )


#: The optimizer-step kernels' launch configuration on a GPU (the check/norm pass, unscale, Adam, LAMB): chunks of
#: 2048 elements, 8 warps, 16 programs per multiprocessor. Chosen by ``benchmarks/gpu_tune.py`` on an H200 (torch
#: 2.11, Triton 3.6), where it beat the former 4096 / 16 warps / 8 per SM on every case: FusedLAMB's BERT-large step
#: 5.35 -> 4.49 ms, with fp16 masters 6.62 -> 5.40 ms, FusedAdam's 3.53 -> 3.25 ms (fp16 masters), 2.89 -> 2.87 ms
#: (fp32), unscale in place 0.96 -> 0.83 ms (docs/benchmarks.md). Elementwise results do not depend on it; norms and
#: LAMB's per-tensor sums are grouped by chunk, so their last bits may. The interpreter (CPU) keeps ``BLOCK``.
STEP_BLOCK_GPU = 2048
STEP_WARPS_GPU = 8
STEP_PROGRAMS_PER_SM = 16


def step_block(device: torch.device) -> int:
    """The chunk size of the optimizer-step kernels' tables on ``device``."""
    return BLOCK if device.type == "cpu" else STEP_BLOCK_GPU


def num_programs(device: torch.device, num_chunks: int, per_sm: int = 8) -> int:
    """Size of the persistent grid: enough programs to fill the GPU (``per_sm`` per multiprocessor), few under the
    interpreter."""
    if device.type == "cpu":
        return max(1, min(num_chunks, INTERPRETER_PROGRAMS))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(num_chunks, sms * per_sm))


def group_by(keys: Sequence[object]) -> dict[object, list[int]]:
    """Indices grouped by key, in first-seen order (one launch per dtype combination)."""
    groups: dict[object, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return groups


def triton_dtype(dtype: torch.dtype):  # -> tl.dtype (triton imported lazily)
    """The ``triton.language`` dtype for a torch float dtype."""
    import triton.language as tl

    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]
