"""The steady device step: a recorded step and the cheap check that lets the next step replay it.

A training loop steps the same params, with grads at the same addresses, under the same hyper-parameters, step
after step. The device step (``_device_step.py``) records such a step's launches once; every later step asks
:meth:`SteadyPlan.holds` whether what the recording depends on still stands, and if so replays it without
collecting rows, validating hyper-parameters or planning. The check is C-level maps over the rows, no per-param
Python, and compares:

* the groups (how many params each holds, and their params, read through ``p.grad``): a grad that is None now, or that
  moved (``data_ptr``), or whose metadata changed (shape, strides, dtype, device: one C++ guard over the params
  and grads), a param moved (``p.data = ...``), a param added or removed;
* the optimizer's state: the per-param state dicts (a dict replaced, deleted or added) and, in each, the address of
  every row tensor (a moment or master replaced or moved);
* the facts of :func:`settings`: every group's hyper-parameters (numbers by value, a list such as ``betas`` by its
  values, tensors by identity), the optimizer's own settings, the GradScaler's tensors, the skip counters and
  buffers, the backend.

Every object compared by identity is held by the plan (a freed object's ``id`` cannot come back while the plan
lives), and every tensor the launches write is held too, so a replaced tensor never shares an address with the one
recorded. A new grad tensor at the recorded address with the recorded metadata (``zero_grad(set_to_none=True)``
and a caching allocator) is the same launch: the plan holds then too. ``load_state_dict`` and ``add_param_group``
drop the plan (``FusedOptimizer._forget_steady_step``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, is_not, itemgetter
from typing import Any

import torch

from fp16kit.kernels import flag_is_final, metadata_guard, select_backend

__all__ = ["SteadyPlan", "settings"]

_data_ptr = torch.Tensor.data_ptr
_grad_of = attrgetter("grad")


def _fact(value: Any) -> Any:
    """A hyper-parameter as a fact holds it: a tensor by identity, a list (``betas=[0.9, 0.999]``, mutable in
    place) as a tuple of its values, anything else as is."""
    if isinstance(value, torch.Tensor):
        return id(value)
    if isinstance(value, list):
        return tuple(map(_fact, value))
    return value


_PLAIN = frozenset({bool, int, float, str, type(None)})


def _plain(value: Any) -> bool:
    """A number, string, bool or None (compared by value)."""
    return type(value) in _PLAIN or isinstance(value, (bool, int, float, str))


def settings(optimizer: Any, device: torch.device) -> tuple:
    """What a recorded device step depends on besides its rows: the groups' hyper-parameters, the optimizer's own
    settings (its plain attributes), the GradScaler's scale and flag (by identity) and whether the flag is final,
    the skip counters and buffers (by identity), the backend, and whether a process group is set."""
    groups = [[(k, v if type(v) in _PLAIN else _fact(v)) for k, v in g.items() if k != "params"]
              for g in optimizer.param_groups]
    own = [(k, v) for k, v in optimizer.__dict__.items() if _plain(v)]
    scaler = (id(getattr(optimizer, "grad_scale", None)), id(getattr(optimizer, "found_inf", None)),
              flag_is_final(optimizer))
    return (groups, own, scaler, list(map(id, optimizer._skip_counts.values())), select_backend(device).backend,
            optimizer.process_group is None)


def _params(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Every group's params, in order (the list itself for one group)."""
    if len(groups) == 1:
        return groups[0]["params"]
    out: list[torch.Tensor] = []
    for g in groups:
        out += g["params"]
    return out


class SteadyPlan:
    """A recorded device step (``launches``, replayed in order) and the facts it depends on (:meth:`holds`)."""

    __slots__ = (
        "counted",
        "device",
        "dicts",
        "entries",
        "flag",
        "grad_ptrs",
        "groups",
        "guard",
        "has_grad",
        "held",
        "launches",
        "param_ptrs",
        "settings",
        "state_ids",
        "written",
    )

    def __init__(
        self,
        optimizer: Any,
        device: torch.device,
        launches: list,
        counted: bool,
        written: list[torch.Tensor],
        row_keys: Sequence[str],
    ) -> None:
        """Record the facts as they stand after the recorded step. ``written``: every tensor the launches write
        (versions bumped per replay); ``row_keys``: the state keys whose tensors are rows (moments, the master or
        split mode's low half)."""
        groups = optimizer.param_groups
        params = _params(groups)
        grads = list(map(_grad_of, params))
        has = list(map(is_not, grads, repeat(None)))
        self.has_grad = None if False not in has else has  # None: every param has a grad
        present = list(compress(params, self.has_grad)) if self.has_grad is not None else list(params)
        grads = [g for g in grads if g is not None]
        self.launches, self.counted, self.device, self.written = launches, counted, device, list(written)
        self.groups = [len(g["params"]) for g in groups]
        self.grad_ptrs = list(map(_data_ptr, grads))
        self.param_ptrs = list(map(_data_ptr, present))
        self.guard = metadata_guard(grads)
        state = optimizer.state
        self.state_ids = list(map(id, state.values()))
        self.dicts = [state[p] for p in present]
        self.entries = []  # per row key: the dicts holding it, and its tensors' addresses
        for key in row_keys:
            dicts = [d for d in self.dicts if d.get(key) is not None]
            if dicts:
                self.entries.append((itemgetter(key), dicts, list(map(_data_ptr, map(itemgetter(key), dicts)))))
        self.settings = settings(optimizer, device)
        # the optimizer's own flag (None under a GradScaler's flag, which the settings name by identity)
        self.flag = optimizer._device_buffers(device)["flag"] if getattr(optimizer, "found_inf", None) is None else None
        # the objects the facts name by identity: held, so that no id is reused while the plan lives
        self.held = (list(state.values()), [dict(g) for g in groups], getattr(optimizer, "grad_scale", None),
                     getattr(optimizer, "found_inf", None), list(optimizer._skip_counts.values()))

    def holds(self, optimizer: Any) -> bool:
        """Does the recording still apply: the same rows at the same addresses with the same metadata, the same
        state entries, the same :func:`settings`? C-level maps over the rows; False at the first difference."""
        groups = optimizer.param_groups
        if [len(g["params"]) for g in groups] != self.groups:  # (a param moved to another group: same order)
            return False
        params = _params(groups)
        grads = list(map(_grad_of, params))
        try:
            if self.has_grad is None:
                present = params
                if list(map(_data_ptr, grads)) != self.grad_ptrs:  # (a None grad raises TypeError)
                    return False
            else:
                if list(map(is_not, grads, repeat(None))) != self.has_grad:
                    return False
                present, grads = list(compress(params, self.has_grad)), list(compress(grads, self.has_grad))
                if list(map(_data_ptr, grads)) != self.grad_ptrs:
                    return False
            if list(map(_data_ptr, present)) != self.param_ptrs or not self.guard.check(*grads):
                return False
            if list(map(id, optimizer.state.values())) != self.state_ids:
                return False
            for get, dicts, ptrs in self.entries:
                if list(map(_data_ptr, map(get, dicts))) != ptrs:
                    return False
        except (TypeError, KeyError, AttributeError, RuntimeError):  # a None grad, a state entry gone or not a tensor
            return False
        return settings(optimizer, self.device) == self.settings
