"""The step every torch twin of an optimizer kernel shares: the ``found_inf`` skip, the commit, the math dtype.

The torch twins (``fallback/adam.py``, ``fallback/lamb.py``, ``fallback/sgd.py``, ...) run where Triton cannot
(CPU tensors without the interpreter, platforms without Triton) and on tensors the kernels do not take
(non-contiguous, float64). ``hp`` is the hyper-parameter tensor of the matching Triton kernel (``triton/adam.py``,
``triton/lamb.py``, ...); its dtype is the math dtype (float32, or float64 for float64 params).

The ``found_inf`` skip never syncs a GPU with the host. On CPU tensors the flag is read directly (a CPU
tensor has no queue to drain): a set flag returns at once, a clear one runs the fast host path (in place,
hyper-parameters as host numbers; Adam is ``torch.optim.Adam``'s own foreach sequence). Elsewhere every new
value is computed out of place and committed with ``torch.where(found_inf != 0, old, new)``, which keeps
old values bit for bit even when the new ones are NaN. ``host_branch`` overrides the choice, per call or
for a block (:func:`masked_commits`): tests exercise the masked path on CPU.

Fast CPU path (no compiler needed): when the caller hands over the step counter (:class:`FusedAdamArgs`), CPU rows
of contiguous fp32/fp64 tensors run Adam's elementwise math in torch's fused CPU Adam kernel
(``torch._fused_adam_``/``torch._fused_adamw_``: one vectorized, multi-threaded pass reading g, p, m, v and
writing p, m, v), instead of ~8 foreach passes (``fallback/adam.py``; LAMB's stage 1 too, ``fallback/lamb.py``).
The kernel computes its bias corrections from the step counter in float64 (``1 - beta**t``) exactly as
``fp16kit/optim/functional.py`` does; the path is taken only where they agree with ``hp64`` (else bias correction
is off) and, for LAMB, ``beta3 == 1 - beta1`` (:func:`_fused_takes`).
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import NamedTuple

import torch

from ..engine.rows import GradMoments, Rows

__all__ = ["FusedAdamArgs", "GradMoments", "Rows", "bump_versions", "foreach_only", "masked_commits"]

F64 = torch.float64


class FusedAdamArgs(NamedTuple):
    """What torch's fused CPU Adam kernel needs beyond the ``hp`` tensor: the (already advanced) step counter
    it derives the bias corrections from, the float64 hyper-parameters (``hp`` may be rounded to fp32), and
    ``memo``: the caller's plan group's memo (``_plan.Group``; a plan hit means the same addresses and metadata),
    where the layout verdicts of :func:`_fused_takes` and :func:`_adam_fused` are kept instead of being recomputed
    over every tensor every step (~0.5 us per tensor)."""

    step: torch.Tensor
    hp64: torch.Tensor
    memo: dict | None = None

_forced_host_branch: list[bool] = []


@contextlib.contextmanager
def masked_commits() -> Iterator[None]:
    """Within the block, every call takes the masked (off-CPU) path, on CPU tensors too (for tests)."""
    _forced_host_branch.append(False)
    try:
        yield
    finally:
        _forced_host_branch.pop()

_foreach_only: list[bool] = []


@contextlib.contextmanager
def foreach_only() -> Iterator[None]:
    """Within the block, the CPU host path never uses torch's fused Adam kernel (the foreach sequence only):
    for benchmarks (the path before the fast one) and tests that compare the two."""
    _foreach_only.append(True)
    try:
        yield
    finally:
        _foreach_only.pop()


def _skip(found_inf: torch.Tensor, host_branch: bool | None) -> bool | torch.Tensor:
    """``True``/``False`` decided on the host, or a 0-dim bool tensor for masked commits."""
    if host_branch is None and _forced_host_branch:
        host_branch = _forced_host_branch[-1]
    if host_branch is None:
        host_branch = found_inf.device.type == "cpu"
    flag = found_inf.reshape(()) != 0
    return bool(flag) if host_branch else flag


def _commit(dsts: Sequence[torch.Tensor], news: Sequence[torch.Tensor], skip: bool | torch.Tensor) -> None:
    """``dst.copy_(new)`` (rounding to dst's dtype), or keep ``dst`` where ``skip`` is a set device flag."""
    for dst, new in zip(dsts, news):
        if isinstance(skip, torch.Tensor):
            new = torch.where(skip, dst.to(new.dtype), new)
        dst.copy_(new)


def _write_params(
    params: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    new_params: Sequence[torch.Tensor],
    skip: bool | torch.Tensor,
) -> None:
    """Params (unless ``new_params[i]`` already is ``params[i]``, updated in place) and model copies."""
    moved = [(d, n) for d, n in zip(params, new_params) if d is not n]
    _commit([d for d, _ in moved], [n for _, n in moved], skip)
    pairs = [(m, p) for m, p in zip(models, new_params) if m is not None]
    _commit([m for m, _ in pairs], [p for _, p in pairs], skip)


def _second_moment(
    exp_avg_sqs: Sequence[torch.Tensor],
    g: list[torch.Tensor],
    beta2: torch.Tensor | float,
    one_minus_beta2: torch.Tensor | float,
    *,
    in_place: bool = False,
) -> list[torch.Tensor]:
    """``v * beta2 + (1 - beta2) * g * g``, out of place (or in place on ``exp_avg_sqs``)."""
    if in_place:
        v = list(exp_avg_sqs)
        torch._foreach_mul_(v, beta2)
    else:
        v = torch._foreach_mul(list(exp_avg_sqs), beta2)
    gg = torch._foreach_mul(g, one_minus_beta2)
    torch._foreach_mul_(gg, g)
    torch._foreach_add_(v, gg)
    return v


def _math(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors in ``dtype``: themselves where they have it (``t.to`` would return ``t`` too, at ~1 us a call)."""
    return [t if t.dtype is dtype else t.to(dtype) for t in tensors]


def _finish(
    params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    p: list[torch.Tensor],
    m: list[torch.Tensor],
    v: list[torch.Tensor],
    delta: list[torch.Tensor],
    skip: torch.Tensor,
) -> None:
    """Masked commit of ``p - delta`` (params, model copies) and of the new moments."""
    new_p = torch._foreach_sub(p, delta)
    _commit(exp_avgs, m, skip)
    _commit(exp_avg_sqs, v, skip)
    _write_params(params, models, new_p, skip)


def _fused_takes(
    fused: FusedAdamArgs,
    p: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lamb: bool,
) -> bool:
    """Whether torch's fused CPU Adam kernel computes exactly this step's math: CPU, params and moments of
    one fp32/fp64 dtype, contiguous (the kernel walks raw memory; grads of other layouts or dtypes are copied
    into a contiguous scratch buffer), bias corrections equal to ``1 - beta**t`` from the step counter as the
    kernel derives them, and for LAMB ``beta3 == 1 - beta1`` (grad averaging)."""
    if _foreach_only:
        return False
    hp = fused.hp64.tolist()
    beta1, beta2 = hp[1], hp[2]
    if lamb:
        bc1, bc2 = hp[7], hp[8]
        if hp[3] != 1.0 - beta1:
            return False
    else:
        bc1, bc2 = -hp[0] / hp[7] if hp[7] else math.nan, hp[8] ** 2
    t = float(fused.step.reshape(()))
    if not (t >= 1 and t == int(t)) or fused.step.device.type != "cpu":
        return False
    want1, want2 = 1.0 - beta1 ** int(t), 1.0 - beta2 ** int(t)
    if lamb and (bc1 != want1 or bc2 != want2):
        return False
    if not lamb and not (math.isclose(bc1, want1, rel_tol=1e-12) and math.isclose(bc2, want2, rel_tol=1e-12)):
        return False
    dtype = p[0].dtype
    if p[0].device.type != "cpu" or dtype not in (torch.float32, torch.float64):
        return False
    return _remembered(fused.memo, "fused_layout", lambda: _all_of(dtype, (*p, *exp_avgs, *exp_avg_sqs)))


def _remembered(memo: dict | None, key: str, verdict: Callable[[], bool]) -> bool:
    """``verdict()``, kept in ``memo`` (a plan group's: valid while the plan is) under ``key``."""
    if memo is None:
        return verdict()
    got = memo.get(key)
    if got is None:
        got = memo[key] = verdict()
    return got

_IS_CONTIGUOUS = torch.Tensor.is_contiguous

_DTYPE = operator.attrgetter("dtype")


def _all_of(dtype: torch.dtype, tensors: Sequence[torch.Tensor]) -> bool:
    """Are all ``tensors`` contiguous tensors of ``dtype``? (C-level ``map`` passes: this runs on every step, over
    every param, moment and grad; a generator costs ~3x as much per tensor.)"""
    return all(map(_IS_CONTIGUOUS, tensors)) and all(map(operator.is_, map(_DTYPE, tensors), repeat(dtype)))


def bump_versions(*lists: Sequence[torch.Tensor | None]) -> None:
    """Bump ``_version`` of tensors written through raw addresses (a Triton kernel, torch's fused Adam
    kernel; torch's in-place ops do it themselves): autograd then detects a modified saved tensor, and
    autocast's weight cache a new weight. ``None`` entries are ignored; a spurious bump is harmless."""
    torch.autograd.graph.increment_version([t for lst in lists for t in lst if t is not None])
