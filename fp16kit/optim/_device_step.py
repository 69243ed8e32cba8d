"""The device step (docs/optim.md, "The step on the device"): nothing copied from the host and nothing read back,
so a CUDA graph can capture it. The kernels derive the hyper-parameters from the device step counter
(``fp16kit.kernels.DeviceStep``); a steady step (the same rows at the same addresses, the same hyper-parameters,
flags and counters as the step before) is recorded once and then replayed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from operator import is_not
from typing import Any

import torch

from fp16kit.kernels import (
    Backend,
    DeviceStep,
    check_found_inf,
    flag_is_final,
    flag_nonfinite,
    select_backend,
    step_check,
    vouched_rows,
)
from fp16kit.kernels.optimizers import record_launches, replay_launches

from . import functional as F
from ._context import capturing
from ._rows import _Rows
from ._steady import SteadyPlan, settings

__all__ = ["DeviceStepMixin"]

_data_ptr = torch.Tensor.data_ptr
_not_none = functools.partial(is_not, None)  # C-level: filter(_not_none, models) drops the None entries


def _written(all_rows: list[_Rows]) -> list[torch.Tensor]:
    """Every tensor the update writes: params or masters, moments, model copies."""
    written: list[torch.Tensor] = []
    for rows in all_rows:
        written += rows.params
        written += rows.exp_avgs
        written += rows.exp_avg_sqs
        written += filter(_not_none, rows.models)
    return written


class DeviceStepMixin:
    """``FusedOptimizer``'s device step (the subclass's ``_device_step`` and ``_run_device_update`` are the
    kernels' part)."""

    def _device_step(self, group: dict[str, Any], base: DeviceStep) -> DeviceStep | None:
        """The group's step for kernels that derive their hyper-parameters on the device (``base`` with the
        group's host numbers filled in, :meth:`_adam_like_step`), or None where the subclass has no such kernels."""
        return None

    @staticmethod
    def _adam_like_step(
        group: dict[str, Any], base: DeviceStep, legacy: Callable[[], torch.Tensor], **extra: float
    ) -> DeviceStep:
        """``base`` with the host numbers Adam and LAMB share (``lr`` unless a tensor, ``beta1``, ``beta2``, ``eps``,
        ``weight_decay``) and ``extra``, a tensor ``lr`` (validated), the bias-correction switch, and ``legacy``:
        the same step's float64 vector for rows the kernels do not take."""
        b1, b2 = (float(b) for b in group["betas"])
        lr = group["lr"]
        host = {
            "lr": 0.0 if isinstance(lr, torch.Tensor) else float(lr),
            "beta1": b1,
            "beta2": b2,
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            **extra,
        }
        return dataclasses.replace(
            base, host=host, lr=F.device_lr(lr, base.step.device), bias_correction=bool(group["bias_correction"]),
            legacy=legacy,
        )

    def _on_device(self, device: torch.device) -> bool:
        """Can this eager step run device-resident? Triton kernels on ``device``, a subclass with device-step
        kernels, and a GradScaler's ``grad_scale`` (if any) a one-element float tensor on ``device``."""
        if torch.compiler.is_compiling() or type(self)._device_step is DeviceStepMixin._device_step:
            return False
        if select_backend(device).backend is Backend.TORCH:
            return False
        scale = getattr(self, "grad_scale", None)
        return scale is None or (
            isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.is_floating_point()
            and scale.device == device
        )

    def _device_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The optimizer's own flag and gradient norm (float32 ``[1]`` each) on ``device``, made once: a step
        writes them whole, so it needs no fill (and a captured graph replays into the same memory)."""
        store = self._skip_counts
        key = f"buffers:{device}"
        bufs = store.get(key)
        if bufs is None:
            bufs = store[key] = torch.zeros(2, dtype=torch.float32, device=device)
        return {"flag": bufs[0:1], "gnorm": bufs[1:2]}

    def _step_on_device(self, all_rows: list[_Rows], device: torch.device) -> None:
        """``step`` with nothing copied from the host and nothing read back (CUDA-graph capturable).

        Launches per step and (device, dtype) group: the check pass (inf/NaN flag, the norm when the update uses
        it, and the skip count, finished in the same launch) and the update kernels, which derive the
        hyper-parameters from the device step counter and advance it (``fp16kit.kernels.DeviceStep``). A tensor
        ``lr`` adds the device check of its value (a few torch ops); anything the kernels cannot take (several
        grad dtypes, layouts the planner sends to the torch fallback) runs the torch passes for that part.

        A steady step (the same rows at the same addresses with the same metadata, the same hyper-parameters, flags
        and counters as the step before) is recorded once and then replayed (:meth:`_replay_key`): the recorded
        launches issued again, the written tensors' versions bumped, the skip reported, and nothing planned.
        """
        cache = self._step_cache
        key = self._replay_key(all_rows, device) if self.device_replay else None
        # Record a step whose key repeats the last one (a steady loop: grads kept, nothing changed), never while a
        # CUDA graph captures (the recording's bookkeeping is host work the capture need not see).
        recording = key is not None and key == cache.get("device_key") and not capturing()
        if self.device_replay:
            cache["device_key"], cache["steady"] = key, None
        with record_launches(device) if recording else contextlib.nullcontext() as rec:
            bad_hp, found_inf, own_flag, counted, grads = self._device_pass(all_rows, device)
        grad_scale = getattr(self, "grad_scale", None)
        # (no launch recorded: the kernels were not ours to hook, e.g. replaced by a test's recorders)
        recorded = rec is not None and rec.ok and bad_hp is None and bool(rec.launches)
        if self.unscale_grads and grad_scale is not None:
            self._write_unscaled_grads(grads, F.inv_scale_from_grad_scale(grad_scale, device), device)
            recorded = False
        captured = device.type == "cuda" and capturing()
        self._count_and_report(bad_hp, found_inf if own_flag else None, device, counted=counted, report=not captured)
        if recorded:  # the facts as the next step will find them (this step's counters and buffers made)
            row_keys = (*self._moment_keys, self._paired_key)
            cache["steady"] = SteadyPlan(self, device, rec.launches, counted, _written(all_rows), row_keys)

    def _device_pass(
        self, all_rows: list[_Rows], device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor, bool, bool, list[torch.Tensor]]:
        """The device step's launches (and the torch passes for what the kernels cannot take): ``(bad_hp,
        found_inf, own_flag, counted, grads)`` for the report that follows."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        own_flag = found_inf is None
        bufs = self._device_buffers(device)
        if own_flag:
            found_inf = bufs["flag"]
        else:
            check_found_inf(f"{self._name}.step", found_inf, device)
        verdicts = self.__dict__.get("_verdicts", {})
        # One group: its own grads list, which its verdict's guard checked this step (_collect), so the planner may
        # take that for its own guard over the same list (fp16kit.kernels.vouched_rows): one pass less per step.
        only = verdicts.get(id(self.param_groups[0])) if len(all_rows) == 1 else None
        grads = all_rows[0].grads if only is not None else [g for rows in all_rows for g in rows.grads]
        norm = self._needs_grad_norm()
        gnorm = bufs["gnorm"]
        counter = self._counter("nonfinite_skips", device) if own_flag else None
        counted = False
        if own_flag or norm or not flag_is_final(self):
            factor = 1.0 if norm else self._check_factor()
            with vouched_rows(only, (grads,)) if only is not None else contextlib.nullcontext():
                counted = step_check(grads, grad_scale, found_inf, gnorm if norm else None, own_flag=own_flag,
                                     skip_count=counter, check_factor=factor)
            if not counted:  # the torch passes (several grad dtypes, the fallback's layouts)
                inv64 = F.inv_scale_from_grad_scale(grad_scale, device)
                if own_flag:
                    found_inf.zero_()
                if norm:
                    gnorm.copy_(F.check_and_norm(grads, inv64, found_inf, exact=self._exact_norm()).reshape(1))
                else:
                    flag_nonfinite(grads, inv64.float() * factor, found_inf)
        bad_hp = F.bad_lr_flag([g["lr"] for g in self.param_groups], device)
        skip = found_inf if bad_hp is None else torch.maximum(found_inf.reshape(1), bad_hp)
        for gi, (group, rows) in enumerate(zip(self.param_groups, all_rows)):
            step = self._own_step(gi, group, device)
            if not rows.params:  # no grads: the counter stays (docs/optim.md, "Step counters")
                continue
            base = DeviceStep(step, {}, scale=grad_scale, gnorm=gnorm)
            ds = self._device_step(group, base)
            verdict = verdicts.get(id(group))
            rows_t = (rows.params, rows.grads, rows.exp_avgs, rows.exp_avg_sqs, rows.models)
            with vouched_rows(verdict, rows_t) if verdict is not None else contextlib.nullcontext():
                self._run_device_update(group, rows, ds, skip)
        return bad_hp, found_inf, own_flag, counted, grads

    #: Replay steady device steps from their recording (:meth:`_step_on_device`); False: every step takes the full
    #: path (``benchmarks/bench_device_step_host.py`` times both in one run).
    device_replay: bool = True

    def _replay_key(self, all_rows: list[_Rows], device: torch.device) -> tuple | None:
        """What a full device step's launches depend on, or None when this step cannot be recorded: every group's
        verdict (the rows' metadata, checked by its guard in :meth:`_collect`), the addresses of every row tensor,
        and ``_steady.settings`` (hyper-parameters, own settings, the scaler's tensors, counters, backend). Two
        full steps with equal keys issue the same launches with the same arguments: the second is recorded."""
        verdicts = self.__dict__.get("_verdicts")
        if not verdicts or torch.compiler.is_compiling():
            return None
        vs = tuple(map(verdicts.get, map(id, self.param_groups)))
        if None in vs:
            return None
        grads = [g for rows in all_rows for g in rows.grads]
        return (vs, tuple(map(_data_ptr, _written(all_rows))), tuple(map(_data_ptr, grads)), settings(self, device))

    def _replay_steady(self) -> bool:
        """The step's first stage: replay the recorded steady step (``_steady.SteadyPlan``) when it still holds,
        else False (the full path runs, and records again after two equal steps). Not while compiling, nor with
        ``device_replay`` off."""
        plan = self._step_cache.get("steady")
        if plan is None or not self.device_replay or torch.compiler.is_compiling():
            return False
        device = plan.device
        if not self._on_device(device) or not plan.holds(self):  # (the device step still the path to take)
            return False
        for gi, group in enumerate(self.param_groups):
            self._own_step(gi, group, device)
        replay_launches(plan.launches)
        torch._C._increment_version(plan.written)
        captured = device.type == "cuda" and capturing()
        self._count_and_report(None, plan.flag, device, counted=plan.counted, report=not captured)
        return True

    def _forget_steady_step(self) -> None:
        """Drop the recorded steady step (a checkpoint loaded, a group added): the next steps take the full path."""
        self._step_cache.pop("steady", None)
        self._step_cache.pop("device_key", None)

    def _run_device_update(self, group: dict[str, Any], rows: _Rows, ds: DeviceStep, skip: torch.Tensor) -> None:
        raise NotImplementedError
