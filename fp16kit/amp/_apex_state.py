"""Compatibility shims for apex internals that scripts reach into: ``amp._amp_state``, ``optimizer._amp_stash``
lists, ``optimizer._lazy_init_maybe_master_weights()``.

They are thin views on fp16kit's own frontend state (the latest ``amp.initialize`` session, the optimizer's
stash): nothing here keeps a second copy. Each has a public fp16kit way (docs/migrating-from-apex.md):

=====================================================  ===========================================================
apex internal                                           public fp16kit way
=====================================================  ===========================================================
``_amp_state.loss_scalers[i].loss_scale()``             ``amp.state_dict()["loss_scaler{i}"]["loss_scale"]``
``_amp_state.loss_scalers[i]._loss_scale = s``          ``amp.load_state_dict`` with ``loss_scale`` set to ``s``
``_amp_state.loss_scalers[i]._overflow_buf``,           ``scale_loss`` without ``delay_overflow_check`` (amp
``update_scale()``, ``_has_overflow``                   skips overflowed steps itself, on the device)
``_amp_state.opt_properties.master_weights`` etc.      the options passed to ``amp.initialize``
``_amp_state.allow_incoming_model_not_fp32 = True``     pass an fp32 model (initialize casts it)
``optimizer._amp_stash.all_fp32_from_fp16_params``      ``list(amp.master_params(optimizer))`` (masters)
``optimizer._amp_stash.all_fp16_params``                the model's low-precision parameters
``optimizer._lazy_init_maybe_master_weights()``         nothing: masters exist from ``amp.initialize`` on
=====================================================  ===========================================================

``optimizer.add_param_group`` after ``initialize`` (apex wrapped it) is the frontend's own: see
``fp16kit/amp/_frontend/masters.py``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

__all__ = ["AmpStateView", "ApexStashNames", "install_optimizer_shims", "low_precision_models_allowed",
           "record_unscale"]


class _LossScalerView:
    """apex's ``LossScaler`` face on fp16kit's :class:`~fp16kit.amp.LossScaler` (reads are host syncs).

    One view per scaler (``amp._amp_state.loss_scalers[i]`` is the same object every time), because scripts keep
    state on it between calls, as on apex's object:

    * ``_overflow_buf``: apex's one-element int overflow flag on the scaler's device. Every ``scale_loss`` exit that
      unscales (``delay_overflow_check=True`` included) sets it to that exit's inf/NaN verdict, as apex's
      ``clear_overflow_state()`` + fused unscale did; scripts may swap in their own buffer (NVIDIA
      DeepLearningExamples' BERT does, after its own ``amp_C.multi_tensor_scale`` checks).
    * ``update_scale()``: apex's host-side step decision: reads ``_overflow_buf`` (a host sync), backs the scale off
      (to ``min_loss_scale`` at the lowest) and returns True when it overflowed, else counts a clean step (growth
      after ``scale_window`` of them); the scale moves exactly as ``scale_loss`` would move it. Meant for
      ``scale_loss(..., delay_overflow_check=True)``, where amp neither updates the scale nor skips the step: the
      script calls it and skips ``optimizer.step()`` itself when it returns True.
    * ``_has_overflow``: the verdict of the last ``update_scale()`` (reset by the next unscaling ``scale_loss``).

    The device flag is written only once a view exists (a script touched ``_amp_state.loss_scalers``): other
    scripts pay nothing for it.
    """

    def __init__(self, scaler: Any, session: Any, index: int) -> None:
        self._scaler = scaler
        self._session = session
        self._index = index
        self._overflow_buf = torch.zeros(1, dtype=torch.int32, device=scaler.device)
        self._has_overflow = False

    # ------------------------------------------------------------------ apex's attributes
    def loss_scale(self) -> float:
        return self._scaler.get_scale()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        """apex stored any value; a dynamic fp16kit scaler keeps its scale within ``[min_loss_scale,
        max_loss_scale]``, so a value outside (a script's ``init_loss_scale = 2**32`` under the default cap 2**24) is
        clamped into it, with a warning (apex's first growth would have clamped it the same way)."""
        scaler, value = self._scaler, float(value)
        lo, hi = scaler.min_scale, scaler.max_scale
        if scaler.dynamic and ((lo is not None and value < lo) or (hi is not None and value > hi)):
            clamped = min(max(value, lo if lo is not None else value), hi if hi is not None else value)
            warnings.warn(
                f"amp._amp_state.loss_scalers[{self._index}]._loss_scale = {value:g} lies outside [min_loss_scale, "
                f"max_loss_scale] = [{lo}, {hi}]; using {clamped:g}. Pass max_loss_scale= (or min_loss_scale=) to "
                "amp.initialize to allow it.",
                RuntimeWarning,
                stacklevel=2,
            )
            value = clamped
        scaler.set_scale(value)

    @property
    def dynamic(self) -> bool:
        return bool(self._scaler.dynamic)

    @property
    def _unskipped(self) -> int:
        return int(self._scaler.growth_tracker.reshape(-1)[0].item())

    @property
    def _scale_seq_len(self) -> int:
        return int(self._scaler.growth_interval)

    @property
    def _min_loss_scale(self) -> float | None:
        return self._scaler.min_scale

    @property
    def _max_loss_scale(self) -> float | None:
        return self._scaler.max_scale

    # ------------------------------------------------------------------ apex's overflow protocol
    def clear_overflow_state(self) -> None:
        """apex: forget the overflow verdict and zero ``_overflow_buf`` (device op, no sync)."""
        self._has_overflow = False
        self._overflow_buf.zero_()

    def _record_unscale(self, found_inf: torch.Tensor) -> None:
        """A ``scale_loss`` exit unscaled this step's grads with verdict ``found_inf`` (fp32 flag): apex's
        ``clear_overflow_state()`` followed by the unscale that raised ``_overflow_buf`` (device ops only)."""
        self._has_overflow = False
        buf = self._overflow_buf
        flag = found_inf.reshape(-1)[:1]
        if flag.device != buf.device:
            flag = flag.to(buf.device, non_blocking=True)
        buf.copy_((flag != 0).reshape(buf.shape))

    def update_scale(self) -> bool:
        """apex's ``LossScaler.update_scale()``: True (skip this step) if ``_overflow_buf`` is set and the scale is
        dynamic; the scale is backed off, or the clean step counted, as fp16kit's scaler does after a
        ``scale_loss`` (same state, same checkpoints). A host sync (apex's too)."""
        scaler = self._scaler
        if scaler.dynamic and not self._has_overflow:
            self._has_overflow = bool(int(self._overflow_buf.reshape(-1)[0].item()) != 0)
        skip = bool(self._has_overflow and scaler.dynamic)
        if skip:
            scaler.update(torch.ones(1, dtype=torch.float32, device=scaler.device))
            skipped = self._session.skipped[self._index]
            skipped.add_(1)
        else:
            scaler.update_clean()
        return skip

    def unscale(self, model_grads: list[torch.Tensor], master_grads: list[torch.Tensor], unused_scale: Any = None,
                models_are_masters: bool = False, scale_override: float | None = None) -> None:
        """apex: ``master = model * (1 / scale)`` over the lists, raising ``_overflow_buf`` on inf/NaN (no sync)."""
        if self._has_overflow:
            return
        from ..amp_C import multi_tensor_scale

        scale = self.loss_scale() if scale_override is None else float(scale_override)
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        multi_tensor_scale(0, self._overflow_buf, [list(model_grads), list(master_grads)], 1.0 / scale)

    def __repr__(self) -> str:
        return f"<apex LossScaler view of {self._scaler!r}>"


#: one view per loss scaler, so that state a script keeps on it (``_overflow_buf``, ``_has_overflow``) persists
_VIEWS: weakref.WeakKeyDictionary[Any, _LossScalerView] = weakref.WeakKeyDictionary()


def _view(scaler: Any, session: Any, index: int) -> _LossScalerView:
    view = _VIEWS.get(scaler)
    if view is None:
        view = _VIEWS[scaler] = _LossScalerView(scaler, session, index)
    return view


def record_unscale(scaler: Any, found_inf: torch.Tensor) -> None:
    """Called by ``scale_loss`` after each unscaling exit: updates the apex view of ``scaler`` if a script made one
    (``amp._amp_state.loss_scalers``); nothing otherwise."""
    view = _VIEWS.get(scaler)
    if view is not None:
        view._record_unscale(found_inf)


class _OptPropertiesView:
    """apex's ``Properties``: ``enabled``, ``opt_level``, ``cast_model_type``, ``patch_torch_functions``,
    ``keep_batchnorm_fp32``, ``master_weights``, ``loss_scale`` of the latest ``initialize`` (read-only)."""

    def __init__(self, options: Any) -> None:
        object.__setattr__(self, "_options", options)

    def __getattr__(self, name: str) -> Any:
        options = object.__getattribute__(self, "_options")
        if options is None:
            if name == "enabled":
                return False
            raise AttributeError(f"amp._amp_state.opt_properties.{name}: amp is not enabled "
                                 "(initialize(enabled=False)).")
        try:
            return options[name]
        except KeyError:
            raise AttributeError(f"amp._amp_state.opt_properties has no option {name!r}.") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"amp._amp_state.opt_properties.{name} is read-only in fp16kit: pass {name}= to amp.initialize instead."
        )


class _Handle:
    """apex's ``_amp_state.handle``: fp16kit's O1 patches nothing globally (casts run inside the model's
    forward), so there is nothing to deactivate."""

    def _deactivate(self) -> None:
        return None

    def is_active(self) -> bool:
        return True


class AmpStateView:
    """``amp._amp_state``: apex's global amp state as a view on the latest ``amp.initialize`` session."""

    def __init__(self) -> None:
        #: apex's escape hatch for fp16 models passed to ``initialize`` (honoured by the model check)
        self.allow_incoming_model_not_fp32 = False
        self.handle = _Handle()

    @staticmethod
    def _session() -> Any:
        from ._frontend.state import current_session

        session = current_session()
        if session is None:
            raise AttributeError("amp._amp_state: amp.initialize has not been called yet.")
        return session

    @property
    def loss_scalers(self) -> list[_LossScalerView]:
        session = self._session()
        return [_view(s, session, i) for i, s in enumerate(session.scalers)]

    @property
    def opt_properties(self) -> _OptPropertiesView:
        return _OptPropertiesView(self._session().options)

    @property
    def verbosity(self) -> int:
        return int(self._session().verbosity)

    @property
    def min_loss_scale(self) -> float | None:
        scalers = self._session().scalers
        return scalers[0].min_scale if scalers else None

    @property
    def max_loss_scale(self) -> float | None:
        scalers = self._session().scalers
        return scalers[0].max_scale if scalers else None


_amp_state = AmpStateView()


def low_precision_models_allowed() -> bool:
    """``_amp_state.allow_incoming_model_not_fp32`` (apex's switch to accept fp16 models in ``initialize``)."""
    return bool(_amp_state.allow_incoming_model_not_fp32)


class ApexStashNames:
    """apex's list names on fp16kit's ``OptimizerStash`` (``optimizer._amp_stash``); views, not copies.

    Requires ``model`` (low-precision params that have masters), ``masters`` and ``direct`` (params the
    optimizer updates as they are) on the stash.
    """

    model: list[torch.Tensor]
    masters: list[torch.Tensor]
    direct: list[torch.Tensor]

    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        """The model's fp16/bf16 parameters (those with masters, then those the optimizer updates directly)."""
        return [*self.model, *(p for p in self.direct if p.dtype in (torch.float16, torch.bfloat16))]

    def materialize(self) -> None:
        """Make the fp32 master grads of this step exist now (the stash decides whether there is work)."""

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        """The fp32 master weights of the fp16 parameters (``amp.master_params`` minus the fp32 params); their
        ``.grad`` holds the unscaled gradients between ``scale_loss`` and ``step``, as in apex."""
        self.materialize()
        return list(self.masters)

    @property
    def all_fp32_params(self) -> list[torch.Tensor]:
        """fp32 parameters the optimizer updates directly (e.g. batchnorm under O2), grads unscaled as in apex."""
        self.materialize()
        return [p for p in self.direct if p.dtype == torch.float32]


def install_optimizer_shims(optimizer: torch.optim.Optimizer) -> None:
    """apex's per-optimizer patch, after ``amp.initialize`` has attached ``optimizer._amp_stash``:
    ``optimizer._lazy_init_maybe_master_weights()``: apex created masters lazily at the first step and scripts
    force it before loading a checkpoint; fp16kit creates them in ``amp.initialize``, so it is a no-op.
    (``optimizer.add_param_group`` after ``initialize`` is handled by the frontend itself:
    ``fp16kit/amp/_frontend/masters.py``.)
    """

    def _lazy_init_maybe_master_weights() -> None:
        return None

    optimizer._lazy_init_maybe_master_weights = _lazy_init_maybe_master_weights  # type: ignore[attr-defined]
