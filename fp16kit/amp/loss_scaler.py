"""The dynamic loss scaler: a device-side state machine with no per-step host sync.

State (all tensors on the scaler's device, shape ``[1]``):

* ``scale`` (fp32): the current loss scale ``S``, kept within ``[min_scale, max_scale]``.
* ``growth_tracker`` (int32): consecutive clean updates since the last growth or overflow.
* ``consecutive_skips``: consecutive updates that saw inf/NaN (0 after a clean one); kept as an
  exact fp32 counter so that the update is plain float math, read as int32.
* ``hysteresis_tracker`` = ``max(hysteresis - consecutive_skips, 0)``: overflows still tolerated
  before backing off. A clean step resets it to ``hysteresis`` and each overflow in a row takes one
  off, which is exactly that formula, so it is derived from the skip counter instead of stored.

``update(found_inf)`` after each step (docs/specs/loss-scaler.md), with ``inf = found_inf != 0`` (NaN counts)::

    inf:    growth_tracker = 0;  hysteresis_tracker -= 1 (not below 0)
            if hysteresis_tracker == 0:  S = max(S * backoff_factor, min_scale)    # no floor if None
    clean:  growth_tracker += 1;  hysteresis_tracker = hysteresis
            if growth_tracker == growth_interval:
                growth_tracker = 0
                G = S * growth_factor
                if G is finite: S = min(G, max_scale)                              # never grows to inf

Implementation: the growth/backoff core *is* torch's ``_amp_update_scale_`` (the op behind
``torch.amp.GradScaler.update``), called with the flag "back off now", followed by a clamp of the new
value into ``[min(min_scale, S_old), max(max_scale, S_old)]``: the bounds only limit what growth and
backoff produce, so a scale that lies outside them (possible with ``strict_bounds=False``: a torch
checkpoint with scale 2**30 under a cap of 2**24) is never moved *by* the bounds, growth never lowers it
and backoff never raises it. With the scale inside the bounds this is exactly the min/max above. So with
``hysteresis=1`` and no floor/cap the trajectory is *bit-identical* to torch's GradScaler on every device
(same op, same rounding: products in double rounded once to fp32 on CPU), with one exception: the scale
never reaches 0. Backoff is floored at fp32's smallest normal 2**-126 (``SCALE_FLOOR``): below it the
unscale factor ``1/S`` overflows fp32, so every step reads as an overflow and torch's scale goes on down to
0, where it stays forever (``0 * growth_factor = 0``). So the trajectories agree down to 2**-126, and past
it ours can still recover. Hysteresis: an overflow that is still
tolerated sets ``growth_tracker = -1`` before the op, which then sees a clean step, moves it back to
0 and cannot grow (``growth_interval >= 1``), leaving ``S`` unchanged: the state machine above.

Everything is tensor arithmetic on the device (four or five tiny in-place ops, ~15 us on a CPU), so
``update`` never waits for the GPU; ``get_scale()`` is the only host sync and only happens when asked for.
On the CPU, with torch's options (hysteresis 1, no floor, no cap), the flag is host memory: a clean step
(flag 0, the common case) reads it and runs torch's update op alone, which is what the five ops amount to
there (``_clean_cpu_update``; bitwise the same state, tests/amp/test_scaler_update_fast.py).

Skip warning without a per-step sync
------------------------------------
NaN loss from step 0 makes every step overflow and, without a floor, halves the scale forever
(apex's "loss scale 1e-205" reports). Detecting that needs the host, so it is done in batches:

* On the device, ``update`` keeps ``consecutive_skips`` and ``window_max`` (the longest streak seen
  since the last host check), two in-place ops and no sync.
* Every ``warn_after_skips = K`` updates the host takes a snapshot of both counters and the scale.
  On CUDA the copy goes to pinned host memory with ``non_blocking=True`` plus a CUDA event, and the
  host reads it at a later ``update`` once the event has completed (``event.query()`` never blocks);
  on the CPU there is nothing to wait for, so it is read at once. ``window_max`` is then reset.
* A warning is issued when ``window_max >= K``: no streak of K skips can slip between two checks, and
  the warning arrives at most ~K updates late (on CUDA, plus the time the copy takes). A streak that
  keeps going is reported once, not at every check. ``get_scale()`` (a sync anyway) also checks.
* ``warn_after_skips=None`` turns the warning off; the scaler then never reads anything back.

A static scaler (``dynamic=False``, apex's ``loss_scale=128.0``) never changes its scale and never
asks for a skip; its skip counter still runs, and the same check warns that a static scale has been
producing inf/NaN gradients K steps in a row (those steps were *applied*, not skipped).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ..kernels import as_fp16kit_flag, new_found_inf

__all__ = ["LossScaler"]

_FP32_MAX = float(torch.finfo(torch.float32).max)
#: fp32's smallest normal value: backoff stops there (its reciprocal, the unscale factor, is still finite)
SCALE_FLOOR = 2.0**-126


def _check_scale_value(name: str, value: float) -> float:
    """A positive finite float in ``[SCALE_FLOOR, fp32 max]``: the fp32 scale holds it, and its reciprocal (the
    unscale factor) is finite too. Below 2**-126 ``1/S`` overflows fp32, every step would read as an overflow and
    backoff (which stops at the floor) could never recover: a scaler stuck forever, so such a value is refused."""
    value = _check_positive_finite(name, value)
    if value > _FP32_MAX:
        raise ValueError(
            f"LossScaler: {name}={value!r} cannot be held by the fp32 scale (it would become inf); use a value in "
            f"[2**-126, {_FP32_MAX:.6g}]."
        )
    if value < SCALE_FLOOR:
        raise ValueError(
            f"LossScaler: {name}={value!r} is below 2**-126: its reciprocal, the unscale factor, overflows fp32, so "
            f"every step would be skipped; use a value in [2**-126, {_FP32_MAX:.6g}]."
        )
    return value


def _check_positive_finite(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"LossScaler: {name} must be a positive finite number, got {value!r}.")
    return value


def _check_factor(name: str, value: float, *, above_one: bool) -> float:
    value = _check_positive_finite(name, value)
    if above_one and value <= 1.0:
        raise ValueError(f"LossScaler: {name} must be > 1.0 (the scale must grow), got {value!r}.")
    if not above_one and value >= 1.0:
        raise ValueError(f"LossScaler: {name} must be < 1.0 (the scale must shrink on overflow), got {value!r}.")
    return value


def _check_count(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"LossScaler: {name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _bound(name: str, value: float | None) -> float | None:
    """``None`` (or +inf) means "no bound"; otherwise a positive number fp32 can hold."""
    if value is None or value == math.inf:
        return None
    value = _check_positive_finite(name, value)
    if value > _FP32_MAX:
        raise ValueError(f"LossScaler: {name}={value!r} exceeds the fp32 range; use None for no bound.")
    return value


def _cpu_scalar(t: torch.Tensor) -> float:
    """The value of a one-element CPU tensor: a read of host memory, no device sync (the host-read tests in
    tests/amp/_host_reads.py let this one function through for CPU tensors)."""
    return float(t)


def _copy_valid_scale(scale: torch.Tensor, value: torch.Tensor, rejected: torch.Tensor) -> None:
    """``scale = value`` where ``value`` (one element, any device/dtype) lies in ``[SCALE_FLOOR, fp32 max]`` once in
    fp32 (the range ``_check_scale_value`` accepts), else keep ``scale`` and add 1 to ``rejected``: device-side ops
    only (no host sync)."""
    src = value.to(device=scale.device, dtype=torch.float32, non_blocking=True)
    ok = torch.isfinite(src) & (src >= SCALE_FLOOR)
    rejected.add_(~ok)
    torch.where(ok, src, scale, out=scale)


class LossScaler:
    """Dynamic (or static) loss scale kept on the device; see the module docstring for the math.

    Args:
        init_scale: the first scale ``S`` (within ``[min_scale, max_scale]`` when ``strict_bounds``).
        growth_factor: ``S *= growth_factor`` after ``growth_interval`` clean updates in a row (> 1).
        backoff_factor: ``S *= backoff_factor`` on an overflow that exhausts the hysteresis (< 1).
        growth_interval: clean updates needed before growing.
        hysteresis: consecutive overflows tolerated before backing off (1 = back off at the first,
            as torch does; 2 = Megatron's default).
        min_scale: floor for backoff (``None``: none). A floor keeps a NaN-from-step-0 run from driving
            ``S`` to zero; the skip warning says why steps are skipped.
        max_scale: cap for growth (``None`` or ``inf``: only "never grow to inf").
        dynamic: ``False`` gives a static scale: ``update`` never changes it and it never asks for a skip.
        device: where the state lives (default: ``torch.get_default_device()``); ``to()`` moves it.
        warn_after_skips: K for the skip warning (``None`` disables it); see the module docstring.
        strict_bounds: ``True`` (apex-style frontend): a scale given to the constructor or ``set_scale`` must
            lie within ``[min_scale, max_scale]`` (``ValueError`` otherwise) and a loaded one is clamped into
            it (with a warning). ``False`` (torch-style ``GradScaler``): any scale fp32 holds is accepted as
            given; the bounds only limit growth and backoff (see the module docstring).

    The update is device-side; ``get_scale()``, ``state_dict()`` and the periodic K-update check are
    the only reads back to the host.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        dynamic: bool = True,
        device: torch.device | str | None = None,
        warn_after_skips: int | None = 50,
        strict_bounds: bool = True,
    ) -> None:
        init_scale = _check_scale_value("init_scale", init_scale)
        self.growth_factor = _check_factor("growth_factor", growth_factor, above_one=True)
        self.backoff_factor = _check_factor("backoff_factor", backoff_factor, above_one=False)
        self.growth_interval = _check_count("growth_interval", growth_interval)
        self.hysteresis = _check_count("hysteresis", hysteresis)
        self.min_scale = _bound("min_scale", min_scale)
        self.max_scale = _bound("max_scale", max_scale)
        if self.min_scale is not None and self.max_scale is not None and self.min_scale > self.max_scale:
            raise ValueError(f"LossScaler: min_scale={self.min_scale} is larger than max_scale={self.max_scale}.")
        self.strict_bounds = bool(strict_bounds)
        if (
            dynamic
            and self.strict_bounds
            and (
                (self.min_scale is not None and init_scale < self.min_scale)
                or (self.max_scale is not None and init_scale > self.max_scale)
            )
        ):
            raise ValueError(
                f"LossScaler: init_scale={init_scale} lies outside [min_scale, max_scale] = "
                f"[{self.min_scale}, {self.max_scale}]; widen the bounds (None for no bound) or choose an "
                f"init_scale inside them."
            )
        self.dynamic = bool(dynamic)
        self.warn_after_skips = None if warn_after_skips is None else _check_count("warn_after_skips", warn_after_skips)

        dev = torch.device(device) if device is not None else torch.get_default_device()
        self.scale = torch.full((1,), init_scale, dtype=torch.float32, device=dev)
        self._make_state(dev, growth=0, skips=0)
        self._inv: tuple[int, int, torch.Tensor] | None = None  # (id(scale), scale._version, 1/scale)
        # host side of the skip check
        self._updates_in_window = 0
        # (host counters, host scale, CUDA event or None, window length)
        self._pending: tuple[torch.Tensor, torch.Tensor, Any, int] | None = None
        self._warned_ongoing = False

    def _make_state(self, device: torch.device, *, growth: int, skips: int) -> None:
        """Allocate the device state besides ``scale``.

        The skip counters are fp32 (exact up to 2**24) so that the per-update arithmetic is plain float
        math, ``streak = inf * (streak + 1)`` as one ``addcmul``: every op of ``update`` costs a few
        microseconds of launch/dispatch overhead, and int/bool mixes take slower paths.
        """
        self._growth = torch.full((1,), growth, dtype=torch.int32, device=device)  # torch's op wants int32
        self._skips = torch.tensor([float(skips), 0.0], dtype=torch.float32, device=device)  # [streak, window_max]
        self._streak, self._window_max = self._skips[0:1], self._skips[1:2]
        self._inf = torch.zeros(1, dtype=torch.float32, device=device)  # scratch: this update's 0/1 flag
        self._zero = torch.zeros(1, dtype=torch.float32, device=device)
        self._prev = torch.zeros(1, dtype=torch.float32, device=device)  # scratch: the scale before this update
        self._lo = torch.zeros(1, dtype=torch.float32, device=device)  # scratch: this update's effective floor
        self._rejected = torch.zeros(1, dtype=torch.int32, device=device)  # device set_scale values ignored
        self._bounds: tuple[Any, torch.Tensor | None, torch.Tensor | None] = (None, None, None)
        # CUDA: pinned host buffer [streak, window_max, scale] and an event for the skip-check snapshot,
        # allocated once here so that update() never allocates pinned memory.
        self._host: torch.Tensor | None = None
        self._event: Any = None
        if device.type == "cuda":
            self._host = torch.empty(3, dtype=torch.float32, pin_memory=True)
            self._event = torch.cuda.Event()

    def _bound_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp32 ``[1]`` device tensors of (min_scale or SCALE_FLOOR, max_scale), rebuilt when an option changed."""
        key = (self.min_scale, self.max_scale, self.scale.device)
        if self._bounds[0] != key:
            dev = self.scale.device
            lo = torch.full((1,), SCALE_FLOOR if self.min_scale is None else self.min_scale, device=dev)
            hi = None if self.max_scale is None else torch.full((1,), self.max_scale, device=dev)
            self._bounds = (key, lo, hi)
        return self._bounds[1], self._bounds[2]

    # ---------------------------------------------------------------- state access
    @property
    def device(self) -> torch.device:
        return self.scale.device

    @property
    def growth_tracker(self) -> torch.Tensor:
        """int32 ``[1]`` device tensor: consecutive clean updates (updated in place; replaced by ``to``)."""
        return self._growth

    @property
    def hysteresis_tracker(self) -> torch.Tensor:
        """int32 ``[1]`` device tensor ``max(hysteresis - consecutive_skips, 0)`` (computed, no sync)."""
        return torch.clamp(self.hysteresis - self._streak, min=0).to(torch.int32)

    @property
    def consecutive_skips(self) -> torch.Tensor:
        """int32 ``[1]`` device tensor: updates in a row that saw inf/NaN (0 after a clean one; computed)."""
        return self._streak.to(torch.int32)

    def to(self, device: torch.device | str) -> LossScaler:
        """Move the state to ``device`` (in place; returns ``self``)."""
        device = torch.device(device)
        if device != self.scale.device:
            self._harvest(block=True)
            growth, skips, rejected = self._growth.to(device), self._skips.to(device), self._rejected.to(device)
            self.scale = self.scale.to(device)
            self._make_state(device, growth=0, skips=0)
            self._growth.copy_(growth)
            self._skips.copy_(skips)
            self._rejected.copy_(rejected)
            self._inv = None
        return self

    def inv_scale(self) -> torch.Tensor:
        """fp32 ``[1]`` tensor ``1 / scale`` on the device, no host sync.

        The reciprocal is taken in float64 and rounded once to fp32, as torch's GradScaler does (exact for
        power-of-two scales). Cached until the scale tensor changes (tracked by its version counter).
        """
        scale = self.scale
        key = (id(scale), scale._version)
        if self._inv is None or self._inv[:2] != key:
            self._inv = (*key, scale.double().reciprocal().float())
        return self._inv[2]

    def new_found_inf(self) -> torch.Tensor:
        """A zeroed fp32 ``[1]`` overflow flag on the scaler's device, for ``unscale_and_check``."""
        return new_found_inf(self.scale.device)

    def get_scale(self) -> float:
        """The current scale as a Python float: a host sync, only when asked for. Also runs the skip check."""
        self._harvest(block=True)
        if self.warn_after_skips is not None and self._updates_in_window:
            self._snapshot()
            self._harvest(block=True)
        self._report_rejected()
        return float(self.scale.item())

    def set_scale(self, value: float | torch.Tensor, *, name: str = "scale") -> None:
        """Overwrite the scale: a float, or a one-element tensor (copied on the device, no sync).

        The value must lie in ``[2**-126, fp32 max]`` (else ``ValueError``; the scale is unchanged): positive and
        finite in fp32, with a finite reciprocal. A float is
        checked on the host. A CPU tensor is checked too (reading it is no device sync). A tensor on an
        accelerator cannot be checked without a sync, which torch's ``update(new_scale)`` does not do either:
        it is copied on the device only where its value is valid (``torch.where``), so the scale is never
        NaN, inf or 0; a rejected value leaves the scale unchanged and is reported by a ``RuntimeWarning`` at the
        next host read (``get_scale()``, ``state_dict()``). ``name`` is the argument's name in error messages.
        With ``strict_bounds`` a dynamic scale must also lie within ``[min_scale, max_scale]``: a float outside is
        an error, a tensor is clamped on the device.
        """
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"LossScaler.set_scale: expected a one-element tensor, got {value.numel()} elements.")
            src = value.detach().reshape(1)
            if src.device.type == "cpu":
                host = float(src.item())  # a CPU read, not a device sync
                _check_scale_value(name, host)
                if self.dynamic and self.strict_bounds:
                    host = min(max(host, self.min_scale or host), self.max_scale or host)
                self.scale.fill_(host)
                return
            _copy_valid_scale(self.scale, src, self._rejected)
            if self.dynamic and self.strict_bounds and (self.min_scale is not None or self.max_scale is not None):
                self.scale.clamp_(min=self.min_scale, max=self.max_scale)
            return
        value = _check_scale_value(name, value)
        if self.dynamic and self.strict_bounds:
            self._check_in_range(name, value)
        self.scale.fill_(value)

    def _report_rejected(self) -> None:
        """Warn about device-side ``set_scale`` values that were rejected since the last report (a host read)."""
        n = int(self._rejected.item())
        if n:
            self._rejected.zero_()
            warnings.warn(
                f"LossScaler.set_scale: {n} scale value(s) given as a device tensor were NaN, inf or <= 0 and were "
                f"ignored (the scale kept its previous value, now {float(self.scale.item()):g}).",
                RuntimeWarning,
                stacklevel=3,
            )

    def _check_in_range(self, name: str, value: float) -> None:
        if (self.min_scale is not None and value < self.min_scale) or (
            self.max_scale is not None and value > self.max_scale
        ):
            raise ValueError(
                f"LossScaler: {name}={value} lies outside [min_scale, max_scale] = [{self.min_scale}, "
                f"{self.max_scale}]; widen the bounds (None for no bound) or choose a scale inside them."
            )

    # ---------------------------------------------------------------- the state machine
    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the state machine by one step given this step's overflow flag (device-side, no sync).

        ``found_inf``: a one-element float tensor, non-zero (or NaN) when the step's gradients held inf/NaN,
        e.g. the sum of several per-optimizer flags. On another device it is copied over without blocking.
        """
        if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1 or not found_inf.is_floating_point():
            raise TypeError(
                "LossScaler.update: found_inf must be a one-element float tensor (e.g. from new_found_inf())."
            )
        if (
            found_inf.is_cpu
            and self.scale.is_cpu
            and self.dynamic
            and self.hysteresis == 1
            and self.min_scale is None
            and self.max_scale is None
            and _cpu_scalar(found_inf) == 0.0
        ):
            self._clean_cpu_update()
            return
        flag = as_fp16kit_flag(found_inf)
        if flag.device != self.scale.device:
            flag = flag.to(self.scale.device, non_blocking=True)
        inf, streak = self._inf, self._streak
        torch.ne(flag, self._zero, out=inf)  # 0/1 in fp32; NaN counts as an overflow
        torch.addcmul(inf, streak, inf, out=streak)  # streak = inf ? streak + 1 : 0
        if self.warn_after_skips is not None:
            torch.maximum(self._window_max, streak, out=self._window_max)
        if self.dynamic:
            growth = self._growth
            general_bounds = not self.strict_bounds and (self.min_scale is not None or self.max_scale is not None)
            if general_bounds:
                self._prev.copy_(self.scale)
            if self.hysteresis == 1:
                backoff = inf  # every overflow backs off: torch's semantics
            else:
                # back off once the overflow streak has used up the hysteresis; a tolerated overflow
                # parks the growth tracker at -1 so that the op below returns it to 0 without growing.
                backoff = (streak >= self.hysteresis).float()
                growth.masked_fill_(inf.bool(), -1)
            torch._amp_update_scale_(
                self.scale, growth, backoff, self.growth_factor, self.backoff_factor, self.growth_interval
            )
            if self.min_scale is None and self.max_scale is None:
                self.scale.clamp_(min=SCALE_FLOOR)  # backoff never reaches 0 (see the module docstring)
            elif not general_bounds:
                # strict bounds: the scale always lies inside them, so a plain clamp acts only on the new value
                lo, hi = self._bound_tensors()
                torch.maximum(self.scale, lo, out=self.scale)
                if hi is not None:
                    torch.minimum(self.scale, hi, out=self.scale)
            else:
                lo, hi = self._bound_tensors()
                prev, scale = self._prev, self.scale
                # bounds limit what growth/backoff produce; a scale already outside them is not moved by them
                torch.minimum(lo, prev, out=self._lo)
                torch.maximum(scale, self._lo, out=scale)
                if hi is not None:
                    torch.maximum(hi, prev, out=prev)
                    torch.minimum(scale, prev, out=scale)
        self._count_update()

    def update_clean(self) -> None:
        """``update`` for a step whose flag is known on the host to be 0 (e.g. ``GradScaler.step`` read it to decide
        whether to step): the same state as ``update(zero flag)``, without the flag's validation and read. On the
        CPU with torch's options that is the single op of :meth:`_clean_cpu_update`."""
        if (
            self.scale.is_cpu
            and self.dynamic
            and self.hysteresis == 1
            and self.min_scale is None
            and self.max_scale is None
        ):
            self._clean_cpu_update()
        else:
            self.update(self._zero)

    def _count_update(self) -> None:
        """Host side of the skip warning after each update: take a snapshot every ``warn_after_skips`` updates."""
        self._updates_in_window += 1
        if self.warn_after_skips is not None:
            self._harvest(block=False)
            if self._updates_in_window >= self.warn_after_skips and self._pending is None:
                self._snapshot()
                if self.scale.device.type == "cpu":
                    self._harvest(block=True)

    def _clean_cpu_update(self) -> None:
        """``update`` for a clean step (flag 0) on the CPU with torch's options (hysteresis 1, no floor, no cap).

        The general path's ops reduce to torch's update op alone there: the flag is 0 (the op gets the zero scratch,
        which also stands in for a non-fp32 flag), the skip streak becomes 0 (it is read, host memory, and zeroed
        only when it is not), ``window_max = max(window_max, 0)`` is unchanged, and the 2**-126 clamp is a no-op
        because growth never lowers the scale and the scale is never below 2**-126 (every way of setting it checks
        that). So the state after it is bitwise the general path's (tests/amp/test_scaler_update_fast.py), at one
        device op instead of five (~15 us less per iteration on a CPU; torch's own update runs that one op).
        """
        if _cpu_scalar(self._streak) != 0.0:
            self._streak.zero_()
        torch._amp_update_scale_(
            self.scale, self._growth, self._zero, self.growth_factor, self.backoff_factor, self.growth_interval
        )
        self._count_update()

    # ---------------------------------------------------------------- skip warning (host side)
    def _snapshot(self) -> None:
        """Copy (streak, window_max) to the host without blocking and reset window_max on the device."""
        src = self._skips
        if self._host is not None:  # CUDA: copy into the pinned buffer (free: no snapshot is pending)
            host, host_scale, event = self._host[0:2], self._host[2:3], self._event
            host.copy_(src, non_blocking=True)
            host_scale.copy_(self.scale, non_blocking=True)
            event.record()
        else:
            host, host_scale, event = src.clone(), self.scale.clone(), None
        self._window_max.zero_()
        self._pending = (host, host_scale, event, self._updates_in_window)
        self._updates_in_window = 0

    def _harvest(self, *, block: bool) -> None:
        """Read a pending snapshot if it has arrived (always, when ``block``) and warn if warranted."""
        if self._pending is None:
            return
        host, host_scale, event, window = self._pending
        if event is not None and not event.query():
            if not block:
                return
            event.synchronize()
        self._pending = None
        streak, window_max = (int(v) for v in host.tolist())
        k = self.warn_after_skips
        if k is None:
            return
        # A streak that was already reported and spans this whole window is the same streak: stay quiet.
        same_streak = self._warned_ongoing and streak > window
        if window_max >= k and not same_streak:
            self._warn(streak if streak >= k else window_max, float(host_scale[0]))
        self._warned_ongoing = streak >= k

    def _warn(self, count: int, scale: float) -> None:
        if self.dynamic:
            floor = (
                f"the min_scale floor ({self.min_scale}) keeps it from vanishing"
                if self.min_scale is not None
                else "set min_scale to keep it from vanishing"
            )
            msg = (
                f"fp16kit LossScaler: {count} optimizer steps in a row were skipped because the gradients held "
                f"inf/NaN, and the loss scale keeps backing off (now {scale:g}). If the loss itself is "
                f"inf/NaN (bad data, too high a learning rate, a bf16-pretrained model in fp16), no loss scale can "
                f"help: check the loss; {floor}."
            )
        else:
            msg = (
                f"fp16kit LossScaler: the static loss scale {scale:g} produced inf/NaN gradients in "
                f"{count} steps in a row, and static scaling does not skip them. Use a smaller scale or dynamic "
                f"loss scaling."
            )
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically (a host sync): scale, trackers, options."""
        self._harvest(block=True)
        self._report_rejected()
        growth = int(self._growth.item())
        streak = int(self._streak.item())
        return {
            "scale": float(self.scale.item()),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
            "growth_tracker": growth,
            "hysteresis_tracker": max(self.hysteresis - streak, 0),
            "consecutive_skips": streak,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output exactly; missing entries keep this scaler's options / reset trackers."""
        if "scale" not in state_dict:
            raise KeyError(
                f"LossScaler.load_state_dict: no 'scale' entry (keys: {sorted(state_dict)}); expected the output "
                f"of LossScaler.state_dict()."
            )
        # every option is checked before any is assigned: a rejected state dict changes nothing
        growth_factor = _check_factor(
            "growth_factor", state_dict.get("growth_factor", self.growth_factor), above_one=True
        )
        backoff_factor = _check_factor(
            "backoff_factor", state_dict.get("backoff_factor", self.backoff_factor), above_one=False
        )
        growth_interval = _check_count("growth_interval", state_dict.get("growth_interval", self.growth_interval))
        hysteresis = _check_count("hysteresis", state_dict.get("hysteresis", self.hysteresis))
        min_scale = _bound("min_scale", state_dict.get("min_scale", self.min_scale))
        max_scale = _bound("max_scale", state_dict.get("max_scale", self.max_scale))
        if min_scale is not None and max_scale is not None and min_scale > max_scale:
            raise ValueError(f"LossScaler: min_scale={min_scale} is larger than max_scale={max_scale}.")
        scale = _check_scale_value("scale", state_dict["scale"])
        if "consecutive_skips" in state_dict:
            skips = int(state_dict["consecutive_skips"])
        else:  # e.g. a checkpoint that stores only the hysteresis tracker
            skips = hysteresis - int(state_dict.get("hysteresis_tracker", hysteresis))
        if skips < 0:
            raise ValueError(f"LossScaler.load_state_dict: inconsistent trackers (consecutive skips {skips} < 0).")
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.hysteresis, self.min_scale, self.max_scale = hysteresis, min_scale, max_scale
        self.dynamic = bool(state_dict.get("dynamic", self.dynamic))
        self._pending = None
        self._updates_in_window = 0
        self._warned_ongoing = False
        if self.dynamic and self.strict_bounds:
            lo = self.min_scale if self.min_scale is not None else 0.0
            hi = self.max_scale if self.max_scale is not None else math.inf
            if not lo <= scale <= hi:
                clamped = min(max(scale, lo), hi)
                warnings.warn(
                    f"LossScaler.load_state_dict: the saved scale {scale} lies outside [min_scale, max_scale] = "
                    f"[{self.min_scale}, {self.max_scale}]; continuing from {clamped}.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                scale = clamped
        self.scale.fill_(scale)
        self._growth.fill_(int(state_dict.get("growth_tracker", 0)))
        self._skips.copy_(torch.tensor([float(skips), 0.0]))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return (
            f"LossScaler({kind}, device={self.scale.device}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale}, max_scale={self.max_scale})"
        )
