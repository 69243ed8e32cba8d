"""Argument checks shared by the multi-tensor kernels: every failure names the problem and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

__all__ = [
    "FLOAT_DTYPES",
    "KERNEL_DTYPES",
    "check_device",
    "check_flag",
    "check_pairs",
    "check_scalar_tensor",
    "check_tensor_list",
    "check_writes",
    "common_device",
    "resolve_inputs",
    "same_view",
]

#: dtypes the Triton kernels handle natively; float64 tensors go to the torch path in float64 math.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = (*KERNEL_DTYPES, torch.float64)
_FLOAT_SET = frozenset(FLOAT_DTYPES)


def check_tensor_list(
    fn: str, name: str, tensors: Sequence[torch.Tensor], allow: frozenset = frozenset()
) -> list[torch.Tensor]:
    """A list of dense floating-point tensors (fp16, bf16, fp32, fp64; or a dtype in ``allow``: the uint8 codes of
    8-bit optimizer state)."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a list of tensors, got a single tensor; wrap it as [tensor].")
    out = list(tensors)
    for i, t in enumerate(out):
        # Fast path first: this runs for every tensor on every call.
        if isinstance(t, torch.Tensor) and (t.dtype in _FLOAT_SET or t.dtype in allow) and t.layout == torch.strided:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name}[{i}] is a {type(t).__name__}, not a torch.Tensor.")
        if t.layout != torch.strided:
            raise TypeError(
                f"{fn}: {name}[{i}] has layout {t.layout}; only dense (strided) tensors are supported. "
                f"Coalesce sparse tensors and pass their .values()."
            )
        raise TypeError(
            f"{fn}: {name}[{i}] has dtype {t.dtype}; expected a floating dtype "
            f"(float16, bfloat16, float32 or float64). Integer, bool and complex tensors are not gradients."
        )
    return out


def common_device(fn: str, *lists: Sequence[torch.Tensor]) -> torch.device | None:
    """The one device of all tensors in ``lists`` (None when they are all empty)."""
    device = None
    for tensors in lists:
        for t in tensors:
            d = t.device
            if device is None:
                device = d
            elif d != device:
                raise ValueError(
                    f"{fn}: tensors are on mixed devices ({device} and {d}); one call handles one "
                    f"device. Group the tensors by device and call once per device."
                )
    return device


def check_pairs(fn: str, a_name: str, a: Sequence[torch.Tensor], b_name: str, b: Sequence[torch.Tensor]) -> None:
    """Two lists that correspond element by element: same length, same number of elements."""
    if len(a) != len(b):
        raise ValueError(f"{fn}: {a_name} has {len(a)} tensors but {b_name} has {len(b)}; they must pair up.")
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(
                f"{fn}: {a_name}[{i}] has shape {tuple(x.shape)} but {b_name}[{i}] has shape {tuple(y.shape)}."
            )


def check_flag(
    fn: str, found_inf: torch.Tensor, device: torch.device | None, name: str = "found_inf", *, float64_ok: bool = False
) -> None:
    """``found_inf`` (or another accumulator): a one-element float32 tensor on the tensors' device
    (``float64_ok``: float64 accepted too, for accumulators that should not round to fp32)."""
    kind = "float32 or float64" if float64_ok else "float32"
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a one-element {kind} tensor, e.g. torch.zeros(1, device=...).")
    ok = found_inf.dtype == torch.float32 or (float64_ok and found_inf.dtype == torch.float64)
    if found_inf.numel() != 1 or not ok:
        raise ValueError(
            f"{fn}: {name} must be a one-element {kind} tensor; got dtype {found_inf.dtype} "
            f"with {found_inf.numel()} elements."
        )
    check_device(fn, name, found_inf, device)


def check_scalar_tensor(fn: str, name: str, value: torch.Tensor, device: torch.device | None) -> None:
    """A one-element floating tensor on the tensors' device (read by the kernel: no host sync)."""
    if value.numel() != 1 or not value.is_floating_point():
        raise ValueError(
            f"{fn}: {name} must be a Python float or a one-element floating tensor; "
            f"got dtype {value.dtype} with {value.numel()} elements."
        )
    check_device(fn, name, value, device, "; move it there")


def check_device(fn: str, name: str, value: torch.Tensor, device: torch.device | None, fix: str = "") -> None:
    """``value`` (a flag, a scalar, an output the call writes) lives on the tensors' ``device`` (None: no tensors,
    nothing to compare), else ``ValueError`` naming both devices and then ``fix``."""
    if device is not None and value.device != device:
        raise ValueError(f"{fn}: {name} is on {value.device} but the tensors are on {device}{fix}.")


# ---------------------------------------------------------------------------------------------------------------
# Memory layout: which tensors may share memory. Two kernel programs run on different chunks at the same time, so
# any element that one pair writes and another pair reads or writes is a race; only the exact in-place pair (the
# same view read and written element by element by one program) is safe.


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` address exactly the same elements in the same order (an in-place pair)."""
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.element_size() == b.element_size()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _extent(t: torch.Tensor) -> int:
    """Elements between the first and one past the last element ``t`` can address (non-empty ``t``)."""
    if t.is_contiguous():
        return t.numel()
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (contiguous up to a permutation, e.g. channels_last): every byte of its span is
    one of its elements, so a span overlap is a real overlap."""
    if t.is_contiguous():
        return True
    expected = 1
    for n, s in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda p: p[1]):
        if s != expected:
            return False
        expected *= n
    return True


def _provably_no_internal_overlap(t: torch.Tensor) -> bool:
    """Sorted by stride, each stride exceeds the largest offset the smaller dimensions reach: every index maps to
    its own element (slices, transposes and permutations pass; stride-0 expansions fail)."""
    reach = 0
    for n, s in sorted(((n, s) for n, s in zip(t.shape, t.stride()) if n > 1), key=lambda p: p[1]):
        if s <= reach:
            return False
        reach += (n - 1) * s
    return True


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """Sorted byte addresses of ``t``'s elements (the exact check for layouts the span test cannot decide)."""
    index = torch.arange(_extent(t), dtype=torch.int64)
    offsets = torch.as_strided(index, t.shape, t.stride()).reshape(-1)
    return torch.sort(offsets * t.element_size() + t.data_ptr()).values


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Some byte belongs to an element of ``a`` and to an element of ``b``."""
    if _is_dense(a) and _is_dense(b):
        return True  # the spans overlap (the caller checked) and dense tensors own every byte of their span
    starts_a, starts_b = _element_bytes(a), _element_bytes(b)
    size_a, size_b = a.element_size(), b.element_size()
    # For each element of b, the last element of a starting before b's element ends; they overlap iff it ends
    # after b's element starts (all elements of a have the same size, so no earlier one can reach further).
    pos = torch.searchsorted(starts_a, starts_b + size_b) - 1
    ok = pos >= 0
    return bool((starts_a[pos.clamp(min=0)] + size_a > starts_b)[ok].any())


def _internal_overlap(t: torch.Tensor) -> bool:
    if t.is_contiguous() or _provably_no_internal_overlap(t):
        return False
    starts = _element_bytes(t)
    return bool((starts[1:] - starts[:-1] < t.element_size()).any())


def _output_problem(fn: str, name: str, i: int, t: torch.Tensor) -> None:
    if t.is_neg():
        raise ValueError(
            f"{fn}: {name}[{i}] is a negative-bit view (e.g. complex.conj().imag): its memory holds the "
            f"negated values, and the kernels write raw memory. Write into a plain tensor and copy the "
            f"result back (t.copy_(result)), or pass t.resolve_neg() and use that as the destination."
        )
    if not t.is_contiguous() and t.numel() > 1 and _internal_overlap(t):
        raise ValueError(
            f"{fn}: {name}[{i}] has internal overlap (shape {tuple(t.shape)}, strides {t.stride()}, e.g. an "
            f"expanded view): several of its elements share memory, so writing it is ill-defined. "
            f"Pass a tensor that owns its elements, e.g. t.contiguous() or t.clone()."
        )


def resolve_inputs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inputs with the negative bit resolved (a copy, only for such views): the kernels read raw memory."""
    if any(t.is_neg() for t in tensors):
        return [t.resolve_neg() if t.is_neg() else t for t in tensors]
    return tensors


def _spans(
    tensors: Sequence[torch.Tensor], tag: int, spans: list[tuple[int, int, int, int]], fn: str = "", name: str = ""
) -> None:
    """Append ``(first byte, one past the last byte, tag, index)`` for each non-empty tensor; with ``name``
    (outputs), also reject negative-bit views and internal overlap. One plain loop with the fewest tensor
    method calls: this runs on every call, for every tensor."""
    for i, t in enumerate(tensors):
        n = t.numel()
        if not n:
            continue
        start = t.data_ptr()
        if t.is_contiguous():
            end = start + n * t.element_size()
        else:
            if name:
                _output_problem(fn, name, i, t)
            end = start + _extent(t) * t.element_size()
        if name and t.is_neg():
            _output_problem(fn, name, i, t)
        spans.append((start, end, tag, i))


def check_writes(
    fn: str,
    out_name: str,
    outputs: Sequence[torch.Tensor],
    in_name: str | None = None,
    inputs: Sequence[torch.Tensor] | None = None,
) -> None:
    """Outputs the kernels may write, alone and together with the inputs (``ValueError`` otherwise).

    Each non-empty output: no negative bit (``complex.conj().imag``), no internal overlap (stride-0 expanded
    views). Together: every written element is written once and read by no other pair. Allowed: ``outputs[i]``
    the same view as ``inputs[i]`` (in place), and inputs sharing memory with each other (reads). Rejected: an
    output that overlaps another output (a repeated output, also the same tensor twice in an in-place list) or
    any input other than its own exact in-place pair (partial overlap).

    Cost: one byte span per non-empty tensor and a sort, O(n log n); only spans that overlap are examined
    further, element by element when a layout is not dense (``x[0::2]`` and ``x[1::2]`` share a span but no
    element, and are allowed).
    """
    spans: list[tuple[int, int, int, int]] = []
    _spans(outputs, 1, spans, fn, out_name)
    if inputs is not None:
        _spans(inputs, 0, spans)
    if len(spans) < 2:
        return
    spans.sort()
    if all(a[1] <= b[0] for a, b in pairwise(spans)):
        return  # the common case: no two spans overlap
    # Sweep: a cluster is a run of spans that overlap one another transitively; only inside one can tensors share
    # memory. Clusters are almost always single spans (or an in-place pair), so this is linear after the sort.
    # The violation reported is the one with the smallest indices, not the first in address order, so the message
    # does not depend on where the allocator put the tensors (the same error on every backend and every run).
    found: list[tuple[int, int, int, str]] = []
    cluster = [spans[0]]
    end = spans[0][1]
    for span in [*spans[1:], (1 << 65, 1 << 65, 0, -1)]:  # a sentinel past every address closes the last one
        if span[0] < end:
            cluster.append(span)
            end = max(end, span[1])
            continue
        if len(cluster) > 1:
            found += _cluster_violations(fn, out_name, outputs, in_name, inputs, cluster)
        cluster, end = [span], span[1]
    if found:
        raise ValueError(min(found)[3])


def _cluster_violations(fn, out_name, outputs, in_name, inputs, cluster) -> list[tuple[int, int, int, str]]:
    """``(output index, 0 for another output / 1 for an input, other index, message)`` for each pair in one cluster
    of overlapping spans that really shares memory against the rules."""
    found = []
    for a_start, a_end, _, i in (s for s in cluster if s[2] == 1):
        a = outputs[i]
        for b_start, b_end, is_out, j in cluster:
            if (is_out and j <= i) or not (a_start < b_end and b_start < a_end):
                continue  # each pair of outputs once; spans apart
            b = outputs[j] if is_out else inputs[j]
            if not is_out and j == i and same_view(a, b):
                continue  # in place
            if not _elements_overlap(a, b):
                continue
            if is_out:
                what = "is the same memory as" if same_view(a, b) else "overlaps"
                message = (
                    f"{fn}: {out_name}[{i}] {what} {out_name}[{j}]; every output element must be written once "
                    f"(two kernel programs would race on it, and backends would disagree). Pass each tensor once, "
                    f"or clone the duplicate."
                )
            else:
                kind = "partially overlaps" if j == i else ("is" if same_view(a, b) else "overlaps")
                message = (
                    f"{fn}: {out_name}[{i}] {kind} {in_name}[{j}] in memory; an output may share memory only with "
                    f"its own input, as the identical view (in place). Otherwise the kernels would read values "
                    f"already overwritten. Write into separate tensors (e.g. {in_name}[{j}].clone() as the input)."
                )
            found.append((i, 0 if is_out else 1, j, message))
    return found
