"""The rows a step works on: per param group, the params that have a grad, paired by position with their grads,
moments and (master-weights and split modes) their master or low half, each row checked before a kernel sees its
addresses.

The check (``_validate.check_row``: shape, dtype, device, layout of every tensor against its param) is remembered per
group as a :class:`_Verdict`; a later step gathers the rows with C-level maps and re-runs the per-param check only
when the group's params, grads, state or the rows' metadata changed (:meth:`RowsMixin._collect`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_not, itemgetter
from typing import Any

import torch

from fp16kit.kernels import common_device, metadata_guard

from ._validate import check_row

__all__ = ["LOW_KEY", "RowsMixin"]

#: The state key of the split master's low halves (int16, the param's shape).
LOW_KEY = "master_low"


@dataclass
class _Rows:
    """The tensors one group's update works on, paired by position."""

    params: list[torch.Tensor] = field(default_factory=list)  # masters in master-weights mode
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    models: list[torch.Tensor | None] = field(default_factory=list)  # low-precision params that get a copy


_grad_of = attrgetter("grad")


@dataclass(eq=False)
class _Verdict:
    """One group's remembered row check (``FusedOptimizer._collect``): valid while the group holds the same param
    objects (``ids``), the same params have grads (``has_grad``) and masters (``has_master``), and every tensor of
    the rows has the metadata it had when ``check_row`` passed (``guard``: shape, strides, dtype, device, dispatch
    keys, checked in C++). ``device``: the rows' common device; ``dtensors``: some param of the group is a DTensor."""

    ids: tuple[int, ...]
    has_grad: tuple[bool, ...]
    has_master: tuple[bool, ...]
    guard: Any
    device: torch.device | None
    dtensors: bool


class RowsMixin:
    """``FusedOptimizer``'s row collection (reads ``state``, ``_state_for``, ``_state8``, ``_moment_keys``)."""

    def _collect(self) -> list[_Rows]:
        """Rows of every group (params without a grad are left out), each checked (``check_row``).

        The check's verdict is remembered per group (:class:`_Verdict`): the next step gathers the rows with
        C-level maps (``p.grad``, ``state[p]``, the state keys) and, when the group holds the same params and the
        guard passes on every row tensor (new grad tensors included: re-allocated grads have new addresses, and
        what ``check_row`` reads of them, numel/dtype/layout/device, is their metadata), skips ``check_row``.
        Anything else (a param or state entry missing or replaced by a tensor of other metadata, a state key
        deleted, a grad appearing or disappearing) runs the full per-param check again, with its messages. Not
        while ``torch.compile`` traces (the guard is host state Dynamo need not see): the per-param check then.
        """
        cache = self._step_cache
        cache["rows_device"] = None
        cache["rows_dtensors"] = True  # unknown: the step asks _sharding
        if torch.compiler.is_compiling():
            return [self._collect_group(gi, group)[0] for gi, group in enumerate(self.param_groups)]
        verdicts = self.__dict__.setdefault("_verdicts", {})  # an optimizer pickled before the cache existed
        out = []
        devices = set()
        dtensors = False
        for gi, group in enumerate(self.param_groups):
            rows = self._recollect(group, verdicts.get(id(group)))
            if rows is None:
                rows, verdict = self._collect_group(gi, group)
                verdicts[id(group)] = verdict
            else:
                verdict = verdicts[id(group)]
            out.append(rows)
            devices.add(verdict.device)
            dtensors = dtensors or verdict.dtensors
        if len(verdicts) > len(self.param_groups):  # groups removed by hand: drop their verdicts
            live = {id(g) for g in self.param_groups}
            for key in [k for k in verdicts if k not in live]:
                del verdicts[key]
        devices.discard(None)
        if len(devices) == 1:
            cache["rows_device"] = devices.pop()
        cache["rows_dtensors"] = dtensors
        return out

    def _collect_group(self, gi: int, group: dict[str, Any]) -> tuple[_Rows, _Verdict | None]:
        """One group's rows, every param checked (``check_row``), and the verdict to remember (None while
        compiling)."""
        rows = _Rows()
        moment_keys = self._moment_keys
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self._state_for(p)
            check_row(self._name, gi, i, p, p.grad, state, moment_keys, state8=self._state8(p))
            master = state.get(self._paired_key)
            if self._paired_key == LOW_KEY:
                rows.params.append(p)
                rows.models.append(None if master is None else master.view(torch.bfloat16))
            else:
                rows.params.append(p if master is None else master)
                rows.models.append(None if master is None else p)
            rows.grads.append(p.grad)
            rows.exp_avgs.append(state["exp_avg"])
            rows.exp_avg_sqs.append(state["exp_avg_sq"])
        if torch.compiler.is_compiling():
            return rows, None
        params = group["params"]
        present = [p for p in params if p.grad is not None]
        states = [self.state[p] for p in present]
        masters = [s.get(self._paired_key) for s in states]
        flat = self._row_tensors(present, states, [m for m in masters if m is not None])
        device = common_device(self._name, rows.params, rows.grads)
        verdict = _Verdict(
            ids=tuple(map(id, params)),
            has_grad=tuple(p.grad is not None for p in params),
            has_master=tuple(m is not None for m in masters),
            guard=metadata_guard(flat),
            device=device,
            dtensors=self._has_dtensors(params),
        )
        return rows, verdict

    def _row_tensors(self, present: list, states: list, masters: list) -> list[torch.Tensor]:
        """Every tensor ``check_row`` reads, in the guard's order: params, grads, each moment, masters."""
        flat = list(present)
        flat += map(_grad_of, present)
        for key in self._moment_keys:
            flat += map(itemgetter(key), states)
        flat += masters
        return flat

    def _recollect(self, group: dict[str, Any], verdict: _Verdict | None) -> _Rows | None:
        """The group's rows under a remembered verdict, or None when the verdict does not cover them."""
        if verdict is None:
            return None
        params = group["params"]
        grads = list(map(_grad_of, params))
        has_grad = tuple(map(is_not, grads, repeat(None)))
        if has_grad != verdict.has_grad or tuple(map(id, params)) != verdict.ids:
            return None
        if False in has_grad:
            present, grads = list(compress(params, has_grad)), list(compress(grads, has_grad))
        else:
            present = list(params)
        try:
            states = list(map(self.state.__getitem__, present))
            moments = [list(map(itemgetter(key), states)) for key in self._moment_keys]
            masters = list(map(dict.get, states, repeat(self._paired_key)))
        except (KeyError, TypeError):  # a state entry deleted or replaced by hand: the full check says what
            return None
        has_master = tuple(map(is_not, masters, repeat(None)))
        if has_master != verdict.has_master:
            return None
        own = list(compress(masters, has_master)) if True in has_master else []
        try:
            flat = present + grads
            for row in moments:
                flat += row
            if not verdict.guard.check(*flat, *own):
                return None
        except (TypeError, RuntimeError, AttributeError):  # a state value that is not a tensor
            return None
        if not own:
            params_row, models = present, [None] * len(present)
        elif self._paired_key == LOW_KEY:
            params_row, models = present, [None if m is None else m.view(torch.bfloat16) for m in masters]
        elif len(own) == len(present):
            params_row, models = own, present
        else:
            params_row = [p if m is None else m for p, m in zip(present, masters)]
            models = [None if m is None else p for p, m in zip(present, masters)]
        by_key = dict(zip(self._moment_keys, moments))
        return _Rows(list(params_row), grads, by_key["exp_avg"], by_key["exp_avg_sq"], list(models))

    @property
    def _paired_key(self) -> str:
        """The state key of the tensor paired with each low-precision param: its fp32 ``"master"`` or, in split
        mode, its int16 low half (``LOW_KEY``)."""
        return LOW_KEY if self.__dict__.get("bf16_weights") == "split" else "master"
