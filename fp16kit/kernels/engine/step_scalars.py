"""Device functions and host helpers of the device-resident optimizer step (docs/optim.md, "The step on the device").

A step's hyper-parameters reach a kernel without a host-to-device copy and without being read back:

* **Host numbers** (``lr``, ``betas``, ``eps``, ``weight_decay``, ``max_grad_norm``: Python floats, i.e. float64)
  travel as launch arguments, each split on the host into three float32 parts ``hi + mid + lo`` (:func:`split3`)
  whose float64 sum is the value exactly (24 + 24 + 24 bits cover float64's 53; see the docstring of
  :func:`split3` for the range). Triton passes a Python float as a float32 argument and never specializes on
  its value, so a scheduler that changes ``lr`` every step neither copies nor recompiles; :func:`join3`
  rebuilds the float64 value in the kernel.
* **Device values** (the step counter, a tensor ``lr``, the loss scale, the gradient norm, the skip flag) are read
  through pointers.
* **Derived values** (bias corrections ``1 - beta^t``, ``lr / bc1``, ``1 / scale``, the clip divisor) are computed
  in float64 in every program and rounded once to float32, the math of ``fp16kit.optim.functional``'s
  ``lamb_hparams``/``adam_hparams`` (which the torch fallback and the compiled step use): ``beta^t`` by
  :func:`pow_int` (square-and-multiply in float64: each squaring doubles the relative error it inherits, so the
  result is within ``2 t`` float64 roundings of the exact power, ``2.2e-16 t`` relative, where ``torch.pow`` is within
  about one; the float32 results agree with ``torch.pow``'s except when the exact value lies that close to a float32
  rounding boundary: for ``beta2 = 0.999`` at step 1000, ~4e-14 absolute against float32's 6e-8 spacing).

The step counter advances on the device in the kernel that updates last (:func:`finish_ticket`): every program
takes a ticket after its last write; the program that draws the last one sees all the others' work done and
finishes the step (``step += 1``, a reduction in a fixed order), then resets the ticket counter for the next step
(or the next replay of a captured graph). Nothing depends on which program comes last, so results are
deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["DeviceStep", "StepFlags", "finish_ticket", "join3", "pow_int", "split3"]


class StepFlags(NamedTuple):
    """The step's compile-time switches: one constexpr kernel argument ``STEP`` (a named tuple Triton specializes
    on), read as ``STEP.HP_DEVICE`` and so on, so that a new switch does not add a parameter to every kernel.

    ``HP_DEVICE``: the hyper-parameters come from the step bundle (else from the float32 ``hp`` vector);
    ``LR_TENSOR``: ``lr`` is a tensor (``step[2]``); ``HAS_SCALE``: unscale by a GradScaler's scale (``step[3]``);
    ``BIAS_CORRECTION``: ``1 - beta^t`` (else 1); ``ADVANCE``: the launch advances the step counter. The SGD, Adagrad
    and NovoGrad kernels' check-and-verify launch (``_results.finish_check_and_verify``) adds ``OWN_FLAG`` (the flag
    is the optimizer's own, not read), ``FIRST`` (the step's first such launch) and ``COUNT`` (count the skip)."""

    HP_DEVICE: bool = False
    LR_TENSOR: bool = False
    HAS_SCALE: bool = False
    BIAS_CORRECTION: bool = False
    ADVANCE: bool = False
    OWN_FLAG: bool = False
    FIRST: bool = False
    COUNT: bool = False


#: The host vector's switches (every one off).
HOST_VECTOR = StepFlags()


@dataclass(frozen=True)
class DeviceStep:
    """One group's step as a kernel derives it on the device (instead of a float32 ``hp`` vector).

    ``step``: the group's float32 ``[1]`` counter, not yet advanced (the kernel uses ``step + 1``); ``host``: the
    host numbers by name (``lr``, ``beta1``, ...); ``lr``: a tensor learning rate (read on the device; then
    ``host["lr"]`` is unused); ``scale``: a GradScaler's ``grad_scale`` (the kernel unscales by its float64
    inverse), None without one; ``advance``: this launch advances ``step`` (the group's last launch); ``gnorm``:
    LAMB's global gradient norm (float32 ``[1]``, from the step's check pass) for the clip divisor."""

    step: torch.Tensor
    host: dict[str, float]
    lr: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    bias_correction: bool = True
    advance: bool = True
    gnorm: torch.Tensor | None = None  # LAMB: the global gradient norm (float32 [1]) the clip divisor comes from
    #: The same step as a float64 hyper-parameter vector (the optimizer's torch formula), for rows the kernels
    #: do not take; called before any launch advances ``step``.
    legacy: Any = None

    def hp64(self) -> torch.Tensor:
        """The float64 vector of this step for the torch fallback (``legacy``)."""
        if self.legacy is None:
            raise RuntimeError("DeviceStep: rows outside the Triton kernels need the step's float64 vector.")
        return self.legacy()

    @staticmethod
    def arguments(hp: torch.Tensor | DeviceStep, table: Any, names: Sequence[str]) -> tuple[Any, tuple, dict]:
        """``(hp_ptr, scalars, constexprs)`` for a kernel with the device-step signature: ``scalars`` is the step
        bundle (the kernel argument ``step``, after ``found_inf``: the pointers ``step, ticket, lr, scale`` and three
        float32 parts per name of ``names``; read by ``step_host64`` and its siblings), ``constexprs`` its
        :class:`StepFlags` (``{"STEP": ...}``). A float32 ``hp`` vector (the legacy layout) gives placeholders and
        every switch off."""
        if isinstance(hp, torch.Tensor):
            return hp, (hp, hp, hp, hp) + (0.0,) * (3 * len(names)), {"STEP": HOST_VECTOR}
        step = hp.step
        parts: tuple[float, ...] = ()
        host = hp.host
        for name in names:
            parts += split3_cached(float(host.get(name, 0.0)))
        flags = StepFlags(HP_DEVICE=True, LR_TENSOR=hp.lr is not None, HAS_SCALE=hp.scale is not None,
                          BIAS_CORRECTION=hp.bias_correction, ADVANCE=hp.advance)
        pointers = (step, table.scratch_ticket() if hp.advance else step,
                    step if hp.lr is None else hp.lr, step if hp.scale is None else hp.scale)
        return step, pointers + parts, {"STEP": flags}


_SPLITS: dict[float, tuple[float, float, float]] = {}


def split3_cached(x: float) -> tuple[float, float, float]:
    """:func:`split3`, remembered for the last few hundred values (hyper-parameters repeat every step)."""
    parts = _SPLITS.get(x)
    if parts is None:
        if len(_SPLITS) > 512:
            _SPLITS.clear()
        parts = _SPLITS[x] = split3(x)
    return parts


def split3(x: float) -> tuple[float, float, float]:
    """``(hi, mid, lo)``: float32 values with ``float64(hi) + mid + lo == x`` exactly for every finite float64
    ``x`` of magnitude in [2^-77, 2^127] (and for 0); outside it the sum is within 2^-149 of ``x``. NaN and inf go
    whole into ``hi`` (hyper-parameters are validated before a step, so these reach no kernel)."""
    hi = float(np.float32(x))
    if not np.isfinite(hi) or hi == x:
        return hi, 0.0, 0.0
    r = x - hi
    mid = float(np.float32(r))
    return hi, mid, float(np.float32(r - mid))


@triton.jit
def join3(hi, mid, lo):
    """The float64 value ``hi + mid + lo`` (each a float32 launch argument): exact, see :func:`split3`."""
    return (tl.cast(hi, tl.float64) + tl.cast(mid, tl.float64)) + tl.cast(lo, tl.float64)


@triton.jit
def pow_int(base, n):
    """``base ** n`` in float64 for an integer ``n >= 0`` (square and multiply over the bits of ``n``)."""
    result = tl.full((), 1.0, tl.float64)
    b = base
    k = n
    while k > 0:
        if k % 2 == 1:
            result = result * b
        b = b * b
        k = k // 2
    return result


@triton.jit
def finish_ticket(ticket_ptr):
    """Take this program's ticket (after its writes); True for the program that takes the last one, which then
    resets the counter. acq_rel: the last program sees every other program's writes."""
    total = tl.num_programs(0)
    mine = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    last = mine == total - 1
    if last:
        tl.atomic_xchg(ticket_ptr, 0, sem="acq_rel")
    return last


@triton.jit
def next_step(step_ptr):
    """``t``, the number of the step being taken: the device counter (float32, not yet advanced) plus one, as a 64-bit
    integer (a checkpoint's counter may exceed ``2**31``: in int32 it would wrap, and ``beta^t`` with it)."""
    return (tl.load(step_ptr) + 1.0).to(tl.int64)


@triton.jit
def bias_correction64(beta, t, BIAS_CORRECTION: tl.constexpr):
    """``1 - beta^t`` in float64 (1 without bias correction), as ``torch.pow`` on the float64 step."""
    if BIAS_CORRECTION:
        return 1.0 - pow_int(beta, t)
    else:
        return tl.full((), 1.0, tl.float64)


@triton.jit
def lr64(lr_hi, lr_mid, lr_lo, lr_ptr, LR_TENSOR: tl.constexpr):
    """The learning rate in float64: a tensor ``lr`` (read on the device) or the host number."""
    if LR_TENSOR:
        return tl.load(lr_ptr).to(tl.float64)
    else:
        return join3(lr_hi, lr_mid, lr_lo)


@triton.jit
def inv_scale64(scale_ptr, HAS_SCALE: tl.constexpr):
    """``1 / grad_scale`` in float64 (a GradScaler's scale, read on the device), 1 without a scaler."""
    if HAS_SCALE:
        return 1.0 / tl.load(scale_ptr).to(tl.float64)
    else:
        return tl.full((), 1.0, tl.float64)


# ---------------------------------------------------------------------------------------------------------------
# The step bundle: ``DeviceStep.arguments``' scalars as one kernel argument ``step`` (a tuple): the pointers
# ``step, ticket, lr, scale`` (``[0:4]``), then three float32 parts per host number in the launcher's ``names``
# order (``[4 + 3 i : 7 + 3 i]``). A kernel hands the bundle on whole, so a new host number or pointer changes the
# launcher's ``names`` and the code that reads it, not every kernel's and device function's argument list.


@triton.jit
def step_host64(step, i: tl.constexpr):
    """Host number ``i`` of the step bundle (``names[i]``) in float64 (:func:`join3`)."""
    return join3(step[4 + 3 * i], step[5 + 3 * i], step[6 + 3 * i])


@triton.jit
def step_lr64(step, LR_TENSOR: tl.constexpr):
    """:func:`lr64` of the step bundle: its tensor ``lr`` (``step[2]``) or its host number 0."""
    return lr64(step[4], step[5], step[6], step[2], LR_TENSOR)


@triton.jit
def step_number(step):
    """:func:`next_step` of the step bundle's counter (``step[0]``)."""
    return next_step(step[0])


@triton.jit
def step_inv_scale64(step, HAS_SCALE: tl.constexpr):
    """:func:`inv_scale64` of the step bundle's loss scale (``step[3]``)."""
    return inv_scale64(step[3], HAS_SCALE)


@triton.jit
def step_advance(step, ADVANCE: tl.constexpr):
    """:func:`advance_step` of the step bundle's counter and ticket (``step[0]``, ``step[1]``)."""
    advance_step(step[0], step[1], ADVANCE)


@triton.jit
def advance_step(step_ptr, ticket_ptr, ADVANCE: tl.constexpr):
    """After this program's writes: the program that takes the last ticket adds 1 to the step counter (the
    launch that updates a group last advances its counter; a skipped step takes no tickets)."""
    if ADVANCE:
        tl.debug_barrier()
        if finish_ticket(ticket_ptr):
            tl.store(step_ptr, tl.load(step_ptr, cache_modifier=".cg") + 1.0)
