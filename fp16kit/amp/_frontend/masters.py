"""fp32 master weights (O2) and the gradient plumbing around each backward, for any optimizer.

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
bit for bit and writes them into the model. A checkpoint without masters (apex's, or one written at
another opt level) re-derives them from the model parameters. Loading a model ``state_dict`` re-derives
a master only where the loaded value differs from the master's rounding, so both load orders work.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...kernels import copy_, unscale_and_check
from .._apex_state import ApexStashNames, install_optimizer_shims
from .casting import LOW_DTYPES

__all__ = ["MASTERS_KEY", "OptimizerStash", "make_stash", "resync_on_model_load"]

MASTERS_KEY = "fp16kit_amp_masters"


class OptimizerStash(ApexStashNames):  # apex's list names: compatibility views (amp/_apex_state.py)
    """What amp keeps per optimizer (attached as ``optimizer._amp_stash``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, session: Any) -> None:
        self.optimizer = optimizer
        self.session = session
        self.model: list[nn.Parameter] = []
        self.masters: list[nn.Parameter] = []
        self.direct: list[torch.Tensor] = []
        self.direct_stash: list[torch.Tensor | None] = []
        self.params_have_scaled_gradients = False
        # device flag OR-ed over the scale_loss calls since the last step (device-side skip), and the
        # host-known overflow that makes the next step() a skip (plain optimizers)
        self.found_inf: torch.Tensor | None = None
        self.skip: Any = None
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self._loaded_masters: dict[int, torch.Tensor] | None = None

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

    def unscale(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Unscale the new gradients (see the module docstring) and raise ``found_inf`` on inf/NaN."""
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
    def flat_index(self) -> dict[int, int]:
        """id(master) -> position in the optimizer's flattened param groups (torch's state_dict indexing)."""
        flat = [p for group in self.optimizer.param_groups for p in group["params"]]
        ids = {id(m) for m in self.masters}
        return {id(p): i for i, p in enumerate(flat) if id(p) in ids}

    def resync_from_model(self, only_where_different: bool) -> None:
        """Masters from the model params: all of them, or only where ``fp16(master) != model param``."""
        with torch.no_grad():
            for p, m in zip(self.model, self.masters):
                if only_where_different:
                    m.copy_(torch.where(m.to(p.dtype) == p, m, p.float()))
                else:
                    m.copy_(p)


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
            flag = torch.zeros(1, dtype=torch.float32, device=dev)
            unscale_and_check(s, inv_scale.to(dev), flag, out=d)
            torch.maximum(found_inf, flag.to(found_inf.device), out=found_inf)


def _accumulate(adds: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``acc = round(fp32(acc) + tmp)`` for each ``(tmp, acc)``, ``tmp`` being an fp32 unscaled gradient."""
    with torch.no_grad():
        for tmp, acc in adds:
            if acc.dtype == torch.float32:
                acc.add_(tmp)
            else:
                acc.copy_(tmp + acc.float())


def make_stash(optimizer: torch.optim.Optimizer, session: Any, master_weights: bool,
               fp32_values: dict[int, torch.Tensor]) -> OptimizerStash:
    """Attach a stash to ``optimizer``; with ``master_weights`` swap low-precision params for fp32 masters.

    ``fp32_values`` maps ``id(param)`` to the parameter's value before the model was cast, so the masters
    start from the exact fp32 initial weights (apex started them from the fp16 rounding).
    """
    stash = OptimizerStash(optimizer, session)
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if not p.is_floating_point():
                raise TypeError(f"amp.initialize: optimizer parameters must be floating point, found {p.dtype}.")
            if master_weights and p.dtype in LOW_DTYPES:
                value = fp32_values.get(id(p))
                master = nn.Parameter(value.clone() if value is not None else p.detach().float())
                params[i] = master
                if p in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(p)
                stash.model.append(p)
                stash.masters.append(master)
            else:
                stash.direct.append(p)
    stash.direct_stash = [None] * len(stash.direct)
    if stash.masters:
        _install_master_hooks(optimizer, stash)
    optimizer._amp_stash = stash
    install_optimizer_shims(optimizer)
    return stash


def _install_master_hooks(optimizer: torch.optim.Optimizer, stash: OptimizerStash) -> None:
    def save(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        index = stash.flat_index()
        state_dict[MASTERS_KEY] = {index[id(m)]: m.detach() for m in stash.masters}
        return state_dict

    def before_load(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)  # never mutate the caller's dict
        stash._loaded_masters = state_dict.pop(MASTERS_KEY, None)
        return state_dict

    def after_load(opt: torch.optim.Optimizer) -> None:
        saved, stash._loaded_masters = stash._loaded_masters, None
        if saved is None:
            stash.resync_from_model(only_where_different=False)
            return
        index = stash.flat_index()
        with torch.no_grad():
            for m in stash.masters:
                value = saved.get(index[id(m)])
                if value is None or value.shape != m.shape:
                    raise RuntimeError(
                        "optimizer.load_state_dict: the checkpoint's fp32 master weights do not match this "
                        "optimizer's parameters (different model or param groups)."
                    )
                m.copy_(value)
        stash.write_masters_to_model()

    optimizer.register_state_dict_post_hook(save)
    optimizer.register_load_state_dict_pre_hook(before_load)
    optimizer.register_load_state_dict_post_hook(after_load)


def resync_on_model_load(models: list[nn.Module], stash: OptimizerStash) -> None:
    """Loading a model ``state_dict`` re-derives the masters that no longer round to the loaded params."""
    mastered = {id(p) for p in stash.model}

    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        stash.resync_from_model(only_where_different=True)

    for model in models:
        if any(id(p) in mastered for p in model.parameters()):
            model.register_load_state_dict_post_hook(hook)
