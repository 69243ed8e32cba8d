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

from collections import OrderedDict
from typing import Any

import torch

from ..loss_scaler import LossScaler
from .options import Options, maybe_print

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


def save_amp_state(destination: OrderedDict | None = None) -> OrderedDict:
    session = _current
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


def load_amp_state(state_dict: dict[str, Any]) -> None:
    session = _current
    if session is None or not session.enabled:
        raise RuntimeError(
            "amp.load_state_dict() needs amp state to load into: call amp.initialize(...) with the same opt_level "
            "first (resume order: initialize, then model / optimizer / amp load_state_dict)."
        )
    scalers = session.scalers
    if len(state_dict) != len(scalers):
        print(f"Warning: state_dict contains {len(state_dict)} entries, while {len(scalers)} loss_scalers are used")
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    idx = 0
    for key, entry in state_dict.items():
        if "loss_scaler" not in key:
            continue
        if idx > len(scalers) - 1:
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {len(scalers)}")
            break
        scaler = scalers[idx]
        extra = entry.get("fp16kit")
        if extra is not None:
            scaler.load_state_dict(extra)
            session.skipped[idx].fill_(int(extra.get("steps_skipped", 0)))
        else:  # an apex checkpoint: scale and growth counter only
            sd = scaler.state_dict()
            sd.update(scale=float(entry["loss_scale"]), growth_tracker=int(entry["unskipped"]))
            scaler.load_state_dict(sd)
        idx += 1
    if unexpected:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected)
            )
        )
