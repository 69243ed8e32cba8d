"""8-bit moments (``state_bits=8``) of FSDP2 (DTensor) params: which params get them, and their DTensor layout.

FSDP2 shards a param on dim 0 the way ``torch.chunk`` does: with ``R`` rows of ``C`` elements over ``W`` ranks,
rank ``r`` holds rows ``[r c, (r + 1) c)`` (``c = ceil(R / W)``, clipped to ``R``: the last shards may be short
or empty), a contiguous range of the flattened tensor starting at element ``r c C``. When every such offset is a
multiple of the 256-element quantization block, a shard is quantized with the *same blocks* as the whole tensor,
so a shard's step is bit for bit the single-process step on its elements (docs/optim.md, "8-bit moments").

Layout of the state of an 8-bit DTensor param ``p`` (each a DTensor on ``p``'s mesh):

* ``exp_avg``/``exp_avg_sq``: uint8 codes shaped and placed like ``p``; the local shard is made by
  ``to_state8`` (its absmax follows it in one buffer, as the kernels need);
* ``exp_avg_absmax``/``exp_avg_sq_absmax``: the fp32 absmax of the local blocks, a view into that buffer, as a
  DTensor whose ``torch.chunk`` split gives each rank exactly its shard's blocks:

  - ``"rows"``: when ``C`` is a multiple of 256, shape ``(R, C / 256)`` placed like ``p`` (one row of absmax per
    row of ``p``: the same ``R`` rows chunked the same way, for any world size);
  - ``"flat"``: otherwise shape ``(ceil(R C / 256),)``, ``Shard(0)``, when its chunks match the shards' blocks
    (checked for every rank).

  Both hold the single-process absmax values in the single-process order (flattened), so ``full_tensor()`` and
  checkpoints (``torch.distributed.checkpoint``) see the whole tensor's absmax.

Which DTensor params keep fp32 moments although ``state8.uses_state8`` holds for the whole tensor: those with a
non-empty shard of fewer than ``SMALL_NUMEL`` elements (the kernels apply the small-tensor rule to the local
shard they step, so every rank must agree it is large). Refused (``ValueError`` at the first step, naming the
param): a shard offset that is not a multiple of 256, and an absmax that neither layout can chunk like the
shards. ``NotImplementedError``: a param sharded on another dim than 0.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from fp16kit.distributed import is_dtensor, local
from fp16kit.kernels import STATE8_BLOCK as QBLOCK
from fp16kit.kernels import STATE8_SMALL_NUMEL as SMALL_NUMEL
from fp16kit.kernels import dequantize_state8 as dequantize
from fp16kit.kernels import state8_absmax, to_state8
from fp16kit.kernels import state8_blocks as num_blocks

__all__ = ["dequantize_dtensor", "is_8bit_dtensor", "layout", "moment", "shard_ranges"]


def shard_ranges(dim0: int, row: int, world: int) -> list[tuple[int, int]]:
    """Per rank, the ``[start, stop)`` element range of FSDP2's dim-0 shard (``torch.chunk`` split)."""
    c = -(-dim0 // world) if dim0 else 0
    return [(min(r * c, dim0) * row, min((r + 1) * c, dim0) * row) for r in range(world)]


def _chunks(n: int, world: int) -> list[tuple[int, int]]:
    c = -(-n // world) if n else 0
    return [(min(r * c, n), min((r + 1) * c, n)) for r in range(world)]


@functools.lru_cache(maxsize=256)
def _layout(shape: tuple[int, ...], placements: tuple[Any, ...], mesh_shape: tuple[int, ...]) -> tuple[str, Any]:
    """``(kind, detail)``: ``("rows" | "flat", None)``, ``("fp32", smallest shard)``, ``("misaligned", (rank,
    offset, chunk))``, ``("unchunkable", None)`` or ``("dim", placement)``."""
    numel = 1
    for d in shape:
        numel *= d
    shard = [i for i, pl in enumerate(placements) if pl.is_shard()]
    bad = [pl for pl in placements if not (pl.is_replicate() or (pl.is_shard() and pl.dim == 0))]
    if bad or len(shard) > 1:
        return "dim", placements
    if not shard:
        return "rows" if len(shape) > 1 and (numel // shape[0]) % QBLOCK == 0 else "flat", None
    world = mesh_shape[shard[0]]
    row = numel // shape[0]
    ranges = shard_ranges(shape[0], row, world)
    sizes = [b - a for a, b in ranges if b > a]
    if min(sizes) < SMALL_NUMEL:
        return "fp32", min(sizes)
    for r, (a, b) in enumerate(ranges):
        if b > a and a % QBLOCK:
            return "misaligned", (r, a, ranges[0][1])
    if len(shape) > 1 and row % QBLOCK == 0:
        return "rows", None
    blocks = [(a // QBLOCK, -(-b // QBLOCK)) if b > a else None for a, b in ranges]
    chunks = [(a, b) if b > a else None for a, b in _chunks(num_blocks(numel), world)]
    return ("flat", None) if blocks == chunks else ("unchunkable", None)


def layout(fn: str, p: torch.Tensor, where: Callable[[], str]) -> str | None:
    """The absmax layout (``"rows"``/``"flat"``) of the DTensor param ``p``'s 8-bit moments, or None when its
    moments stay fp32 (a shard below ``SMALL_NUMEL`` elements). Raises for the refused cases (module docstring);
    ``where()`` names the param (``param_groups[g]['params'][i]``; called only for a message). Computed from the
    global shape, placements and mesh only, so every rank reaches the same verdict (none is left waiting in a
    collective)."""
    kind, detail = _layout(tuple(p.shape), tuple(p.placements), tuple(p.device_mesh.shape))
    if kind in ("rows", "flat"):
        return kind
    if kind == "fp32":
        return None
    shape, where = tuple(p.shape), where()  # type: ignore[assignment]
    if kind == "dim":
        raise NotImplementedError(
            f"{fn}: state_bits=8 with the DTensor param {where} (shape {shape}, placements {detail}) is not "
            f"supported: 8-bit moments of a sharded param need FSDP2's dim-0 sharding (Shard(0), optionally with "
            f"Replicate: HSDP). Use state_bits=32 for that param's group."
        )
    row = 1
    for d in shape[1:]:
        row *= d
    if kind == "misaligned":
        rank, offset, chunk = detail
        raise ValueError(
            f"{fn}: state_bits=8 cannot step the FSDP2 param {where} of shape {shape}: rank {rank}'s shard starts at "
            f"element {offset}, not a multiple of the {QBLOCK}-element quantization block, so its 8-bit blocks "
            f"would not be the unsharded tensor's. Each rank holds ceil(dim0 / world) = {chunk // max(row, 1)} "
            f"rows of {row} elements ({chunk} elements); choose a dim-0 size (or world size) whose per-rank chunk "
            f"times the row size is a multiple of {QBLOCK} (a row size that is a multiple of {QBLOCK} always "
            f"works), or use state_bits=32 for that param's group."
        )
    raise ValueError(
        f"{fn}: state_bits=8 cannot step the FSDP2 param {where} of shape {shape}: its rows of {row} elements are "
        f"not a multiple of {QBLOCK}, and its per-block absmax cannot be split over the ranks like its shards "
        f"(torch.chunk of {num_blocks(p.numel())} blocks). Use a row size that is a multiple of {QBLOCK}, another "
        f"world size, or state_bits=32 for that param's group."
    )


def _absmax_dtensor(codes_local: torch.Tensor, p: torch.Tensor, kind: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    absmax = state8_absmax(codes_local)
    if kind == "rows":
        shape = (p.shape[0], p.numel() // p.shape[0] // QBLOCK)
        absmax = absmax.view(codes_local.shape[0], shape[1])
    else:
        shape = (num_blocks(p.numel()),)
    placements = [Shard(0) if pl.is_shard() else Replicate() for pl in p.placements]
    return DTensor.from_local(absmax, p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=(shape[1], 1) if len(shape) == 2 else (1,))


def moment(p: torch.Tensor, kind: str, signed: bool, x: torch.Tensor | None = None,
           saved: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, absmax)`` DTensors of one 8-bit moment of the DTensor param ``p`` (module docstring): zero, or
    ``x`` (an fp32 DTensor placed like ``p``) quantized shard by shard, or ``saved`` (codes and absmax DTensors
    of this layout, from a checkpoint) copied exactly."""
    from torch.distributed.tensor import DTensor

    shard = local(p)
    if x is None:
        x = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
    codes = to_state8(local(x).float().contiguous().view(shard.shape), signed)
    if saved is not None:
        codes.copy_(local(saved[0]).reshape(shard.shape))
        state8_absmax(codes).copy_(local(saved[1]).reshape(-1))
    out = DTensor.from_local(codes, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return out, _absmax_dtensor(codes, p, kind)


def dequantize_dtensor(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of an 8-bit moment given as DTensors (codes and absmax of this module's layout): a DTensor
    placed like the codes."""
    from torch.distributed.tensor import DTensor

    values = dequantize(local(codes).contiguous(), local(absmax).contiguous().reshape(-1), signed)
    return DTensor.from_local(values, codes.device_mesh, codes.placements, run_check=False, shape=codes.shape,
                              stride=codes.stride())


def is_8bit_dtensor(t: Any) -> bool:
    """A DTensor of uint8 codes (an 8-bit moment of an FSDP2 param)."""
    return is_dtensor(t) and t.dtype == torch.uint8

