"""Skipped steps counted and reported: the device counters (``hparam_skips``, ``nonfinite_skips``) and the
``on_nonfinite`` policy ("skip", "warn": on CUDA one step later without a sync, "raise": one documented sync).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = ["ReportMixin"]


class ReportMixin:
    """``FusedOptimizer``'s skip counters and reports (reads ``_skip_counts``, ``_pending``, ``on_nonfinite``)."""

    @property
    def hparam_skips(self) -> torch.Tensor | None:
        """Steps skipped on the device because a tensor hyper-parameter (``lr``) was NaN, inf or negative:
        a one-element int64 tensor on the params' device (None until a group has a tensor lr)."""
        return self.__dict__.get("_skip_counts", {}).get("hparam_skips")

    @property
    def nonfinite_skips(self) -> torch.Tensor | None:
        """Steps skipped on the device because a gradient held inf/NaN with no loss scaler attached (a scaler
        counts its own skips): a one-element int64 tensor on the params' device (None before the first step).
        A compiled step's only report under ``on_nonfinite="warn"`` (docs/optim.md)."""
        return self.__dict__.get("_skip_counts", {}).get("nonfinite_skips")

    def _count_and_report(
        self,
        bad_hp: torch.Tensor | None,
        own_flag: torch.Tensor | None,
        device: torch.device,
        *,
        counted: bool = False,
        report: bool = True,
    ) -> None:
        """After the update: count a skip for a bad tensor ``lr`` (``hparam_skips``) and, with no scaler's flag
        (``own_flag``: the step's own), a non-finite gradient (``nonfinite_skips``, unless the check pass
        ``counted`` it already on the device); then report each per ``on_nonfinite`` (not while ``report`` is
        False: a captured step)."""
        if bad_hp is not None:
            self._count("hparam_skips", bad_hp, device)
            if report:
                self._report(bad_hp, self._hparam_message)
        if own_flag is not None:
            if not counted:
                self._count("nonfinite_skips", own_flag, device)
            if report:
                self._report(own_flag, self._message)

    def _counter(self, name: str, device: torch.device) -> torch.Tensor:
        """The one-element int64 skip counter ``name`` on ``device`` (made on first use)."""
        counts = self._skip_counts
        counter = counts.get(name)
        if counter is None or counter.device != device:
            counter = counts[name] = torch.zeros(1, dtype=torch.int64, device=device)
        return counter

    def _count(self, name: str, flag: torch.Tensor, device: torch.device) -> None:
        """``self.<name> += flag`` on the device (a one-element int64 counter, made on first use)."""
        self._counter(name, device).add_(flag.reshape(1).to(torch.int64))

    # -- non-finite grads without a scaler ------------------------------------------------------------------

    def _message(self) -> str:
        return (
            f"{self._name}: a gradient holds inf or NaN"
            + (" or a magnitude of 2**63 (9.2e18) or more, whose square would overflow the second moment"
               if self._check_factor() != 1.0 else "")
            + "; the step was skipped (params, moments and the step counter are unchanged). Use a GradScaler "
            "for fp16 training, or lower the learning rate."
        )

    def _hparam_message(self) -> str:
        return (
            f"{self._name}: a tensor learning rate (or, in a compiled step, a step counter set by hand) is NaN, "
            f"inf or negative; the step was skipped on the device "
            f"(params, state and step counters are unchanged; optimizer.hparam_skips counts such steps). Check "
            f"the learning-rate schedule."
        )

    def _report(self, flag: torch.Tensor, message: Callable[[], str]) -> None:
        """Act on a skip flag (a one-element tensor) per ``on_nonfinite``: nothing, a warning (on CUDA one step
        later, no sync), or a RuntimeError (reads the flag: one sync per step on a GPU). ``message`` makes the text:
        called only for a skip reported now, or a flag kept for the next step."""
        if self.on_nonfinite == "skip":
            return
        if self.on_nonfinite == "warn" and torch.compiler.is_compiling():
            # A compiled step never reads the flag on the host (a graph break and, on a GPU, a sync): it is
            # counted on the device instead (``hparam_skips``/``nonfinite_skips``); "raise" keeps its read.
            return
        if self.on_nonfinite == "raise" or flag.device.type != "cuda":
            # A CPU tensor is read without any queue to drain; elsewhere "raise" is a documented sync.
            if bool(flag):
                text = message()
                if self.on_nonfinite == "raise":
                    raise RuntimeError(text)
                warnings.warn(text, RuntimeWarning, stacklevel=3)
            return
        # "warn" on CUDA: copy the flag to pinned host memory without a sync; look at it next step.
        host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag.reshape(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, message()))

    def _flush_warnings(self) -> None:
        """Warn for earlier skipped steps whose flag has reached the host (never waits)."""
        pending = self._pending
        if not pending:
            return
        still = []
        for event, host, message in pending:
            if not event.query():
                still.append((event, host, message))
            elif bool(host[0] != 0):
                warnings.warn(message, RuntimeWarning, stacklevel=3)
        # in place: the optimizer's attributes are not rebound (the steady step's check reads their version tag)
        pending[:] = still

