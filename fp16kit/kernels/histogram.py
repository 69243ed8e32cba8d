"""``exponent_histogram``: how many elements of each tensor lie in each binade, in one launch per dtype.

The public op validates, plans (contiguous fp16/bf16/fp32 tensors to the Triton kernel in
``fp16kit/kernels/triton/histogram.py``; everything else, or everything under the torch backend, to its torch twin
``fp16kit/kernels/fallback/histogram.py``) and never syncs with the host. The column layout is
``fp16kit/kernels/engine/histogram_bins.py``'s (re-exported here); the float64 reference is
``fp16kit.numerics.reference.exponent_histogram``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .engine import plan as _plan
from .engine.checks import check_device, check_tensor_list, common_device
from .engine.histogram_bins import INF_BIN, MAX_EXP, MIN_EXP, NAN_BIN, NUM_BINS, ZERO_BIN, upload
from .fallback.histogram import torch_histogram

__all__ = ["INF_BIN", "MAX_EXP", "MIN_EXP", "NAN_BIN", "NUM_BINS", "ZERO_BIN", "exponent_histogram"]

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
        from .triton.histogram import launch_histogram

        launch_histogram(g.pick(items), _rows(device, g.idx), out)
    for g in plan.rest:
        torch_histogram(g.pick(items), _rows(device, g.idx), out)
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
    check_device(fn, "out", out, device, "; move it there")


def _rows(device: torch.device, idx: list[int]) -> torch.Tensor:
    """The output rows of a group as a device tensor, cached (a watcher calls with the same lists every time)."""
    key = (device, tuple(idx))
    rows = _rows_cache.get(key)
    if rows is None:
        if len(_rows_cache) > 256:
            _rows_cache.clear()
        rows = _rows_cache[key] = upload(idx, device)
    return rows
