"""The steady device step: a recorded step and the cheap check that lets the next step replay it.

A training loop steps the same params, with grads at the same addresses, under the same hyper-parameters, step
after step. The device step (``_device_step.py``) records such a step's launches once; every later step asks
:meth:`SteadyPlan.holds` whether what the recording depends on still stands, and if so replays it without
collecting rows, validating hyper-parameters or planning. The check is C-level maps over the rows, no per-param
Python (every row address read in one pass), and compares:

* the groups (how many params each holds, and their params, read through ``p.grad``): a grad that is None now, or that
  moved (``data_ptr``), or whose metadata changed (shape, strides, dtype, device: one C++ guard over the grads), a
  param moved (``p.data = ...``, ``set_``), a param added or removed;
* the optimizer's state: the per-param state dicts (a dict replaced, deleted or added) and, in each, the address of
  every row tensor (a moment or master replaced, or its storage swapped in place);
* the facts of :func:`settings`: every group's hyper-parameters (numbers by value, a list such as ``betas`` by its
  values, tensors by identity), the optimizer's own settings, the GradScaler's tensors, the skip counters and
  buffers, the backend.

Dicts that change rarely are taken as recorded while CPython's version tag of the dict is (a new tag after every
entry added, removed or rebound, and a fresh one for every new dict, so a tag never comes back): the state's dict of
per-param dicts, every group and the optimizer's own attributes; their facts are compared when a tag moved, and
always where the tag cannot be trusted (:func:`_probe_dict_version`). Lists among the hyper-parameters change in
place, unseen by the tag: they are compared by value every step.

Every object compared by identity is held by the plan (a freed object's ``id`` cannot come back while the plan
lives; the optimizer's own attribute dict, compared by ``id`` and tag, is not held: that would be a reference cycle),
and every tensor the launches write is held too, so a replaced tensor never shares an address with the one
recorded. A new grad tensor at the recorded address with the recorded metadata (``zero_grad(set_to_none=True)``
and a caching allocator) is the same launch: the plan holds then too. ``load_state_dict`` and ``add_param_group``
drop the plan (``FusedOptimizer._forget_steady_step``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain, compress, repeat
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


def _group_facts(optimizer: Any) -> list:
    """Every group's hyper-parameters as facts (numbers by value, a list by its values, tensors by identity)."""
    return [[(k, v if type(v) in _PLAIN else _fact(v)) for k, v in g.items() if k != "params"]
            for g in optimizer.param_groups]


def _own_facts(optimizer: Any) -> list:
    """The optimizer's own settings: its plain attributes."""
    return [(k, v) for k, v in optimizer.__dict__.items() if _plain(v)]


def _other_facts(optimizer: Any, device: torch.device) -> tuple:
    """The rest of :func:`settings`: the GradScaler's scale and flag (by identity) and whether the flag is final,
    the skip counters and buffers (by identity), the backend, and whether a process group is set."""
    scaler = (id(getattr(optimizer, "grad_scale", None)), id(getattr(optimizer, "found_inf", None)),
              flag_is_final(optimizer))
    return (scaler, list(map(id, optimizer._skip_counts.values())), select_backend(device).backend,
            optimizer.process_group is None)


def settings(optimizer: Any, device: torch.device) -> tuple:
    """What a recorded device step depends on besides its rows: the groups' hyper-parameters, the optimizer's own
    settings (its plain attributes), the GradScaler's scale and flag (by identity) and whether the flag is final,
    the skip counters and buffers (by identity), the backend, and whether a process group is set."""
    return (_group_facts(optimizer), _own_facts(optimizer), *_other_facts(optimizer, device))


def _probe_dict_version() -> Callable[[dict], int] | None:
    """CPython's per-dict version tag (``ma_version_tag``, read by Dynamo's ``dict_version``): a new value after
    every change of the dict (an entry added, removed or bound to another object). Returned only if it behaves so
    here, for a plain dict and an object's attribute dict; None otherwise (a Python without the tag, a torch
    without the reader): every check then compares the facts themselves."""
    try:
        from torch._C._dynamo.guards import dict_version
    except ImportError:  # pragma: no cover - a torch without Dynamo's guards
        return None

    class _Probe:
        pass

    try:
        d, obj = {"a": object()}, _Probe()
        obj.x = object()
        attrs = obj.__dict__
        seen = [dict_version(d), dict_version(attrs)]
        d["a"] = object()
        obj.x = object()
        seen += [dict_version(d), dict_version(attrs)]
        d["b"] = None
        del d["a"]
        seen.append(dict_version(d))
        obj.y = None
        del obj.x
        seen.append(dict_version(attrs))
    except Exception:  # pragma: no cover - a reader that refuses these dicts
        return None
    changed = seen[0] != seen[2] != seen[4] != seen[0] and seen[1] != seen[3] != seen[5] != seen[1]
    return dict_version if changed else None


#: The dict version reader (None where it cannot be trusted: :func:`_probe_dict_version`).
_dict_version = _probe_dict_version()


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
        "entries",
        "flag",
        "group_lists",
        "group_versions",
        "groups",
        "guard",
        "has_grad",
        "held",
        "launches",
        "other",
        "own",
        "own_version",
        "ptrs",
        "settings",
        "state",
        "state_ids",
        "state_version",
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
        self.guard = metadata_guard(grads)
        state = self.state = optimizer.state
        self.state_ids = list(map(id, state.values()))
        dicts = [state[p] for p in present]
        self.entries = []  # per row key: its getter and the dicts holding it
        for key in row_keys:
            holding = [d for d in dicts if d.get(key) is not None]
            if holding:
                self.entries.append((itemgetter(key), holding))
        # every address in one list, in the order holds() reads them: grads, params, then each row key's tensors
        self.ptrs = list(map(_data_ptr, chain(grads, present, *(map(get, ds) for get, ds in self.entries))))
        self.settings = settings(optimizer, device)
        self.other = self.settings[2:]  # (the part of the settings compared at every step)
        # the settings' shortcut: the version tags of the dicts the group and own facts come from (and the lists in
        # the groups, which change in place); taken after settings() (which made the skip counters it reads)
        version = _dict_version
        self.own = id(optimizer.__dict__)  # (by id: holding the optimizer's own dict would make a reference cycle)
        self.own_version = None if version is None else version(optimizer.__dict__)
        self.group_versions = None if version is None else list(map(version, groups))
        self.group_lists = [(g, k, _fact(v)) for g in groups for k, v in g.items() if type(v) is list and k != "params"]
        self.state_version = None if version is None else version(state)
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
            else:
                if list(map(is_not, grads, repeat(None))) != self.has_grad:
                    return False
                present, grads = list(compress(params, self.has_grad)), list(compress(grads, self.has_grad))
            # one pass over every address (a None grad raises TypeError; a state entry gone, KeyError)
            if list(map(_data_ptr, chain(grads, present, *(map(get, ds) for get, ds in self.entries)))) != self.ptrs:
                return False
            if not self.guard.check(*grads):
                return False
        except (TypeError, KeyError, AttributeError, RuntimeError):  # a None grad, a state entry gone or not a tensor
            return False
        return self._state_holds(optimizer) and self._settings_hold(optimizer)

    def _state_holds(self, optimizer: Any) -> bool:
        """The same per-param state dicts (none replaced, added or deleted): the state's version tag unchanged, or
        else every dict's identity compared."""
        state = optimizer.state
        if state is self.state and self.state_version is not None and _dict_version(state) == self.state_version:
            return True
        return list(map(id, state.values())) == self.state_ids

    def _settings_hold(self, optimizer: Any) -> bool:
        """:func:`settings` as recorded. The groups' and the optimizer's own facts are taken as they were while
        their dicts' version tags are (no entry added, removed or rebound) and each list-valued hyper-parameter
        (changed in place) keeps its values; the rest is compared every step. Otherwise every fact is compared."""
        version = _dict_version
        if (
            version is not None
            and id(attrs := optimizer.__dict__) == self.own
            and version(attrs) == self.own_version
            and list(map(version, optimizer.param_groups)) == self.group_versions
            and (not self.group_lists or all(_fact(g[k]) == f for g, k, f in self.group_lists))
        ):
            return _other_facts(optimizer, self.device) == self.other
        return settings(optimizer, self.device) == self.settings
