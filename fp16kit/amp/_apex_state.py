"""Compatibility shims for apex internals that scripts reach into: ``amp._amp_state``, ``optimizer._amp_stash``
lists, ``optimizer._lazy_init_maybe_master_weights()``.

They are thin views on fp16kit's own frontend state (the latest ``amp.initialize`` session, the optimizer's
stash): nothing here keeps a second copy. Each has a public fp16kit way (docs/migrating-from-apex.md):

=====================================================  ===========================================================
apex internal                                           public fp16kit way
=====================================================  ===========================================================
``_amp_state.loss_scalers[i].loss_scale()``             ``amp.state_dict()["loss_scaler{i}"]["loss_scale"]``
``_amp_state.loss_scalers[i]._loss_scale = s``          ``amp.load_state_dict`` with ``loss_scale`` set to ``s``
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

from typing import Any

import torch

__all__ = ["AmpStateView", "ApexStashNames", "install_optimizer_shims", "low_precision_models_allowed"]


class _LossScalerView:
    """apex's ``LossScaler`` face on fp16kit's :class:`~fp16kit.amp.LossScaler` (reads are host syncs)."""

    def __init__(self, scaler: Any) -> None:
        self._scaler = scaler

    def loss_scale(self) -> float:
        return self._scaler.get_scale()

    @property
    def _loss_scale(self) -> float:
        return self._scaler.get_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._scaler.set_scale(value)

    @property
    def dynamic(self) -> bool:
        return bool(self._scaler.dynamic)

    @property
    def _unskipped(self) -> int:
        return int(self._scaler.growth_tracker.reshape(-1)[0].item())

    def __repr__(self) -> str:
        return f"<apex LossScaler view of {self._scaler!r}>"


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
        return [_LossScalerView(s) for s in self._session().scalers]

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
