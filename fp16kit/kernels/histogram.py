"""``exponent_histogram``: how many elements of each tensor lie in each binade, in one launch per dtype.

The public op validates, plans (contiguous fp16/bf16/fp32 tensors to the Triton kernel in
``histogram_kernel.py``; everything else, or everything under the torch backend, to the torch
implementation below) and never syncs with the host. The float64 reference is
``fp16kit.numerics.reference.exponent_histogram``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _plan
from ._checks import check_tensor_list, common_device
from ._table import upload as _upload

__all__ = ["INF_BIN", "MAX_EXP", "MIN_EXP", "NAN_BIN", "NUM_BINS", "ZERO_BIN", "exponent_histogram"]

# The column layout is defined once, next to the kernel, and shared by every implementation.
MIN_EXP = -149
MAX_EXP = 127
ZERO_BIN = MAX_EXP - MIN_EXP + 1
INF_BIN = ZERO_BIN + 1
NAN_BIN = ZERO_BIN + 2
NUM_BINS = ZERO_BIN + 3

_FORMATS = {  # integer view, exponent bits, mantissa bits, bias (for the kernel's bit decoding)
    torch.float16: (torch.int16, 5, 10, 15),
    torch.bfloat16: (torch.int16, 8, 7, 127),
    torch.float32: (torch.int32, 8, 23, 127),
}
_rows_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
_SPEC = _plan.Spec("exponent_histogram", ("tensors",), written=(), key_rows=(0,))


def exponent_histogram(tensors: Sequence[torch.Tensor], *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Count each tensor's elements by binary exponent, plus zeros, infs and NaNs, on the device.

    Row ``i`` of the result belongs to ``tensors[i]``; its ``NUM_BINS`` (280) int64 columns are::

        column e - MIN_EXP   (e = -149 .. 127)  elements with 2^e <= |x| < 2^(e+1), i.e. floor(log2|x|) = e
        column ZERO_BIN      (277)              +0 and -0
        column INF_BIN       (278)              +inf and -inf
        column NAN_BIN       (279)              NaN (any payload, either sign)

    so every element is counted exactly once (a row sums to ``numel``). The range is fp32's, from its
    smallest subnormal ``2^-149`` to its largest finite value; fp16 values use columns -24..15 and
    bf16 values -133..127. Exponents come from the bit pattern (exact for subnormals on every backend).

    Args:
        tensors: fp16, bf16 or fp32 tensors on one device, any shape and strides (contiguous ones go to
            the Triton kernel, one launch per dtype; others to the torch implementation).
        out: optional int64 ``[len(tensors), NUM_BINS]`` tensor on that device; the counts are *added*
            to it (so a caller can sum over steps) and it is returned. Default: a new zeroed tensor.

    Returns:
        ``out`` (int64 ``[len(tensors), NUM_BINS]``). No host sync. An empty list gives ``[0, NUM_BINS]``.

    Raises:
        TypeError: a tensor is float64 (the columns cover fp32's range: cast with ``.float()`` first),
            or not a floating tensor.
        ValueError: mixed devices, or ``out`` of the wrong shape, dtype or device.
    """
    fn = "exponent_histogram"
    items = check_tensor_list(fn, "tensors", tensors)
    for i, t in enumerate(items):
        if t.dtype == torch.float64:
            raise TypeError(
                f"{fn}: tensors[{i}] is float64, but the histogram's columns cover fp32's exponents (-149..127). "
                f"Pass t.float() (values below 2^-149 then count as zeros and values above fp32's max as infs, "
                f"as a cast to fp16 or bf16 would make them)."
            )
    device = common_device(fn, items)
    if out is None:
        out = torch.zeros((len(items), NUM_BINS), dtype=torch.int64, device=device or "cpu")
    else:
        _check_out(fn, out, len(items), device)
    if device is None:
        return out
    plan = _plan.plan(_SPEC, (items,))  # the one planner: dtype groups, contiguous ones to the kernel, cached
    for g in plan.kernel:
        from .histogram_kernel import launch_histogram

        launch_histogram(g.pick(items), _rows(device, g.idx), out)
    for g in plan.rest:
        _torch_histogram(g.pick(items), _rows(device, g.idx), out)
    return out


def _check_out(fn: str, out: torch.Tensor, n: int, device: torch.device | None) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn}: out must be an int64 tensor of shape [{n}, {NUM_BINS}], not {type(out).__name__}.")
    if out.dtype != torch.int64 or tuple(out.shape) != (n, NUM_BINS) or not out.is_contiguous():
        raise ValueError(
            f"{fn}: out must be a contiguous int64 tensor of shape [{n}, {NUM_BINS}] (one row per tensor); "
            f"got {out.dtype} {tuple(out.shape)}{'' if out.is_contiguous() else ', non-contiguous'}. "
            f"Create it with torch.zeros(len(tensors), NUM_BINS, dtype=torch.int64, device=...)."
        )
    if device is not None and out.device != device:
        raise ValueError(f"{fn}: out is on {out.device} but the tensors are on {device}; move it there.")


def upload(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device`` without a host sync (``_table.upload``: pinned, non-blocking).
    ``fp16kit.doctor`` histograms freshly allocated gradients, whose tables cannot always come from a cache."""
    return _upload(values, device)[0]


def _rows(device: torch.device, idx: list[int]) -> torch.Tensor:
    """The output rows of a group as a device tensor, cached (a watcher calls with the same lists every time)."""
    key = (device, tuple(idx))
    rows = _rows_cache.get(key)
    if rows is None:
        if len(_rows_cache) > 256:
            _rows_cache.clear()
        rows = _rows_cache[key] = upload(idx, device)
    return rows


def exponent_bins(x: torch.Tensor) -> torch.Tensor:
    """The histogram column of every element of ``x`` (fp16, bf16 or fp32, any strides), as int64, flat.

    ``torch.frexp`` of the exact fp32 widening: ``x = m * 2^k`` with ``0.5 <= |m| < 1`` gives
    ``floor(log2|x|) = k - 1`` without rounding, subnormals included (torch's CPU and CUDA widening and
    ``frexp`` keep subnormals; the tests check all 65536 fp16 and bf16 patterns against the reference).
    Measured 3x faster on the CPU than decoding the bit pattern with integer ops as the kernel does.
    """
    x = x.reshape(-1).float()
    _, k = torch.frexp(x)
    bins = (k - (1 + MIN_EXP)).to(torch.int64)
    bins = torch.where(x == 0, ZERO_BIN, bins)
    bins = torch.where(torch.isinf(x), INF_BIN, bins)
    return torch.where(torch.isnan(x), NAN_BIN, bins)


def _torch_histogram(tensors: list[torch.Tensor], rows: torch.Tensor, out: torch.Tensor) -> None:
    """The torch implementation for one dtype group: flat column indices, one ``index_put_`` with
    accumulation (``bincount`` would read its maximum back to the host)."""
    numels = upload([t.numel() for t in tensors], out.device)
    total = sum(t.numel() for t in tensors)
    bins = exponent_bins(torch.cat([t.reshape(-1) for t in tensors]))
    flat = torch.repeat_interleave(rows * NUM_BINS, numels, output_size=total) + bins
    out.view(-1).index_put_((flat,), torch.ones_like(flat), accumulate=True)
