"""bf16 weights without an fp32 master: the two write epilogues of the Adam and LAMB kernels, and their torch twins.

An optimizer with ``master_weights="split"`` or ``"stochastic"`` (docs/optim.md, "bf16 weights without fp32
masters") updates bf16 params with the same fp32 math as every other mode; only how the fp32 result is kept differs.
The kernels select it with the constexpr ``EPILOGUE.WEIGHTS`` (:class:`Epilogue`: :data:`PLAIN`, :data:`SPLIT`,
:data:`STOCHASTIC`); the torch fallback calls the functions of the second half of this module. Both write the same bits
for the same fp32 values.

**Split ("16+16").** The fp32 master ``x`` is kept as two 16-bit halves: the bf16 param ``hi`` and an int16 state
``lo`` (``state["master_low"]``)::

    bits = bitcast<uint32>(x)
    hi   = (bits + 0x8000) >> 16          # round to nearest, ties away from zero (in magnitude)
    lo   = int16(bits - (hi << 16))       # the signed remainder, in [-32768, 32767]: exactly bits & 0xFFFF
    x    = bitcast<fp32>((hi << 16) + lo) # reassembly (uint32 arithmetic)

Why this rounding: truncation (``hi = bits >> 16``) is exact too but gives the forward pass weights up to one bf16
ulp off; round-to-nearest-*even* is not exact in 16 bits (its remainder takes the 2^16 + 1 values
``-32768 .. 32768`` at ties), round-to-nearest with ties away from zero takes exactly 2^16. So ``hi`` is
``x.to(torch.bfloat16)`` except at exact ties (low half ``0x8000``, where both neighbours are equally near), and the
reassembled master is ``x`` bit for bit for every non-NaN ``x`` (±0, subnormals, ±inf, the largest finite value:
tested with Hypothesis over random patterns and an edge list). Exceptions, the same as ``x.to(torch.bfloat16)``'s:
``|x|`` within half a bf16 ulp of fp32's top (above 3.3961e38) gives ``hi = ±inf`` (``lo`` still restores ``x``);
a NaN ``x`` is written as the canonical NaN ``0x7FC0`` with ``lo = 0`` (its payload is not kept).

**Stochastic rounding.** No master: ``x`` is rounded to one of its two bf16 neighbours, up (in magnitude) with
probability ``(bits & 0xFFFF) / 2^16``, so ``E[hi] = x`` exactly within a binade::

    w   = philox4x32_10(key=seed, counter=(e // 8, row, stream, step))     # 4 words of 32 bits
    r   = 16-bit half (e % 2) of word w[(e // 2) % 4]                        # e: the element's index
    hi  = (bits + r) >> 16                # NaN -> 0x7FC0; bf16 values (low half 0) never move

Counter words: ``e // 8`` (low 32 bits; one counter serves 8 elements), ``row`` the tensor's position in the
update call's lists, ``stream`` the param group's index (plus the counter's high bits times 2^16), ``step``
the number of the step being taken (the group's device step counter: it advances only when the step is not
skipped, so a skipped step draws nothing new, and a checkpoint's counter resumes the stream). Philox4x32-10
(Salmon et al., SC'11) is Triton's ``tl.philox``; :func:`philox_uint32` computes the same words in int64 torch ops.

``e`` is the element's index in the *whole* tensor: an FSDP2 shard (a contiguous range of its flattened tensor,
``Bf16Weights.offsets``) adds its first element's index to its local indices, so every rank draws exactly the bits
one process stepping the whole tensor draws (with the same rows: every rank updates the same param list).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..engine.skeleton import load_span, store_param, store_span, table_row
from ..fallback.step import Rows, _skip

__all__ = [
    "PLAIN",
    "SPLIT",
    "STOCHASTIC",
    "Bf16Weights",
    "Epilogue",
    "join_halves",
    "philox_uint32",
    "split_halves",
    "stochastic_round",
]

PLAIN = tl.constexpr(0)  #: the param (or fp32 master) rounded to nearest even, plus the model copy if any
SPLIT = tl.constexpr(1)  #: bf16 param = high half of the fp32 master, row 4 = its int16 low half
STOCHASTIC = tl.constexpr(2)  #: bf16 param stochastically rounded from the fp32 result

#: The address-table row of the low halves in split mode (the model-copy row, unused there).
LOW_ROW = tl.constexpr(4)

# Philox4x32 constants (Salmon et al.): the round multipliers and the Weyl key increments.
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUNDS = 10
_M32 = 0xFFFFFFFF


class Epilogue(NamedTuple):
    """The write epilogue's compile-time switches: one constexpr kernel argument ``EPILOGUE`` (a named tuple Triton
    specializes on; :func:`launch_arguments`). ``WEIGHTS``: :data:`PLAIN`, :data:`SPLIT` or :data:`STOCHASTIC`;
    ``ROW_IDX``: stochastic rounding reads the row table (:func:`row_table`). A new epilogue adds a mode or a field
    here, not a parameter to every kernel."""

    WEIGHTS: int = 0
    ROW_IDX: bool = False


@dataclass(frozen=True)
class Bf16Weights:
    """How an update writes its bf16 params (``master_weights="split"``/``"stochastic"`` of FusedAdam/FusedLAMB).

    ``mode``: ``"split"`` (the update's ``models`` row carries each bf16 param's int16 low half, viewed as bf16 so
    the planner's float checks apply: :func:`low_rows`) or ``"stochastic"``. ``seed`` (a 63-bit int), ``stream``
    (the param group's index) and ``step`` (the group's float32 ``[1]`` step counter) key the random bits of
    stochastic rounding (module docstring); unused in split mode."""

    mode: str
    seed: int = 0
    stream: int = 0
    step: torch.Tensor | None = None
    #: Per row of the update call: the index, in its whole flattened tensor, of the row's first element (an FSDP2
    #: shard's place in its param; stochastic rounding's ``e``); None: every row is a whole tensor (all 0).
    offsets: tuple[int, ...] | None = None

    def offset(self, row: int) -> int:
        """Row ``row``'s first element's index in its whole tensor."""
        return 0 if self.offsets is None else self.offsets[row]

    def epilogue(self, param_dtype: torch.dtype, has_rows: bool) -> int:
        """The kernel's ``EPILOGUE.WEIGHTS`` mode for a group of params of ``param_dtype`` (``has_rows``: low halves
        present): fp32 params in these modes are written plainly."""
        if self.mode == "split":
            return SPLIT.value if has_rows else PLAIN.value
        return STOCHASTIC.value if param_dtype == torch.bfloat16 else PLAIN.value


def epilogue_mode(weights: Bf16Weights | None, params: Sequence[torch.Tensor], has_rows: bool) -> int:
    """The ``EPILOGUE.WEIGHTS`` mode of a launch over ``params`` (one dtype) with or without row 4."""
    return PLAIN.value if weights is None else weights.epilogue(params[0].dtype, has_rows)


def launch_arguments(
    weights: Bf16Weights | None, params: Sequence[torch.Tensor], has_rows: bool, placeholder: torch.Tensor,
    row_idx: torch.Tensor | None,
) -> tuple[tuple, dict[str, Epilogue], bool]:
    """``(args, constexprs, writes_model)`` of the epilogue for one kernel launch: the epilogue bundle (the kernel
    argument ``weights``: ``seed, stream, rng_step_ptr, row_idx_ptr``), its switches ``{"EPILOGUE": Epilogue(...)}``
    and whether row 4 is a model copy (``has_rows`` and not split). ``row_idx``: the launch's row table
    (:func:`row_table`), or None (launch tensor ``t`` is row ``t`` of the call, a whole tensor). ``placeholder``: any
    device tensor, for pointers the epilogue does not read."""
    mode = epilogue_mode(weights, params, has_rows)
    stochastic = mode == STOCHASTIC.value
    step = weights.step if stochastic and weights.step is not None else placeholder
    use_idx = stochastic and row_idx is not None
    args = (weights.seed if stochastic else 0, weights.stream if stochastic else 0, step,
            row_idx if use_idx else placeholder)
    return args, {"EPILOGUE": Epilogue(mode, use_idx)}, has_rows and mode != SPLIT.value


def row_table(rows: Sequence[int], offsets: Sequence[int], device: torch.device) -> torch.Tensor:
    """The stochastic epilogue's row table of a launch: int64 ``[2 N]``, for launch tensor ``t`` its row in the update
    call (``[2 t]``) and its first element's index in its whole tensor (``[2 t + 1]``, :attr:`Bf16Weights.offsets`)."""
    pairs = [v for pair in zip(rows, offsets) for v in pair]
    return torch.tensor(pairs, dtype=torch.int64).to(device)


def low_rows(lows: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The int16 low halves as the bf16 views the update ops take in their ``models`` row (same storage)."""
    return [None if lo is None else lo.view(torch.bfloat16) for lo in lows]


# ---------------------------------------------------------------------------------------------------------------
# Triton device functions (called from triton/adam.py and triton/lamb.py under the EPILOGUE constexpr)


@triton.jit
def load_master(p, table, span, EPILOGUE: tl.constexpr, ALIGNED: tl.constexpr):
    """The fp32 value the update starts from: ``p`` (the widened param or master), or in split mode the master
    reassembled from ``p``'s bits (``hi << 16``, exact widening) and the low half in row 4."""
    if EPILOGUE.WEIGHTS == SPLIT:
        lo_ptr = table_row(table, LOW_ROW, span[0], tl.int16, ALIGNED)
        lo = load_span(lo_ptr, span).to(tl.int32).to(tl.uint32, bitcast=True)
        return (p.to(tl.uint32, bitcast=True) + lo).to(tl.float32, bitcast=True)
    else:
        return p


@triton.jit
def rng_step(weights, AHEAD: tl.constexpr, EPILOGUE: tl.constexpr):
    """The number of the step being taken, as a 32-bit counter word (stochastic rounding only; 0 otherwise, nothing
    read): the group's float32 counter (``weights[2]``, :func:`launch_arguments`), plus one (a float32 add, as the
    counter itself advances) when the launch runs before the counter advances (the device step), modulo ``2**32`` in
    64-bit integers (a checkpoint's counter may exceed ``2**31``), as the torch path takes it."""
    if EPILOGUE.WEIGHTS == STOCHASTIC:
        s = tl.load(weights[2])
        if AHEAD:
            s = s + 1.0
        return (s.to(tl.int64) & 0xFFFFFFFF).to(tl.uint32)
    else:
        return tl.full((), 0, tl.uint32)


@triton.jit
def _split_bits(x):
    bits = x.to(tl.uint32, bitcast=True)
    nan = x != x
    hi = tl.where(nan, 0x7FC0, (bits + 0x8000) >> 16)
    lo = tl.where(nan, 0, bits & 0xFFFF)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True), lo.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _stochastic_bits(x, seed, offs, row, stream, step):
    e = offs.to(tl.uint64)
    k = e >> 3  # one Philox counter per 8 elements: its 4 words are 8 halves of 16 bits
    r0, r1, r2, r3 = tl.philox(seed, k.to(tl.uint32), row, (stream + (k >> 32) * 65536).to(tl.uint32), step)
    odd_word = (e & 2) != 0
    word = tl.where((e & 4) != 0, tl.where(odd_word, r3, r2), tl.where(odd_word, r1, r0))
    r = tl.where((e & 1) == 0, word & 0xFFFF, word >> 16)
    bits = x.to(tl.uint32, bitcast=True)
    hi = tl.where(x != x, 0x7FC0, (bits + r) >> 16)
    return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def store_weights(table, span, p_ptr, p, weights, step, P_DTYPE: tl.constexpr, MODEL_DTYPE: tl.constexpr,
                  HAS_MODEL: tl.constexpr, ALIGNED: tl.constexpr, EPILOGUE: tl.constexpr):
    """Write the updated fp32 ``p``: plainly (``store_param``: round to nearest even, model copy), split into the
    bf16 param and its low half (row 4), or stochastically rounded to bf16 with the epilogue bundle ``weights``
    (:func:`launch_arguments`: ``seed, stream, step counter, row table``) and ``step`` (:func:`rng_step`): with
    ``EPILOGUE.ROW_IDX``, ``row_table[2 t]`` is the tensor's position in the update call and ``row_table[2 t + 1]`` its
    first element's index in its whole tensor (an FSDP2 shard's offset; ``row_table``), else ``t`` and 0 are."""
    t = span[0]
    if EPILOGUE.WEIGHTS == SPLIT:
        hi, lo = _split_bits(p)
        store_span(p_ptr, span, hi)
        store_span(table_row(table, LOW_ROW, t, tl.int16, ALIGNED), span, lo)
    elif EPILOGUE.WEIGHTS == STOCHASTIC:
        if EPILOGUE.ROW_IDX:  # a real branch: no load without the table
            row = tl.load(weights[3] + 2 * t).to(tl.uint32)
            e = span[1].to(tl.int64) + tl.load(weights[3] + 2 * t + 1)
        else:
            row = t.to(tl.uint32)
            e = span[1]
        store_span(p_ptr, span, _stochastic_bits(p, weights[0], e, row, weights[1], step))
    else:
        store_param(table, span, p_ptr, p, P_DTYPE, MODEL_DTYPE, HAS_MODEL, ALIGNED)


# ---------------------------------------------------------------------------------------------------------------
# The same rules in torch ops (the fallback; host helpers for checkpoints and tests)


def split_halves(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` of an fp32 tensor: the bf16 high half (round to nearest, ties away from zero) and the int16
    signed remainder, such that :func:`join_halves` gives ``master`` back bit for bit (NaN: canonical NaN, 0).

    On the 16-bit halves of the bits (in memory order ``[low, high]``: a little-endian host, as torch's own
    dtype views of these tensors assume): ``lo`` is the low half itself
    (``bits - (hi << 16)`` is the low half read as a signed int16), and ``hi = high + (lo < 0)``: adding ``0x8000``
    to the bits carries into the high half exactly when the low half is ``0x8000`` or more."""
    flat = master.contiguous().view(-1)
    halves = flat.view(torch.int16).view(-1, 2)
    nan = torch.isnan(flat)
    lo = torch.where(nan, 0, halves[:, 0])
    hi = torch.where(nan, 0x7FC0, halves[:, 1] + (halves[:, 0] < 0).to(torch.int16))
    return hi.view(torch.bfloat16).view(master.shape), lo.view(master.shape)


def join_halves(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master ``(hi << 16) + lo`` of a bf16 ``hi`` and its int16 low half ``lo`` (the uint32 sum of the
    bits): low half ``lo``, high half ``hi - (lo < 0)`` (the borrow of a negative remainder)."""
    lo16 = lo.contiguous().view(-1)
    high = hi.contiguous().view(torch.int16).view(-1) - (lo16 < 0).to(torch.int16)
    return torch.stack((lo16, high), dim=1).view(torch.int32).view(torch.float32).view(hi.shape)


def _mul_hi_lo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi32, lo32)`` of the 64-bit product of the constant ``a`` and ``x`` (uint32 values in int64): the int64
    product keeps all 64 bits (two's complement wrap-around; checked by the known-answer and kernel tests)."""
    prod = x * a
    return (prod >> 32) & _M32, prod & _M32


#: Elements per piece of :func:`philox_uint32`'s rounds: the piece's int64 temporaries stay in the L2 cache.
_PIECE = 1 << 15


def philox_uint32(seed: int, c0: torch.Tensor, c1: torch.Tensor | int, c2: torch.Tensor | int,
                  c3: torch.Tensor | int) -> torch.Tensor:
    """The four output words of Philox4x32-10 for key ``seed`` (64 bits: low word first) and counter
    ``(c0, c1, c2, c3)`` (uint32 values in int64 tensors or ints, broadcast to ``c0``'s shape), as Triton's
    ``tl.philox`` computes them: an int64 tensor of uint32 values, shape ``c0.shape + (4,)``."""
    c0 = torch.as_tensor(c0, dtype=torch.int64)
    words = [torch.as_tensor(c, dtype=torch.int64, device=c0.device).expand(c0.shape).reshape(-1)
             for c in (c0, c1, c2, c3)]
    out = torch.empty(c0.numel(), 4, dtype=torch.int64, device=c0.device)
    for start in range(0, c0.numel(), _PIECE):
        piece = [w[start : start + _PIECE] & _M32 for w in words]
        out[start : start + _PIECE] = torch.stack(_philox_rounds(seed, *piece), dim=1)
    return out.view(*c0.shape, 4)


def _philox_rounds(seed: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
                   c3: torch.Tensor) -> tuple[torch.Tensor, ...]:
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def stochastic_round(x: torch.Tensor, seed: int, row: int, stream: int, step: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) stochastically rounded to bf16 with the kernel's random bits (module docstring): ``row`` the
    tensor's position in the update call, ``stream`` the param group's index, ``step`` the step being taken (an
    integer-valued tensor, read on the device)."""
    return stochastic_round_list([x], seed, [row], stream, step)[0]


def stochastic_round_list(xs: Sequence[torch.Tensor], seed: int, rows: Sequence[int], stream: int,
                          step: torch.Tensor, offsets: Sequence[int] | None = None) -> list[torch.Tensor]:
    """:func:`stochastic_round` of every ``xs[i]`` (fp32, one device) with row counter ``rows[i]``: one Philox
    evaluation per 8 elements over the concatenated tensors (a fixed number of torch ops per call, not per
    tensor); element ``e`` takes 16-bit half ``e % 2`` of word ``(e // 2) % 4`` of counter ``e // 8``, where ``e``
    is the element's index in ``xs[i]`` plus ``offsets[i]`` (default 0: an FSDP2 shard's first element's index in
    its whole tensor, ``Bf16Weights.offsets``)."""
    numels = [x.numel() for x in xs]
    offsets = [0] * len(xs) if offsets is None else list(offsets)
    firsts = [o // 8 for o in offsets]  # the first counter of each range
    counters = [(o + n + 7) // 8 - f for o, n, f in zip(offsets, numels, firsts)]
    device = xs[0].device
    flat = torch.cat([x.reshape(-1) for x in xs]) if len(xs) > 1 else xs[0].reshape(-1)
    each = torch.tensor(counters, dtype=torch.int64, device=device)
    k = _local_index(counters, device)
    if any(firsts):
        k = k + torch.tensor(firsts, dtype=torch.int64).to(device).repeat_interleave(each)
    row = torch.tensor(list(rows), dtype=torch.int64).to(device).repeat_interleave(each)
    words = philox_uint32(seed, k, row, stream + (k >> 32) * 65536, step.reshape(()).to(torch.int64))
    # counter c, word w, half h is element 8 c + 2 w + h: row-major [counters, 4, 2] is the elements' order
    halves = torch.stack(((words & 0xFFFF).to(torch.int32), (words >> 16).to(torch.int32)), dim=2).view(-1)
    if len(xs) > 1 or any(offsets):
        starts = [8 * c + o % 8 for c, o in zip(itertools.accumulate([0, *counters[:-1]]), offsets)]
        halves = torch.cat([halves[a : a + n] for a, n in zip(starts, numels)])
    out = round_with_bits(flat, halves[: flat.numel()])
    return [o.view(x.shape) for o, x in zip(out.split(numels), xs)]


def _local_index(sizes: list[int], device: torch.device) -> torch.Tensor:
    """For the concatenation of ranges of ``sizes`` elements: each element's index in its range."""
    lengths = torch.tensor(sizes, dtype=torch.int64, device=device)
    starts = (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
    return torch.arange(sum(sizes), dtype=torch.int64, device=device) - starts


def round_with_bits(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """The stochastic-rounding rule with given random bits: ``x`` (fp32) to bf16, adding ``r16`` (uniform integers
    in ``[0, 2^16)``) to the low half of its magnitude's bits and truncating (NaN -> the canonical NaN). int32
    arithmetic on the bits: a negative value's bits are ``magnitude - 2^31`` there, and the sum stays below 2^31
    in magnitude for every non-NaN ``x``, so the arithmetic shift leaves the high half in the int16 range."""
    bits = x.contiguous().view(torch.int32).view(x.shape)
    hi = torch.where(torch.isnan(x), 0x7FC0, (bits + r16) >> 16).to(torch.int16)
    return hi.view(torch.bfloat16)


def fallback_step(
    step: Callable[[Rows], None],
    lists: tuple[Sequence[torch.Tensor], ...],
    models: Sequence[torch.Tensor | None],
    found_inf: torch.Tensor,
    weights: Bf16Weights,
    rows: Sequence[int],
) -> None:
    """A torch twin's step (``fallback/lamb.py``, ``fallback/adam.py``, ``state8/fallback.py``: ``step``, taking its
    rows as one bundle, :data:`fp16kit.kernels.fallback.step.Rows`; ``lists``: params, grads, exp_avgs,
    exp_avg_sqs) with the bf16 epilogue: the rows' fp32 values (the reassembled masters in split mode, the widened
    params when stochastic) are updated by the unchanged twin with no model copies, then written back by
    :func:`split_halves` or :func:`stochastic_round` (``rows[i]``: row ``i``'s position in the update call). The
    fp32 values are a temporary of the group (the twin's transient 4 B/param). A skipped step (``found_inf``)
    writes nothing (read on the host on the CPU, masked elsewhere)."""
    skip = _skip(found_inf, None)
    if skip is True:
        return
    params, rest = lists[0], lists[1:]
    mine, work = widen(weights, params, models)
    others = [None if weights.mode == "split" else m for m in models]
    step((work, *rest, others))
    write_back(weights, params, models, work, mine, rows, skip)


def widen(weights: Bf16Weights, params: Sequence[torch.Tensor],
          models: Sequence[torch.Tensor | None]) -> tuple[list[int], list[torch.Tensor]]:
    """``(mine, work)``: the rows the epilogue writes (:func:`epilogue_rows`) and each row's value to update: for
    those rows their fp32 value (the reassembled master, the widened param; new tensors), for the others the param
    itself."""
    split = weights.mode == "split"
    mine = epilogue_rows(weights, params, models)
    work = list(params)
    for i in mine:
        work[i] = join_halves(params[i], models[i].view(torch.int16)) if split else params[i].float()
    return mine, work


def epilogue_rows(weights: Bf16Weights, params: Sequence[torch.Tensor],
                  models: Sequence[torch.Tensor | None]) -> list[int]:
    """The rows the epilogue writes: split, the bf16 params with a low half in ``models``; stochastic, the bf16
    params (the others, fp32 params, are updated directly)."""
    if weights.mode == "split":
        return [i for i, m in enumerate(models) if m is not None]
    return [i for i, p in enumerate(params) if p.dtype == torch.bfloat16]


def write_back(weights: Bf16Weights, params: Sequence[torch.Tensor], models: Sequence[torch.Tensor | None],
               work: Sequence[torch.Tensor], mine: Sequence[int], rows: Sequence[int],
               skip: bool | torch.Tensor) -> None:
    """Rows ``mine`` of ``work`` (updated fp32 values, :func:`widen`) written into their bf16 params (and split mode's
    low halves) by :func:`split_halves` or :func:`stochastic_round_list` (``rows[i]``: row ``i``'s position in the
    update call, which with :attr:`Bf16Weights.offsets` keys the random bits). ``skip``: False, or a device flag
    (0-dim bool) under which every destination keeps its value."""
    if not mine:
        return
    if weights.mode == "split":
        dsts, news = [], []
        for i in mine:
            hi, lo = split_halves(work[i])
            dsts += [params[i], models[i].view(torch.int16)]
            news += [hi, lo]
    else:
        step = weights.step if weights.step is not None else torch.zeros(1, device=params[0].device)
        dsts = [params[i] for i in mine]
        news = stochastic_round_list([work[i] for i in mine], weights.seed, [rows[i] for i in mine], weights.stream,
                                     step, [weights.offset(rows[i]) for i in mine])
    for dst, new in zip(dsts, news):
        dst.copy_(new if skip is False else torch.where(skip, dst, new))
