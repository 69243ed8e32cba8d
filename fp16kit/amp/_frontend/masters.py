"""fp32 master weights (O2) and the gradient plumbing around each backward, for any optimizer.

Two layouts, one per optimizer, chosen by :func:`make_stash`:

* :class:`FusedMasterStash` — fp16kit's ``FusedAdam``/``FusedLAMB`` (and subclasses) keep the masters in
  their own state (``optimizer.state[p]["master"]``, master-weights mode): the param groups keep the model
  params, ``scale_loss`` only checks the scaled grads, and the optimizer reads them with the handed-over
  scale and writes the rounded model param in its update pass. One checkpoint format, the optimizer's own
  (older ``"fp16kit_amp_masters"`` checkpoints load into it). See the class for the steps that fall back
  to the plumbing below.
* :class:`OptimizerStash` — every other optimizer (apex's layout, described in the rest of this docstring).

Per optimizer, an :class:`OptimizerStash` records which parameters the optimizer updates:

* ``model``/``masters``: low-precision model parameters paired with their fp32 masters (master weights
  on). The optimizer's param groups hold the masters; its state is keyed by them.
* ``direct``: parameters the optimizer updates as they are (fp32 parameters under O2, e.g. batchnorm,
  and every parameter when master weights are off).

Around each ``scale_loss`` (apex's semantics, kept exactly):

``prepare`` (before the backward, unless the gradients already hold scaled values from a
``delay_unscale`` micro-batch): model grads of mastered params are dropped (the master grads carry
what came before); grads of direct params are stashed and cleared, so the backward writes only the
new, scaled gradient.

``unscale`` (after the backward): one fused pass ``unscale_and_check`` per device, for every
gradient at once::

    master.grad = fp32(model.grad) * inv_scale                      # O2: fp16 -> fp32 in one pass
    master.grad = fp32(model.grad) * inv_scale + master.grad        # master grad existed already
    p.grad      = fp32(p.grad) * inv_scale  (+ stashed grad)        # direct params
    found_inf   = 1 if any unscaled value is inf/NaN

After a successful step the masters are written into the model parameters by the multi-tensor copy
kernel (``copy_``: round to nearest even, bit-identical to ``Tensor.copy_``); a step skipped on the
device leaves the masters unchanged, so the copy rewrites the same bits and needs no host decision.

Checkpoints: the optimizer's ``state_dict()`` carries the masters under ``"fp16kit_amp_masters"``
(position in the flattened param groups -> fp32 tensor), and its ``load_state_dict()`` restores them
bit for bit and writes them into the model. The saved masters are checked before anything is loaded:
a missing entry, a shape or dtype that differs from the master's, or an inf/NaN value raises an error
naming the key and the param (group and index), and the optimizer, masters and model stay as they were.
A checkpoint without masters (apex's, or one written at another opt level) re-derives them from the
model parameters, with a warning (the masters' low bits are lost). Loading a model ``state_dict``
re-derives a master only where the loaded value differs from the master's rounding, so both load orders
work.

``optimizer.add_param_group`` after ``initialize`` is wrapped: a new group is planned like the groups at
``initialize`` (masters for low-precision params under master weights), and recorded in the stash only
once the optimizer has accepted it.

Trainers that call ``loss.backward()`` themselves leave gradients on the fp16 model params that never
reach the masters; :meth:`OptimizerStash.model_grads_bypassed_scale_loss` detects it for ``step``
(``stepping``), from the identity and version counter of each grad as ``scale_loss`` left it.
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...kernels import (
    copy_,
    flag_for,
    flag_nonfinite,
    merge_found_inf_into,
    new_found_inf,
    unscale_and_check,
)
from .._apex_state import ApexStashNames, install_optimizer_shims
from .casting import LOW_DTYPES

__all__ = [
    "MASTERS_KEY",
    "FusedMasterStash",
    "OptimizerStash",
    "check_optimizer_params",
    "keeps_own_masters",
    "make_stash",
    "resync_on_model_load",
]

MASTERS_KEY = "fp16kit_amp_masters"


class OptimizerStash(ApexStashNames):  # apex's list names: compatibility views (amp/_apex_state.py)
    """What amp keeps per optimizer (attached as ``optimizer._amp_stash``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, session: Any, master_weights: bool = False) -> None:
        self.optimizer = optimizer
        self.session = session
        self.master_weights = bool(master_weights)
        self.model: list[nn.Parameter] = []
        self._masters: list[torch.Tensor] = []
        self.direct: list[torch.Tensor] = []
        self.direct_stash: list[torch.Tensor | None] = []
        self.params_have_scaled_gradients = False
        # device flag OR-ed over the scale_loss calls since the last step (device-side skip), and the
        # host-known overflow that makes the next step() a skip (plain optimizers)
        self.found_inf: torch.Tensor | None = None
        self.skip: Any = None
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._loaded_masters: dict[int, torch.Tensor] | None = None
        # per model param: (weak ref to the grad tensor, its version) when amp last accounted for it (unscaled
        # into the master, or zeroed by zero_grad); a grad that differs was made by a backward outside scale_loss
        self._seen_grads: list[tuple[weakref.ref, int] | None] = []
        self.warned_backward_outside_scale_loss = False
        #: a ``scale_loss`` ran for this optimizer since its last step (a backward outside it is unscaled: stepping.py)
        self.scale_loss_seen = False
        #: warnings already given for this optimizer (each is shown once): see stepping.py
        self.warned: set[str] = set()

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 masters, paired with ``model`` by position."""
        return self._masters

    def add_masters(self, model: list[nn.Parameter], masters: list[torch.Tensor]) -> None:
        """Record new (model param, master) pairs (``initialize`` and ``add_param_group``)."""
        self.model += model
        self._masters += masters

    def master_params(self) -> list[torch.Tensor]:
        """What ``amp.master_params`` yields: the tensors the optimizer updates (its param groups)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def settle_pending(self) -> bool:
        """Before a backward: move gradients still held scaled for the step into fp32 buffers (fused path).

        True when it did (the caller then runs :meth:`prepare`); the stash path unscales at every
        ``scale_loss`` exit, so it never holds any.
        """
        return False

    def materialize(self) -> None:
        """Make the fp32 master grads exist now (fused path; the stash path makes them at each exit)."""

    def use_master_grads(self) -> None:
        """Until the step: fp32 master grads, unscaled at each ``scale_loss`` exit (the stash path always is)."""

    # ------------------------------------------------------------------ backward plumbing
    def prepare(self) -> None:
        for p in self.model:
            p.grad = None
        for i, p in enumerate(self.direct):
            self.direct_stash[i] = p.grad
            p.grad = None

    def restore(self) -> None:
        """Undo ``prepare`` after a failed backward: stashed grads back, partial new ones dropped."""
        for i, p in enumerate(self.direct):
            if self.direct_stash[i] is not None:
                p.grad, self.direct_stash[i] = self.direct_stash[i], None

    def unscale(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Unscale the new gradients (see the module docstring) and raise ``found_inf`` on inf/NaN.

        ``scale``: the loss scale the backward used (``1 / inv_scale``); only the fused path keeps it.
        """
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        adds: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tmp, accumulate into)
        for p, m in zip(self.model, self.masters):
            if p.grad is None:
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
                srcs.append(p.grad)
                dsts.append(m.grad)
            else:
                tmp = torch.empty_like(m)
                srcs.append(p.grad)
                dsts.append(tmp)
                adds.append((tmp, m.grad))
        for i, p in enumerate(self.direct):
            stashed, self.direct_stash[i] = self.direct_stash[i], None
            if p.grad is None:
                p.grad = stashed
            elif stashed is None:
                srcs.append(p.grad)
                dsts.append(p.grad)
            else:  # p.grad = unscaled new grad + stashed grad, summed in fp32 and rounded once (apex's axpby)
                tmp = torch.empty_like(p.grad, dtype=torch.float32)
                srcs.append(p.grad)
                dsts.append(tmp)
                adds.append((tmp, stashed))
                p.grad = stashed
        _unscale_by_device(srcs, dsts, inv_scale, found_inf)
        _accumulate(adds)
        self.mark_model_grads_seen()

    def mark_model_grads_seen(self) -> None:
        """Record the model grads as accounted for (see :meth:`model_grads_bypassed_scale_loss`)."""
        self._seen_grads = [None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in self.model]

    def model_grads_bypassed_scale_loss(self) -> bool:
        """True when no master has a grad but a model param holds one that no ``scale_loss`` unscaled.

        That is what a ``loss.backward()`` outside ``amp.scale_loss`` leaves (HF Trainer / accelerate call it
        themselves), or a last ``scale_loss`` with ``delay_unscale=True``: the optimizer steps the masters, which
        have no grads, so nothing would change. A grad is "seen" if it is the same tensor at the same version
        as when ``scale_loss`` unscaled it (or ``zero_grad`` zeroed it). Costs one look at the first master's grad
        on the normal path.
        """
        if not self.masters or any(m.grad is not None for m in self.masters):
            return False
        seen = self._seen_grads
        for i, p in enumerate(self.model):
            grad = p.grad
            if grad is None:
                continue
            mark = seen[i] if i < len(seen) else None
            if mark is None or mark[0]() is not grad or mark[1] != grad._version:
                return True
        return False

    def model_grads_changed_since_unscale(self) -> bool:
        """True when a model grad that ``scale_loss`` unscaled into its master was changed in place since (its version
        moved): e.g. ``clip_grad_norm_(model.parameters())``, which then has no effect on the masters the optimizer
        steps. One pass over the model params (the stash path only)."""
        seen = self._seen_grads
        for i, p in enumerate(self.model):
            grad = p.grad
            mark = seen[i] if i < len(seen) else None
            if grad is not None and mark is not None and mark[0]() is grad and mark[1] != grad._version:
                return True
        return False

    def drop_master_grads(self) -> None:
        """Master grads live from ``scale_loss`` exit to ``step``; clear them after (apex)."""
        for m in self.masters:
            m.grad = None

    def write_masters_to_model(self) -> None:
        if self.masters:
            with torch.no_grad():
                for dst, src in _by_device(self.model, self.masters):
                    copy_(dst, src)

    # ------------------------------------------------------------------ checkpoints
    def resync_from_model(self, only_where_different: bool) -> None:
        """Masters from the model params: all of them, or only where ``fp16(master) != model param``."""
        with torch.no_grad():
            for p, m in zip(self.model, self.masters):
                if only_where_different:
                    m.copy_(torch.where(m.to(p.dtype) == p, m, p.float()))
                else:
                    m.copy_(p)

    # ------------------------------------------------------------------ the step
    def run_step(self, flag: torch.Tensor | None, call: Callable[[], Any]) -> Any:
        """Run the optimizer's own step (``call``), handing over ``flag`` (the grads are unscaled already:
        ``grad_scale = None``); then masters -> model, master grads dropped."""
        with _handed_over(self.optimizer, None, flag):
            result = call()
        self.write_masters_to_model()
        self.drop_master_grads()
        return result

    def discard(self) -> None:
        """A skipped step: the gradients of this step are dropped from amp's bookkeeping."""
        self.drop_master_grads()


class FusedMasterStash(OptimizerStash):
    """Master weights kept by an fp16kit fused optimizer itself (``optimizer.state[p]["master"]``).

    The param groups keep the model params. The fused path, for a step whose gradients come from one
    ``scale_loss`` exit (one backward, or ``delay_unscale`` micro-batches summed at one scale)::

        scale_loss exit:  found_inf |= any(fp32(p.grad) * inv_scale) is inf/NaN   (read-only check pass)
                          p.grad stays the scaled gradient; the scale is kept for the step
        step:             optimizer.grad_scale = scale, optimizer.found_inf = flag: the optimizer reads the
                          fp16 grads, unscales them in its own passes, updates state["master"] and writes
                          the rounded model param in the same pass (no fp32 master grad, no copy pass)

    Where the gradients of one step come from several ``scale_loss`` exits (accumulation without
    ``delay_unscale``, several losses, a grad that existed before the backward) or the fp32 master grads
    are asked for (``amp.master_params`` between ``scale_loss`` and ``step``, e.g. to clip them), the stash
    path's plumbing takes over until the step (:meth:`materialize`): master grads ``fp32(p.grad) * inv``
    summed in fp32 as apex did, and a step over the masters (swapped into the groups for that one call)
    followed by the copy pass. Both compute the same values (``docs/migrating-from-apex.md``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, session: Any) -> None:
        super().__init__(optimizer, session, master_weights=True)
        #: the loss scale the model (and direct) grads hold, waiting for the step; None: none waiting
        self.scale: torch.Tensor | None = None
        #: the fp32 master grads of this step exist (the stash path's plumbing runs until the step)
        self.materialized = False
        #: ``step(closure)`` in progress: the closure's ``scale_loss`` makes fp32 master grads
        self.closure_step = False
        #: the grads the exit's overflow check read, by ``id(param)``: (grad, its version counter then)
        self.checked: dict[int, tuple[torch.Tensor, int]] | None = None
        #: set by the step when a grad still holding the scaled value was changed in place since that check
        self.scaled_grads_changed = False

    @property
    def masters(self) -> list[torch.Tensor]:
        state = self.optimizer.state
        return [state[p]["master"] for p in self.model]

    def add_masters(self, model: list[nn.Parameter], masters: list[torch.Tensor]) -> None:
        self.model += model

    def install_master(self, p: nn.Parameter, value: torch.Tensor | None) -> None:
        """``optimizer.state[p]["master"] = fp32(value)`` (``value``: the param before the model was cast; None:
        the param itself). A param without state gets the optimizer's own fresh state first (its moments, its
        layout), created now instead of at the first step."""
        state = self.optimizer.state.get(p)
        if not state:
            state = self.optimizer._state_for(p)  # type: ignore[attr-defined]
        source = p.detach() if value is None else value
        master = state.get("master")
        if master is None:
            state["master"] = source.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        else:
            with torch.no_grad():
                master.copy_(source)

    def install_state(self, params: list[Any], fp32_values: dict[int, torch.Tensor]) -> None:
        """The optimizer's state for every param of a group, now (in group order, the order a checkpoint
        load gives): masters for the low-precision ones (from ``fp32_values[id(p)]`` where known)."""
        for p in params:
            if isinstance(p, torch.Tensor) and p.dtype in LOW_DTYPES:
                self.install_master(p, fp32_values.get(id(p)))
            elif isinstance(p, torch.Tensor) and not self.optimizer.state.get(p):
                self.optimizer._state_for(p)  # type: ignore[attr-defined]

    def master_params(self) -> list[torch.Tensor]:
        self.materialize()
        mastered = {id(p) for p in self.model}
        state = self.optimizer.state
        return [state[p]["master"] if id(p) in mastered else p
                for group in self.optimizer.param_groups for p in group["params"]]

    # ------------------------------------------------------------------ backward plumbing
    def use_master_grads(self) -> None:
        """For ``step(closure)``: the closure's ``scale_loss`` runs inside the optimizer's step, after the scale
        was handed over; so that step takes the fp32 master grads (the waiting grads first moved there)."""
        self.materialize()
        self.closure_step = True

    def settle_pending(self) -> bool:
        if self.scale is None:
            return False
        self.materialize()
        return True

    def materialize(self) -> None:
        """Scaled grads waiting for the step -> fp32 master grads (``fp32(p.grad) * inv``, what the stash path's
        ``scale_loss`` exit writes) and direct grads unscaled in place. Their overflow was flagged at the exit
        already, so this pass's flag is not used."""
        self.checked = None
        if self.scale is None:
            return
        inv = self.scale.double().reciprocal().float()  # as LossScaler.inv_scale computes it
        self.scale = None
        srcs: list[torch.Tensor] = []
        dsts: list[torch.Tensor] = []
        for p, m in zip(self.model, self.masters):
            if p.grad is not None:
                m.grad = torch.empty_like(m)
                srcs.append(p.grad)
                dsts.append(m.grad)
        for p in self.direct:
            if p.grad is not None:
                srcs.append(p.grad)
                dsts.append(p.grad)
        _unscale_by_device(srcs, dsts, inv, new_found_inf(inv.device))
        self.materialized = True

    def unscale(self, inv_scale: torch.Tensor, found_inf: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        if scale is None or self.materialized or self.closure_step or any(s is not None for s in self.direct_stash):
            super().unscale(inv_scale, found_inf)  # sums with earlier grads: the stash path's plumbing
            self.materialized = True
            return
        owners = [p for p in (*self.model, *self.direct) if p.grad is not None]
        grads = [p.grad for p in owners]
        for same_device, _ in _by_device(grads, grads):
            flag_nonfinite(same_device, inv_scale, found_inf)
        self.checked = {id(p): (g, g._version) for p, g in zip(owners, grads)}
        self.scale = scale.detach().clone()
        self.mark_model_grads_seen()

    def model_grads_bypassed_scale_loss(self) -> bool:
        # grads waiting for the step (or fp32 master grads) came through scale_loss: O(1) on that path
        if self.scale is not None or self.materialized:
            return False
        return super().model_grads_bypassed_scale_loss()

    def drop_master_grads(self) -> None:
        if self.materialized:
            super().drop_master_grads()
        self.materialized = False

    def discard(self) -> None:
        self.drop_master_grads()
        self.scale = None
        self.checked = None

    def _flag_covers_step(self) -> bool:
        """Is the exit's overflow flag final for the step about to run (fp16kit/kernels/found_inf.py, "Final
        flags")? Yes when every grad the optimizer will read is a tensor the exit's check read, unmodified since
        (the same tensor, the same version counter: an in-place edit such as clipping bumps it). One pass over
        the params: O(1) Python per param, no device work."""
        checked, self.checked = self.checked, None
        if not checked:
            return False
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                seen = checked.get(id(p))
                if seen is None or seen[0] is not g or seen[1] != g._version:
                    self.scaled_grads_changed = seen is not None and seen[0] is g
                    return False
        return True

    # ------------------------------------------------------------------ the step
    def run_step(self, flag: torch.Tensor | None, call: Callable[[], Any]) -> Any:
        """The fused step (class docstring). Model params without a gradient from ``scale_loss`` since the last
        step (no backward since, or a repeated step) are left out, as the stash path leaves out masters
        without a grad."""
        if self.materialized or self.closure_step:
            try:
                with _masters_in_groups(self):
                    return super().run_step(flag, call)  # masters -> model, master grads dropped
            finally:
                self.closure_step = False
        covered = self.scale is not None and self._flag_covers_step()
        final = flag is not None and covered
        self.checked = None
        scale, self.scale = self.scale, None
        hidden = [] if scale is not None else [(p, p.grad) for p in self.model if p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            with _handed_over(self.optimizer, scale, flag, final=final), _no_grad_rewrite(self.optimizer):
                return call()
        finally:
            for p, grad in hidden:
                p.grad = grad
            if scale is not None:
                self._unscale_direct_grads(scale)

    def _unscale_direct_grads(self, scale: torch.Tensor) -> None:
        """After the step the fp32 params' grads hold unscaled values, as apex and the stash path leave them (a
        repeated ``step()``, or a next ``scale_loss`` without ``zero_grad`` that adds to them, reads them so);
        the fp16 model grads stay scaled, as in apex. A pass over the fp32 params only (batchnorm: small)."""
        grads = [p.grad for p in self.direct if p.grad is not None]
        if grads:
            inv = scale.double().reciprocal().float()
            _unscale_by_device(grads, grads, inv, new_found_inf(inv.device))


@contextlib.contextmanager
def _handed_over(optimizer: torch.optim.Optimizer, scale: torch.Tensor | None,
                 flag: torch.Tensor | None, *, final: bool = False) -> Iterator[None]:
    """``optimizer.grad_scale`` / ``optimizer.found_inf`` for one step call, as torch's GradScaler hands them
    over (the flag in the form the optimizer declares: fp16kit's ``[1]`` or torch's 0-dim). Nothing is set
    when there is no flag and no scale. ``final``: the flag already covers every grad the step reads at this
    scale (``optimizer.found_inf_final = True`` for the call; fp16kit/kernels/found_inf.py, "Final flags")."""
    if scale is None and flag is None:
        yield
        return
    optimizer.grad_scale = scale  # type: ignore[attr-defined]
    if flag is not None:
        optimizer.found_inf = flag_for(optimizer, flag)  # type: ignore[attr-defined]
        if final:
            optimizer.found_inf_final = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        if flag is not None:
            del optimizer.found_inf  # type: ignore[attr-defined]
            if final:
                del optimizer.found_inf_final  # type: ignore[attr-defined]


@contextlib.contextmanager
def _no_grad_rewrite(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """apex's aliases (``unscale_grads = True``) write unscaled grads back after a handed-over step; under amp
    the model grads stay as ``scale_loss`` left them (as in apex), so that extra pass is off for the call."""
    if not getattr(optimizer, "unscale_grads", False):
        yield
        return
    own = vars(optimizer)
    had, old = "unscale_grads" in own, own.get("unscale_grads")
    optimizer.unscale_grads = False  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if had:
            optimizer.unscale_grads = old  # type: ignore[attr-defined]
        else:
            del optimizer.unscale_grads  # type: ignore[attr-defined]


@contextlib.contextmanager
def _masters_in_groups(stash: FusedMasterStash) -> Iterator[None]:
    """For one step call: each master stands in the param groups for its model param, keyed in the state by
    itself with the param's moments (no ``"master"`` entry): the stash path's layout."""
    opt = stash.optimizer
    mastered = {id(p) for p in stash.model}
    swaps: list[tuple[list[Any], int, torch.Tensor, dict[str, Any], torch.Tensor]] = []
    try:
        for group in opt.param_groups:
            params = group["params"]
            for j, p in enumerate(params):
                entry = opt.state.get(p) if id(p) in mastered else None
                if entry and "master" in entry:  # entry stays where it is in the state (its order is kept)
                    master = entry["master"]
                    opt.state[master] = {k: v for k, v in entry.items() if k != "master"}
                    params[j] = master
                    swaps.append((params, j, p, entry, master))
        yield
    finally:
        for params, j, p, entry, master in swaps:
            params[j] = p
            entry.update(opt.state.pop(master, {}))


#: the exit check, under its old name (tests and callers use it): ``fp16kit.kernels.flag_nonfinite``
_flag_nonfinite = flag_nonfinite


def _by_device(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for x, y in zip(a, b):
        ga, gb = groups.setdefault(x.device, ([], []))
        ga.append(x)
        gb.append(y)
    return list(groups.values())


def _unscale_by_device(srcs: list[torch.Tensor], dsts: list[torch.Tensor], inv_scale: torch.Tensor,
                       found_inf: torch.Tensor) -> None:
    for s, d in _by_device(srcs, dsts):
        dev = s[0].device
        if dev == found_inf.device:
            unscale_and_check(s, inv_scale, found_inf, out=d)
        else:  # a model spread over devices: a flag per device, folded into the scaler's flag
            flag = new_found_inf(dev)
            unscale_and_check(s, inv_scale.to(dev), flag, out=d)
            merge_found_inf_into(found_inf, flag)


def _accumulate(adds: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``acc = round(fp32(acc) + tmp)`` for each ``(tmp, acc)``, ``tmp`` being an fp32 unscaled gradient."""
    with torch.no_grad():
        for tmp, acc in adds:
            if acc.dtype == torch.float32:
                acc.add_(tmp)
            else:
                acc.copy_(tmp + acc.float())


def check_optimizer_params(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``TypeError`` for a non-floating parameter (run by ``initialize`` before it changes anything)."""
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            _check_floating(p, f"param group {g}, index {i}")


def _check_floating(p: Any, where: str) -> None:
    if isinstance(p, torch.Tensor) and not p.is_floating_point():
        raise TypeError(f"amp: optimizer parameters must be floating point, found {p.dtype} ({where}).")


def _plan_group(params: list[Any], master_weights: bool, fp32_values: dict[int, torch.Tensor],
                swap: bool = True) -> tuple[list[Any], list[nn.Parameter], list[nn.Parameter], list[torch.Tensor]]:
    """What a param group holds under amp, computed without changing anything.

    Returns ``(group params, model params, their new masters, direct params)``: with ``master_weights`` each
    low-precision param is replaced by a new fp32 master (from ``fp32_values[id(p)]``, the value before the
    model was cast, when known; else from the param itself), every other tensor is updated as it is. With
    ``swap=False`` (the optimizer keeps the masters itself) the group keeps its params and no master is made.
    """
    out: list[Any] = []
    model: list[nn.Parameter] = []
    new_masters: list[nn.Parameter] = []
    direct: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, torch.Tensor) and master_weights and p.dtype in LOW_DTYPES and not swap:
            out.append(p)
            model.append(p)
        elif isinstance(p, torch.Tensor) and master_weights and p.dtype in LOW_DTYPES:
            value = fp32_values.get(id(p))
            master = nn.Parameter(value.clone() if value is not None else p.detach().float())
            out.append(master)
            model.append(p)
            new_masters.append(master)
        else:
            out.append(p)
            if isinstance(p, torch.Tensor):
                direct.append(p)
    return out, model, new_masters, direct


def _record(stash: OptimizerStash, model: list[nn.Parameter], new_masters: list[torch.Tensor],
            direct: list[torch.Tensor]) -> None:
    stash.add_masters(model, new_masters)
    stash.direct += direct
    stash.direct_stash += [None] * len(direct)


def make_stash(optimizer: torch.optim.Optimizer, session: Any, master_weights: bool,
               fp32_values: dict[int, torch.Tensor]) -> OptimizerStash:
    """Attach a stash to ``optimizer``; with ``master_weights`` give low-precision params fp32 masters.

    fp16kit's ``FusedAdam``/``FusedLAMB`` (and their subclasses: ``FusedMixedPrecisionLamb``, the apex
    aliases) keep the masters in their own state (:class:`FusedMasterStash`); every other optimizer gets its
    low-precision params swapped for fp32 masters in its param groups (:class:`OptimizerStash`).
    ``fp32_values`` maps ``id(param)`` to the parameter's value before the model was cast, so the masters
    start from the exact fp32 initial weights (apex started them from the fp16 rounding). Every param group
    is processed, and ``optimizer.add_param_group`` is wrapped so that groups added later are too.
    """
    fused = master_weights and keeps_own_masters(optimizer)
    if master_weights and getattr(optimizer, "bf16_weights", None):
        raise ValueError(
            f"amp.initialize: the optimizer keeps bf16 weights without fp32 masters "
            f"(master_weights={optimizer.bf16_weights!r}), but this opt level asks for fp32 master weights. Construct "
            f"the optimizer with master_weights=False (amp then gives it fp32 masters), or train the bf16 model "
            f"without amp's master weights (docs/optim.md, \"bf16 weights without fp32 masters\")."
        )
    stash = FusedMasterStash(optimizer, session) if fused else OptimizerStash(optimizer, session, master_weights)
    if fused:
        optimizer.master_weights = True  # type: ignore[attr-defined]  # its load_state_dict keeps the masters
    for g, group in enumerate(optimizer.param_groups):
        params = group["params"]
        for i, p in enumerate(params):
            _check_floating(p, f"param group {g}, index {i}")
        new, model, new_masters, direct = _plan_group(params, master_weights, fp32_values, swap=not fused)
        if isinstance(stash, FusedMasterStash):
            stash.install_state(params, fp32_values)
        for p, master in zip(model, new_masters):
            if p in optimizer.state:
                optimizer.state[master] = optimizer.state.pop(p)
        params[:] = new
        _record(stash, model, new_masters, direct)
    if isinstance(stash, FusedMasterStash):
        _install_fused_checkpoints(optimizer, stash)
    elif master_weights:
        _install_master_hooks(optimizer, stash)
    _install_add_param_group(optimizer, stash)
    optimizer._amp_stash = stash
    install_optimizer_shims(optimizer)
    return stash


def _install_add_param_group(optimizer: torch.optim.Optimizer, stash: OptimizerStash) -> None:
    """``optimizer.add_param_group`` after ``initialize``, as apex supported it.

    The new group goes through :func:`_plan_group` (fp32 masters for low-precision params under master
    weights, which ``scale_loss`` unscales into and ``step`` writes back; every other param is unscaled and
    checked in place), then through the optimizer's own ``add_param_group``. If that raises (e.g. a
    validating optimizer rejecting ``lr=-5``), the group is taken out again if it was appended, the caller's
    dict gets its params back, and amp's stash is not touched: the optimizer and amp are as before the call.
    """
    original = optimizer.add_param_group

    def add_param_group(self: torch.optim.Optimizer, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict) or "params" not in param_group or isinstance(param_group["params"], set):
            return original(param_group)  # torch's own errors for these
        given = param_group["params"]
        items = [given] if isinstance(given, torch.Tensor) else list(given)
        named = [isinstance(x, tuple) and len(x) == 2 for x in items]
        tensors = [x[1] if n else x for x, n in zip(items, named)]
        for i, p in enumerate(tensors):
            _check_floating(p, f"index {i} of the new param group")
        if stash.master_weights:
            taken = {id(p) for p in stash.model}
            for i, p in enumerate(tensors):
                if isinstance(p, torch.Tensor) and p.dtype in LOW_DTYPES:
                    if id(p) in taken:
                        raise ValueError(
                            "some parameters appear in more than one parameter group: parameter "
                            f"{i} of the new group already has an fp32 master in this optimizer (amp master "
                            "weights); add each parameter once."
                        )
                    taken.add(id(p))
        swap = not isinstance(stash, FusedMasterStash)
        new, model, new_masters, direct = _plan_group(tensors, stash.master_weights, {}, swap=swap)
        param_group["params"] = [(x[0], t) if n else t for x, n, t in zip(items, named, new)]
        count = len(optimizer.param_groups)
        try:
            original(param_group)
        except BaseException:
            del optimizer.param_groups[count:]
            param_group["params"] = items
            raise
        _record(stash, model, new_masters, direct)
        if isinstance(stash, FusedMasterStash):
            stash.install_state(tensors, {})

    optimizer.add_param_group = types.MethodType(add_param_group, optimizer)  # type: ignore[method-assign]


def _flat_positions(stash: OptimizerStash) -> list[tuple[int, torch.Tensor, int, int]]:
    """``(position in the flattened param groups, master, group index, index in the group)`` per master
    (the position of the master in the groups, or of its model param where the optimizer keeps the master)."""
    in_groups = stash.model if isinstance(stash, FusedMasterStash) else stash.masters
    masters = {id(x): m for x, m in zip(in_groups, stash.masters)}
    out = []
    pos = 0
    for g, group in enumerate(stash.optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) in masters:
                out.append((pos, masters[id(p)], g, j))
            pos += 1
    return out


def _check_saved_masters(stash: OptimizerStash, saved: Any) -> None:
    """Every master of this optimizer has a finite fp32 tensor of its shape in ``saved``, or raise.

    Runs before the optimizer's ``load_state_dict`` changes anything, so a rejected checkpoint leaves the
    optimizer state, the masters and the model as they were.
    """
    where = f"optimizer.load_state_dict: checkpoint entry state_dict[{MASTERS_KEY!r}]"
    if not isinstance(saved, Mapping):
        raise TypeError(f"{where} must map param positions to fp32 tensors, got {type(saved).__name__}.")
    for pos, master, g, j in _flat_positions(stash):
        name = f"{where}[{pos}] (the master of param {pos} of the flattened param groups: group {g}, index {j})"
        value = saved.get(pos)
        if value is None:
            raise RuntimeError(
                f"{name} is missing: the checkpoint's fp32 master weights do not match this optimizer's parameters "
                "(another model, other param groups or another opt level). Nothing was loaded."
            )
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} is a {type(value).__name__}, expected a tensor. Nothing was loaded.")
        if value.shape != master.shape or value.dtype != master.dtype:
            raise ValueError(
                f"{name} is a {value.dtype} tensor of shape {tuple(value.shape)}, but the parameter needs "
                f"{master.dtype} of shape {tuple(master.shape)}: the checkpoint belongs to another model or param "
                "group layout. Nothing was loaded."
            )
        if not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"{name} holds inf/NaN values: the checkpoint is corrupt (written after a diverged step?). Nothing "
                "was loaded; resume from an earlier checkpoint."
            )


def _install_master_hooks(optimizer: torch.optim.Optimizer, stash: OptimizerStash) -> None:
    def save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[MASTERS_KEY] = {pos: m.detach() for pos, m, _, _ in _flat_positions(stash)}
        return state_dict

    def before_load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)  # never mutate the caller's dict
        saved = state_dict.pop(MASTERS_KEY, None)
        if saved is not None:
            _check_saved_masters(stash, saved)
        stash._loaded_masters = saved
        return state_dict

    def after_load(opt: torch.optim.Optimizer) -> None:
        saved, stash._loaded_masters = stash._loaded_masters, None
        if saved is None:
            if stash.masters:
                warnings.warn(
                    f"optimizer.load_state_dict: the checkpoint has no fp32 master weights (no {MASTERS_KEY!r} "
                    "entry: an apex checkpoint, or one written without master weights). The masters are rebuilt "
                    "from the fp16/bf16 model parameters, so the bits below their precision are lost; load the "
                    "model's state_dict as well (either order). Checkpoints written by fp16kit carry the masters.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            stash.resync_from_model(only_where_different=False)
            return
        with torch.no_grad():
            for pos, master, _, _ in _flat_positions(stash):
                master.copy_(saved[pos])
        stash.write_masters_to_model()

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(before_load)
    optimizer.register_load_state_dict_post_hook(after_load)


def keeps_own_masters(optimizer: torch.optim.Optimizer) -> bool:
    """Does ``optimizer`` keep fp32 masters itself and write the model copy in its update pass? fp16kit's
    ``FusedAdam`` and ``FusedLAMB`` and their subclasses (``state[p]["master"]``, ``master_weights=True``)."""
    from ... import optim

    return isinstance(optimizer, (optim.FusedAdam, optim.FusedLAMB))


def _install_fused_checkpoints(optimizer: torch.optim.Optimizer, stash: FusedMasterStash) -> None:
    """Checkpoints of an optimizer that keeps the masters: one format, the optimizer's own ``state_dict()``
    (``state[i]["master"]``). ``load_state_dict`` also takes the stash path's format (the masters under
    ``"fp16kit_amp_masters"``, validated as the stash path does, naming the key): they are moved into the
    state before the optimizer's own load runs. Afterwards every mastered param has its master (from the
    checkpoint, else rebuilt from the param) and the masters are written into the model, as the stash path
    does."""
    original = optimizer.load_state_dict

    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        unplaced: dict[int, torch.Tensor] = {}
        if isinstance(state_dict, Mapping) and MASTERS_KEY in state_dict:
            state_dict, unplaced = _import_saved_masters(stash, state_dict)
        original(state_dict)
        for p in stash.model:
            state = optimizer.state.get(p)
            if not state or "master" not in state:
                stash.install_master(p, unplaced.get(id(p)))
        stash.write_masters_to_model()

    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)  # type: ignore[method-assign]


def _import_saved_masters(stash: FusedMasterStash, state_dict: Mapping[str, Any]) -> tuple[
        dict[str, Any], dict[int, torch.Tensor]]:
    """A stash-path checkpoint in the fused format: ``(state_dict with each saved master in its param's state,
    {id(model param): saved master} for params the checkpoint has no state for)``. The caller's dict is not
    changed; the masters are validated first (:func:`_check_saved_masters`)."""
    state_dict = dict(state_dict)
    saved = state_dict.pop(MASTERS_KEY)
    _check_saved_masters(stash, saved)
    ids = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
    state = dict(state_dict.get("state", {}))
    groups = stash.optimizer.param_groups
    unplaced: dict[int, torch.Tensor] = {}
    for pos, _, g, j in _flat_positions(stash):
        key = ids[pos] if pos < len(ids) else None
        entry = state.get(key)
        if entry:
            state[key] = {**entry, "master": saved[pos]}
        else:  # never stepped in the saved run: no moments to sit beside
            unplaced[id(groups[g]["params"][j])] = saved[pos]
    state_dict["state"] = state
    return state_dict, unplaced


def resync_on_model_load(models: list[nn.Module], stash: OptimizerStash) -> None:
    """Loading a model ``state_dict`` re-derives the masters that no longer round to the loaded params.

    Registered on every model of the ``initialize`` call (not only those with mastered params now): a group
    added later with ``add_param_group`` may master any of their params.
    """

    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        stash.resync_from_model(only_where_different=True)

    for model in models:
        model.register_load_state_dict_post_hook(hook)
