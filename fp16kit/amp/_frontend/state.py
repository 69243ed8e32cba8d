"""The state one ``amp.initialize`` call creates (a *session*) and apex's ``amp.state_dict`` format.

apex kept one global state, so a second ``initialize`` silently replaced the loss scalers of the
first. Here each call makes a :class:`Session` (options, loss scalers, printing); optimizers point to
their session, so ``scale_loss`` on an optimizer from an earlier call keeps using that call's scalers.
``amp.state_dict()`` / ``amp.load_state_dict()`` (no arguments, as in apex) act on the most recent
session.

State dict format (apex's keys, plus fp16kit's extras under ``"fp16kit"``)::

    OrderedDict({"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 17,
                                  "fp16kit": {<LossScaler.state_dict()>, "steps_skipped": 3}}, ...})

apex readers see the two keys they know; fp16kit restores the hysteresis and growth counters too, so
a resumed run continues bit-identically.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from ..loss_scaler import LossScaler
from .options import FP32_MAX, Options, as_real, maybe_print

__all__ = ["Session", "current_session", "load_amp_state", "save_amp_state", "set_current_session"]


class Session:
    """Options, loss scalers and verbosity of one ``amp.initialize`` call."""

    def __init__(self, options: Options | None, verbosity: int, scalers: list[LossScaler],
                 low_dtype: torch.dtype) -> None:
        self.options = options
        self.verbosity = verbosity
        self.scalers = scalers
        self.low_dtype = low_dtype
        # device-side count of skipped steps per loss scaler (no host sync to keep it)
        self.skipped = [torch.zeros(1, dtype=torch.int64, device=s.device) for s in scalers]

    @property
    def enabled(self) -> bool:
        return self.options is not None

    @property
    def passthrough(self) -> bool:
        """Static loss scale 1.0 without master weights: ``scale_loss`` yields ``loss.float()`` only."""
        return bool(self.options is not None and not self.options["master_weights"]
                    and self.options["loss_scale"] == 1.0)

    @property
    def master_weights(self) -> bool:
        return bool(self.options is not None and self.options["master_weights"])

    @property
    def patch_torch_functions(self) -> bool:
        return bool(self.options is not None and self.options["patch_torch_functions"])

    def say(self, msg: str) -> None:
        maybe_print(self.verbosity, msg)

    def steps_skipped(self, loss_id: int = 0) -> int:
        """Steps skipped because loss ``loss_id`` overflowed (a host read)."""
        return int(self.skipped[loss_id].item())


_current: Session | None = None


def current_session() -> Session | None:
    return _current


def set_current_session(session: Session) -> None:
    global _current
    _current = session


def save_amp_state(destination: OrderedDict | None = None, session: Session | None = None) -> OrderedDict:
    """``amp.state_dict()`` of ``session`` (default: the latest ``initialize``)."""
    session = _current if session is None else session
    destination = OrderedDict() if destination is None else destination
    if session is None or not session.enabled:
        return destination
    for idx, scaler in enumerate(session.scalers):
        extra = scaler.state_dict()
        extra["steps_skipped"] = session.steps_skipped(idx)
        destination[f"loss_scaler{idx}"] = {
            "loss_scale": extra["scale"],
            "unskipped": extra["growth_tracker"],
            "fp16kit": extra,
        }
    return destination


def _mode(dynamic: bool) -> str:
    return "dynamic" if dynamic else "static"


def _checked_scale(where: str, value: Any) -> float:
    """``value`` as a loss scale read from ``where`` (e.g. ``state_dict['loss_scaler0']['loss_scale']``)."""
    scale = as_real(value)
    if not 0.0 < scale <= FP32_MAX:  # NaN fails too
        raise ValueError(
            f"amp.load_state_dict: {where} = {value!r} is not a loss scale (a number in (0, {FP32_MAX:.8g}]): the "
            "checkpoint is corrupt. Nothing was loaded; resume from another checkpoint."
        )
    return scale


def _checked_count(where: str, value: Any) -> int:
    count = as_real(value)
    if not (math.isfinite(count) and count >= 0 and count == int(count)):
        raise ValueError(
            f"amp.load_state_dict: {where} = {value!r} is not a count (an integer >= 0): the checkpoint is corrupt. "
            "Nothing was loaded."
        )
    return int(count)


def _checked_entry(key: str, entry: Any) -> tuple[float, int, dict[str, Any] | None]:
    """Validate one ``loss_scalerN`` entry: ``(loss_scale, unskipped, fp16kit extras or None)``."""
    where = f"state_dict[{key!r}]"
    if not isinstance(entry, Mapping) or "loss_scale" not in entry or "unskipped" not in entry:
        raise ValueError(
            f"amp.load_state_dict: {where} must be a dict with 'loss_scale' and 'unskipped' (the output of "
            f"amp.state_dict()), got {entry!r}. Nothing was loaded."
        )
    scale = _checked_scale(f"{where}['loss_scale']", entry["loss_scale"])
    unskipped = _checked_count(f"{where}['unskipped']", entry["unskipped"])
    extra = entry.get("fp16kit")
    if extra is not None:
        if not isinstance(extra, Mapping) or "scale" not in extra:
            raise ValueError(f"amp.load_state_dict: {where}['fp16kit'] must be a dict with 'scale'; nothing loaded.")
        _checked_scale(f"{where}['fp16kit']['scale']", extra["scale"])
        for field in ("growth_tracker", "consecutive_skips", "hysteresis_tracker", "steps_skipped"):
            if field in extra:
                _checked_count(f"{where}['fp16kit'][{field!r}]", extra[field])
        extra = dict(extra)
    return scale, unskipped, extra


def load_amp_state(state_dict: dict[str, Any], session: Session | None = None) -> None:
    """Restore ``save_amp_state``'s (or apex's) output into the loss scalers of ``session`` (default: the current one).

    Every entry is validated before any scaler changes (a loss scale that is NaN, inf, <= 0 or beyond fp32,
    or a negative/non-integer counter, raises ``ValueError`` naming the key). The mode (dynamic/static) is
    the one ``initialize`` chose, never the checkpoint's: an entry written in the other mode (an O3 state
    resumed at O2) is not loaded, with a warning, and the scaler keeps the scale ``initialize`` gave it,
    because a static scale is a user setting, not a good start for dynamic scaling, and vice versa.
    """
    session = _current if session is None else session
    if session is None or not session.enabled:
        raise RuntimeError(
            "amp.load_state_dict() needs amp state to load into: call amp.initialize(...) with the same opt_level "
            "first (resume order: initialize, then model / optimizer / amp load_state_dict)."
        )
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"amp.load_state_dict expects the dict amp.state_dict() returns, got {type(state_dict)}.")
    scalers = session.scalers
    if len(state_dict) != len(scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(scalers)} loss_scalers are used")
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    plan = []
    for key, entry in state_dict.items():
        if "loss_scaler" not in key:
            continue
        if len(plan) > len(scalers) - 1:
            print(f"Skipping loss_scaler[{len(plan)}], since num_losses was set to {len(scalers)}")
            break
        plan.append((key, _checked_entry(key, entry)))
    for idx, (key, (scale, unskipped, extra)) in enumerate(plan):
        scaler = scalers[idx]
        if extra is None:  # an apex checkpoint: scale and growth counter only
            sd = scaler.state_dict()
            sd.update(scale=scale, growth_tracker=unskipped)
            scaler.load_state_dict(sd)
            continue
        saved_dynamic = bool(extra.get("dynamic", scaler.dynamic))
        if saved_dynamic != scaler.dynamic:
            opts, now = session.options, _mode(scaler.dynamic)
            warnings.warn(
                f"amp.load_state_dict: {key} was saved with {_mode(saved_dynamic)} loss scaling (scale "
                f"{extra['scale']}), but amp.initialize chose {now} loss scaling for this run "
                f"(opt_level={opts['opt_level']!r}, loss_scale={opts['loss_scale']!r}). Keeping {now} "
                f"scaling and its scale {scaler.get_scale()}; the checkpoint's scale state is not used. Call "
                f"amp.initialize with the opt_level/loss_scale the checkpoint was written with to continue it.",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        extra["dynamic"] = scaler.dynamic
        scaler.load_state_dict(extra)
        session.skipped[idx].fill_(int(extra.get("steps_skipped", 0)))
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected)
            )
        )
