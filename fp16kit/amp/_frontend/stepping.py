"""``scale_loss`` and the patched ``optimizer.step`` / ``zero_grad``: when to unscale, when to skip.

Skip decision, per optimizer, after a ``scale_loss`` exit found an overflow (dynamic scaler only; a
static scale never skips, as in apex):

* fp16kit's fused optimizers (and torch's fused ones) declare ``_step_supports_amp_scaling``. For them
  nothing is read back: each ``scale_loss`` ORs its device flag into the optimizer's ``found_inf``, and
  ``step()`` hands it over as ``optimizer.found_inf`` (with ``optimizer.grad_scale``: None where the grads
  are unscaled already, the scale they carry where the optimizer keeps the masters and unscales itself,
  ``masters.FusedMasterStash``); the optimizer skips on the device. The overflow message, which needs the
  host, is printed once the flag has reached the host (pinned copy + CUDA event, polled without
  blocking at the next ``scale_loss`` / ``step`` / ``amp.state_dict``; at once on the CPU).
* Plain optimizers: the flag is read at ``scale_loss`` exit (a host sync, as apex did after every
  backward); on overflow the next ``step()`` is skipped and prints apex's message (once per overflow,
  however many optimizers skip).

``step(closure)`` on a step that is to be skipped raises: the closure would recompute a loss whose
gradients are thrown away.

Under master weights, a ``step()`` that finds fp16 model grads no ``scale_loss`` has unscaled and no master
grad (a trainer called ``loss.backward()`` itself) warns once per optimizer, naming ``amp.scale_loss``, and
does nothing: no weight changes, fp32 params (batchnorm) included, instead of a silent partial step.

The other trainer traps warn once per optimizer and kind, and the step runs (docs/trainer.md): grads with no
``scale_loss`` since the last step (O1 under a trainer's own backward: no loss scaling), grads still scaled by a last
``delay_unscale=True``, and fp16 model grads changed in place between ``scale_loss`` and ``step`` under O2 (a trainer
clipping ``model.parameters()``: on the fused path it clips the scaled grads the optimizer reads, elsewhere it has no
effect on the masters). Each check is an attribute test on the normal path; a pass over the params runs only once a
cheap condition points at the trap, or on the (already per-param) stash path with master weights.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ...kernels import merge_found_inf
from .._apex_state import record_unscale
from .masters import FusedMasterStash, OptimizerStash
from .state import Session

__all__ = ["ReportQueue", "install_step", "run_scale_loss"]

_CLOSURE_ON_SKIP = (
    "optimizer.step(closure) was called for a step that amp must skip (the gradients overflowed). A closure "
    "cannot be used for a skipped step: call optimizer.step() without a closure under amp."
)


class _Overflow:
    """One overflow of loss scaler ``loss_id``; prints apex's message at most once."""

    def __init__(self, session: Session, loss_id: int, scale: float) -> None:
        self.session, self.loss_id, self.scale, self.printed = session, loss_id, scale, False

    def report(self) -> None:
        if not self.printed:
            self.printed = True
            self.session.say(
                f"Gradient overflow.  Skipping step, loss scaler {self.loss_id} reducing loss scale to {self.scale}"
            )


class ReportQueue:
    """Overflow flags on their way to the host for the device-side skip path (never blocks unless asked)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Session, int, torch.Tensor, torch.Tensor, Any]] = []

    def push(self, session: Session, loss_id: int, found_inf: torch.Tensor, scale: torch.Tensor) -> None:
        if session.verbosity <= 0:
            return
        if found_inf.device.type == "cuda":
            host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            host[0:1].copy_(found_inf, non_blocking=True)
            host[1:2].copy_(scale, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((session, loss_id, host, host, event))
        else:
            self._pending.append((session, loss_id, found_inf.clone(), scale.clone(), None))

    def clear(self) -> None:
        """Forget every pending report (nothing is printed)."""
        self._pending = []

    def poll(self, block: bool = False) -> None:
        keep = []
        for item in self._pending:
            session, loss_id, flag, scale, event = item
            if event is not None and not event.query():
                if not block:
                    keep.append(item)
                    continue
                event.synchronize()
            if event is not None:
                found, value = float(flag[0]), float(flag[1])
            else:
                found, value = float(flag), float(scale)
            if found:
                _Overflow(session, loss_id, value).report()
        self._pending = keep


REPORTS = ReportQueue()


@contextlib.contextmanager
def run_scale_loss(
    session: Session,
    loss: torch.Tensor,
    stashes: list[OptimizerStash],
    loss_id: int,
    delay_unscale: bool,
    delay_overflow_check: bool,
) -> Iterator[torch.Tensor]:
    """The body of ``amp.scale_loss`` for an enabled session (see the module and frontend docstrings)."""
    if not 0 <= loss_id < len(session.scalers):
        raise ValueError(
            f"scale_loss: loss_id={loss_id} but amp.initialize created {len(session.scalers)} loss scaler(s) "
            "(num_losses); pass num_losses=<number of losses> to amp.initialize."
        )
    REPORTS.poll()
    scaler = session.scalers[loss_id]
    if loss.device != scaler.device:  # e.g. initialize ran before the model moved to the GPU
        scaler.to(loss.device)
        session.skipped[loss_id] = session.skipped[loss_id].to(loss.device)
    if session.passthrough:  # static scale 1.0, no master weights: nothing to scale or unscale
        yield loss.float()
        return

    for stash in stashes:
        stash.scale_loss_seen = True
        # grads an earlier scale_loss left scaled for the step (fused masters) go into fp32 sums first
        if stash.settle_pending() or (not delay_unscale and not stash.params_have_scaled_gradients):
            stash.prepare()

    try:
        yield loss.float() * scaler.scale.reshape(())
    except BaseException:  # the backward failed: put back the gradients that were there before
        for stash in stashes:
            stash.restore()
        raise

    if delay_unscale:
        for stash in stashes:
            stash.params_have_scaled_gradients = True
        return
    found_inf = scaler.new_found_inf()
    inv_scale = scaler.inv_scale()
    for stash in stashes:
        stash.unscale(inv_scale, found_inf, scaler.scale)
        stash.params_have_scaled_gradients = False
    record_unscale(scaler, found_inf)  # apex's _overflow_buf, where a script looks at it (amp/_apex_state.py)
    if delay_overflow_check:
        return
    scaler.update(found_inf)  # a static scale never changes; its update only feeds the repeated-inf warning
    if not scaler.dynamic:
        return
    session.skipped[loss_id].add_((found_inf != 0).to(torch.int64))
    if all(stash.fused for stash in stashes):
        for stash in stashes:
            earlier = [] if stash.found_inf is None else [stash.found_inf]
            stash.found_inf = merge_found_inf([*earlier, found_inf], found_inf.device)
        REPORTS.push(session, loss_id, found_inf, scaler.scale)
    elif float(found_inf[0]) != 0.0:  # host read: apex's behaviour for optimizers that cannot skip on the device
        overflow = _Overflow(session, loss_id, scaler.get_scale())
        for stash in stashes:
            if stash.skip is None:
                stash.skip = overflow


def install_step(optimizer: torch.optim.Optimizer, stash: OptimizerStash, disable_casts: bool) -> None:
    """Replace ``optimizer.step`` (skip / device flag / casts off / masters -> model) and, with master
    weights, ``optimizer.zero_grad`` (model grads and master grads)."""
    original_step = optimizer.step

    def step(self: torch.optim.Optimizer, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
        REPORTS.poll()
        seen, stash.scale_loss_seen = stash.scale_loss_seen, False
        if stash.skip is not None:
            if closure is not None:
                raise RuntimeError(_CLOSURE_ON_SKIP)
            overflow, stash.skip = stash.skip, None
            overflow.report()
            stash.found_inf = None
            stash.discard()
            return None
        if stash.model_grads_bypassed_scale_loss():
            _warn_backward_outside_scale_loss(stash)
            return None
        if closure is None:
            _check_unscaled_gradients(stash, seen)
        flag, stash.found_inf = stash.found_inf, None
        if flag is not None and closure is not None and float(flag[0]) != 0.0:
            raise RuntimeError(_CLOSURE_ON_SKIP)

        def call() -> Any:
            if disable_casts:
                from .. import disable_casts as no_casts

                with no_casts():
                    return _call(original_step, closure, args, kwargs)
            return _call(original_step, closure, args, kwargs)

        if closure is not None:  # its scale_loss runs inside the optimizer's step: unscaled fp32 master grads
            stash.use_master_grads()
        # hands over grad_scale / found_inf, writes masters -> model where the optimizer does not (masters.py)
        result = stash.run_step(flag, call)
        if getattr(stash, "scaled_grads_changed", False):
            stash.scaled_grads_changed = False
            _warn_once(stash, "scaled_grads_changed", _SCALED_GRADS_CHANGED)
        REPORTS.poll()
        return result

    # a bound method, as apex installed it: torch's LR schedulers re-wrap ``optimizer.step.__func__``
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]

    if stash.master_weights:
        original_zero_grad = optimizer.zero_grad

        def zero_grad(self: torch.optim.Optimizer, set_to_none: bool | None = None) -> None:
            if set_to_none is None:  # the optimizer's own default (fp16kit's fused ones: set_grad_none)
                original_zero_grad()
                set_to_none = bool(getattr(optimizer, "set_grad_none", True))
            else:
                original_zero_grad(set_to_none)
            for p in stash.model:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_()
                        p.grad.zero_()
            stash.discard()
            stash.mark_model_grads_seen()  # zeroed grads are not a backward outside scale_loss

        optimizer.zero_grad = types.MethodType(zero_grad, optimizer)  # type: ignore[method-assign]


_TRAINER_FIX = (
    "Under the HF Trainer use fp16kit.integrations.transformers.AmpTrainer (apex-style amp done right: loss scaling, "
    "clipping of the unscaled fp32 grads, amp state in its checkpoints), or Trainer(fp16=True / bf16=True) without "
    "amp.initialize; under accelerate use fp16kit.integrations.accelerate.backward (docs/trainer.md)."
)

_BACKWARD_OUTSIDE_SCALE_LOSS = (
    "amp: optimizer.step() found gradients on the fp16 model parameters but none on the fp32 master weights "
    "the optimizer updates, so this step changes no weight (and neither will the next ones). The backward ran "
    "outside amp.scale_loss: a trainer that calls loss.backward() itself (HF Trainer, accelerate) or a last "
    "scale_loss with delay_unscale=True. With master weights (O2) only amp.scale_loss moves the gradients into "
    "the masters: run the backward as `with amp.scale_loss(loss, optimizer) as scaled_loss: "
    "scaled_loss.backward()`. " + _TRAINER_FIX + " (This warning is shown once per optimizer.)"
)


_NO_SCALE_LOSS = (
    "amp: optimizer.step() found gradients that no amp.scale_loss produced since the last step: the backward ran "
    "outside amp.scale_loss (a trainer that calls loss.backward() itself: HF Trainer, accelerate), so the fp16 "
    "gradients were not loss-scaled (small ones flush to zero) and no overflow was checked. Run the backward as "
    "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`. " + _TRAINER_FIX
    + " (This warning is shown once per optimizer.)"
)

_STILL_SCALED = (
    "amp: optimizer.step() got gradients that are still multiplied by the loss scale: the last amp.scale_loss "
    "before this step had delay_unscale=True, so nothing unscaled them and the update is scale times too large. "
    "Leave delay_unscale=False on the last backward before each step. (This warning is shown once per optimizer.)"
)

_SCALED_GRADS_CHANGED = (
    "amp: the fp16 model gradients were changed in place between amp.scale_loss and optimizer.step() while they still "
    "held the loss-scaled values (O2 with fp16kit's FusedAdam/FusedLAMB keeps them scaled for the step), e.g. by "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or the HF Trainer's max_grad_norm / "
    "accelerator.clip_grad_norm_: that clips the scaled gradients, far too hard (the updates come out too small), "
    "and reports loss-scale times the true norm. Clip the unscaled fp32 master gradients instead: "
    "clip_grad_norm_(amp.master_params(optimizer), max_norm). " + _TRAINER_FIX
    + " (This warning is shown once per optimizer.)"
)

_MODEL_GRADS_CHANGED = (
    "amp: the fp16 model gradients were changed in place after amp.scale_loss had moved them into the fp32 master "
    "gradients, which are what the optimizer steps (O2): the change (e.g. torch.nn.utils.clip_grad_norm_"
    "(model.parameters(), max_norm), the HF Trainer's max_grad_norm) has no effect, and a norm computed from them is "
    "loss-scale times the true one. Clip the masters instead: clip_grad_norm_(amp.master_params(optimizer), max_norm). "
    + _TRAINER_FIX + " (This warning is shown once per optimizer.)"
)


def _warn_once(stash: OptimizerStash, key: str, message: str) -> None:
    if key not in stash.warned:
        stash.warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _check_unscaled_gradients(stash: OptimizerStash, scale_loss_seen: bool) -> None:
    """Before a step without closure: warn (once per kind, per optimizer) where the gradients the optimizer is about
    to read carry no loss scaling, are still scaled, or were changed after ``scale_loss`` without effect. Checks
    that cost a pass over the params run only when a cheap condition already points at a problem (or, for the last
    one, on the master-weights path that loops over the params anyway)."""
    if stash.params_have_scaled_gradients and not stash.master_weights:
        _warn_once(stash, "still_scaled", _STILL_SCALED)
    elif (not scale_loss_seen and not stash.master_weights and not stash.session.passthrough
          and "no_scale_loss" not in stash.warned and any(p.grad is not None for p in stash.direct)):
        _warn_once(stash, "no_scale_loss", _NO_SCALE_LOSS)
    elif (stash.master_weights and (not isinstance(stash, FusedMasterStash) or stash.materialized)
          and "model_grads_changed" not in stash.warned and stash.model_grads_changed_since_unscale()):
        _warn_once(stash, "model_grads_changed", _MODEL_GRADS_CHANGED)


def _warn_backward_outside_scale_loss(stash: OptimizerStash) -> None:
    if not stash.warned_backward_outside_scale_loss:
        stash.warned_backward_outside_scale_loss = True
        warnings.warn(_BACKWARD_OUTSIDE_SCALE_LOSS, RuntimeWarning, stacklevel=3)


def _call(step: Any, closure: Any, args: tuple, kwargs: dict) -> Any:
    return step(*args, **kwargs) if closure is None else step(closure, *args, **kwargs)
