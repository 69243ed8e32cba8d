"""Optimizer state both ways between fp16kit and ``torch.optim``: :func:`to_torch_state_dict`, :func:`fp32_params`,
:func:`from_torch_state_dict`.

fp16kit's ``state_dict()`` is its own layout: one ``step`` per param group (apex's), fp32 masters of fp16/bf16
params (``master``) or split mode's low halves (``master_low``, int16), 8-bit moments as uint8 codes with fp32
``*_absmax``. ``torch.optim`` loads such a dict without a word and fails at its first step (``KeyError: 'step'``:
torch keeps the counter per param), or, for 8-bit codes, casts them to floats. The way out is
:func:`to_torch_state_dict`; the way in is :func:`from_torch_state_dict` (``load_state_dict`` accepts torch's layout
too; the function adds the checks and the masters).

Export, per fp16kit class (``torch.optim`` has no LAMB or NovoGrad: those raise)::

    FusedAdam(adam_w_mode=True)   -> torch.optim.AdamW     state: step (0-dim fp32 tensor, per param), exp_avg,
    FusedAdam(adam_w_mode=False)  -> torch.optim.Adam             exp_avg_sq
    FusedSGD                      -> torch.optim.SGD       state: momentum_buffer
    FusedAdagrad                  -> torch.optim.Adagrad   state: step, sum

* Moments are fp32 (fp64 for fp64 params); 8-bit moments are dequantized (the values the next fp16kit step reads).
  torch casts every state tensor to its param's dtype when it loads (so a bf16 param's moments become bf16 there).
* **Masters are not exported**: torch keeps none. The fp32 values a run continues from are :func:`fp32_params`
  (the master where one is kept, split mode's halves joined, else the param). To continue exactly, load them into
  an fp32 copy of the model and give its params to the torch optimizer; a torch optimizer over the fp16/bf16 params
  themselves continues from the rounded values (the masters' low bits are lost).
* Param groups get torch's keys (torch's defaults for this torch version: ``maximize=False``, ``foreach=None``, ...;
  ``decoupled_weight_decay`` from ``adam_w_mode``) and keep the others (``lr``, ``initial_lr`` of a scheduler, ...);
  fp16kit's own keys are dropped (``step``, ``bias_correction``, ``rounding_seed``, ``wd_after_momentum``,
  ``materialize_master_grads``). A tensor ``lr`` becomes a float (one host read).
* What torch cannot continue is refused (``ValueError``): ``bias_correction=False`` (torch's Adam always corrects),
  ``wd_after_momentum=True`` with a weight decay (torch's SGD adds it before), ``adagrad_w_mode=True`` with a weight
  decay (torch's Adagrad decay is the L2 penalty), FSDP2 (DTensor) params (gather with
  ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` first).

Agreement (tests/optim/test_torch_state.py): torch's optimizer, loaded with the export, takes the next step within
twice the per-element fp32 budget of fp16kit's step (K = 8 roundings at the magnitudes of ``p`` and of the update,
``tests/optim/optim_helpers.py``) of the float64 reference taken from the same state: both are fp32 evaluations of the
same formula. Measured: a few ulps at most, most elements bit-identical.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from fp16kit.distributed import is_dtensor
from fp16kit.kernels import join_halves

from . import _checkpoint
from .adagrad import FusedAdagrad
from .adam import FusedAdam
from .lamb import FusedLAMB
from .novograd import FusedNovoGrad
from .sgd import FusedSGD

__all__ = ["fp32_params", "from_torch_state_dict", "to_torch_state_dict"]

LOW_KEY = _checkpoint.LOW_KEY
_LOW_PRECISION = (torch.float16, torch.bfloat16)
#: group keys that only fp16kit's classes use (torch's classes have no such hyper-parameter)
_FP16KIT_KEYS = ("step", "bias_correction", "rounding_seed", "wd_after_momentum", "materialize_master_grads")
_NOT_STATE = ("master", LOW_KEY)  # torch keeps no masters


def _target(optimizer: Any) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class that continues ``optimizer``'s run, or a clear error."""
    if isinstance(optimizer, FusedAdam):
        return torch.optim.AdamW if optimizer.adam_w_mode else torch.optim.Adam
    if isinstance(optimizer, FusedSGD):
        return torch.optim.SGD
    if isinstance(optimizer, FusedAdagrad):
        return torch.optim.Adagrad
    name = type(optimizer).__name__
    if isinstance(optimizer, (FusedLAMB, FusedNovoGrad)):
        rule = "LAMB" if isinstance(optimizer, FusedLAMB) else "NovoGrad"
        raise ValueError(
            f"to_torch_state_dict: torch.optim has no {rule}, so a {name} run has no torch optimizer to continue in. "
            f"Its moments are not a torch optimizer's state (LAMB's are Adam's moments, but the update adds the trust "
            f"ratio and global clipping). Keep the fp16kit checkpoint (state_dict()), or restart the torch optimizer "
            f"from the weights (fp32_params(optimizer))."
        )
    if isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith("torch.optim"):
        raise TypeError(f"to_torch_state_dict: {name} is torch's own; its state_dict() is already in torch's layout.")
    raise TypeError(
        f"to_torch_state_dict: {name} is not one of fp16kit's FusedAdam, FusedSGD, FusedAdagrad (wrappers such as "
        f"LARC: pass the optimizer they wrap)."
    )


def _check_exportable(optimizer: Any, target: type) -> None:
    for gi, group in enumerate(optimizer.param_groups):
        where = f"to_torch_state_dict: param_groups[{gi}]"
        if any(is_dtensor(p) for p in group["params"]):
            raise NotImplementedError(
                f"{where} holds FSDP2 (DTensor) params; export the gathered state (torch.distributed.checkpoint's "
                f"get_optimizer_state_dict with full_state_dict=True) instead."
            )
        if target in (torch.optim.Adam, torch.optim.AdamW) and not group.get("bias_correction", True):
            raise ValueError(f"{where} has bias_correction=False; torch's {target.__name__} always corrects the bias, "
                             "so it cannot continue this run.")
        wd = float(group.get("weight_decay", 0.0))
        after = group.get("wd_after_momentum", getattr(optimizer, "wd_after_momentum", False))
        if target is torch.optim.SGD and after and wd != 0:
            raise ValueError(f"{where} has wd_after_momentum=True with weight_decay={wd}; torch's SGD adds the decay "
                             "before the momentum, so it cannot continue this run.")
        if target is torch.optim.Adagrad and getattr(optimizer, "adagrad_w_mode", False) and wd != 0:
            raise ValueError(f"{where}: adagrad_w_mode=True (decoupled decay) with weight_decay={wd}; torch's Adagrad "
                             "decay is the L2 penalty, so it cannot continue this run.")


def _torch_defaults(target: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The group keys ``target`` has on this torch version, at its defaults (a throw-away instance)."""
    kwargs: dict[str, Any] = {"lr": 1e-3}
    if target is torch.optim.SGD:
        kwargs["momentum"] = 0.0
    defaults = dict(target([torch.zeros(1, requires_grad=True)], **kwargs).defaults)
    if "decoupled_weight_decay" in defaults:
        defaults["decoupled_weight_decay"] = target is torch.optim.AdamW
    return defaults


def _step_value(group: dict[str, Any]) -> float:
    step = group.get("step", 0)
    return float(step.reshape(()) if isinstance(step, torch.Tensor) else step)


def to_torch_state_dict(optimizer: Any) -> dict[str, Any]:
    """``optimizer``'s state in the layout of the ``torch.optim`` class that continues it (module docstring).

    The result loads with ``torch_optimizer.load_state_dict`` and survives ``torch.save`` /
    ``torch.load(weights_only=True)``. Tensors not converted (fp32 moments, buffers) are the optimizer's own, as in
    ``state_dict()``; converted ones (dequantized 8-bit moments, ``step``) are new. One host read per group (the
    step counter) and per tensor ``lr``.

    Raises:
        ValueError: a LAMB/NovoGrad optimizer (torch has none), or a setting torch's class cannot continue.
        TypeError: not one of fp16kit's FusedAdam, FusedSGD, FusedAdagrad.
        NotImplementedError: FSDP2 (DTensor) params.
    """
    target = _target(optimizer)
    _check_exportable(optimizer, target)
    saved = optimizer.state_dict()
    state, _ = _checkpoint.split_state8(type(optimizer).__name__, saved["state"])  # 8-bit -> fp32 values
    defaults = _torch_defaults(target)
    with_step = target is not torch.optim.SGD
    groups, out_state = [], {}
    for group in saved["param_groups"]:
        new = {k: v for k, v in group.items() if k not in _FP16KIT_KEYS}
        if isinstance(new.get("lr"), torch.Tensor):
            new["lr"] = float(new["lr"].reshape(()))
        for key, value in defaults.items():
            new.setdefault(key, value)
        if "decoupled_weight_decay" in defaults:
            new["decoupled_weight_decay"] = defaults["decoupled_weight_decay"]
        groups.append(new)
        step = _step_value(group)
        for idx in group["params"]:
            entry = state.get(idx)
            if not entry:
                continue
            kept = {k: v for k, v in entry.items() if k not in _NOT_STATE and v is not None}
            if not kept:
                continue
            if with_step:
                kept["step"] = torch.tensor(step, dtype=torch.float32)
            out_state[idx] = kept
    return {"state": out_state, "param_groups": groups}


def fp32_params(optimizer: Any) -> list[torch.Tensor]:
    """The values a run continues from, one per param in ``param_groups`` order, as new tensors: the fp32 master
    where the optimizer keeps one, split mode's halves joined (``(p << 16) + low``: the master bit for bit), else the
    param in fp32 (fp64 params stay fp64). Load them into an fp32 model to continue a master-weights run in torch."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p, {})
            if entry.get("master") is not None:
                out.append(entry["master"].detach().clone())
            elif entry.get(LOW_KEY) is not None:
                out.append(join_halves(p.detach(), entry[LOW_KEY]))
            else:
                out.append(p.detach().to(torch.float64 if p.dtype == torch.float64 else torch.float32, copy=True))
    return out


def _keeps_master(optimizer: Any, p: torch.Tensor) -> bool:
    if getattr(optimizer, "master_weights", False) and p.dtype in _LOW_PRECISION:
        return True
    return getattr(optimizer, "bf16_weights", None) == "split" and p.dtype == torch.bfloat16


def from_torch_state_dict(optimizer: Any, state_dict: dict[str, Any], *,
                          fp32_params: Sequence[torch.Tensor] | None = None) -> None:
    """Continue a ``torch.optim`` run (Adam/AdamW into FusedAdam or FusedLAMB, SGD into FusedSGD, Adagrad into
    FusedAdagrad) from its ``state_dict()``: ``optimizer.load_state_dict`` with torch's per-param ``step`` as the
    group's counter (all params of a group must agree), the moments fp32 (quantized for ``state_bits=8``), torch's
    flags checked (``amsgrad``, ``maximize``, ``lr_decay``, a decay mode this optimizer does not have: each fails
    naming the fix); on any error the optimizer keeps its old state.

    ``fp32_params``: the torch run's fp32 param values (``[p.detach() for p in torch_model.parameters()]``, in
    ``param_groups`` order), when ``optimizer`` keeps masters of fp16/bf16 params (``master_weights=True`` or
    ``"split"``): they become the masters exactly (split mode: the param's high half and ``master_low``). Without
    them the masters are rebuilt from the low-precision params (a warning says the low bits are lost).

    Raises:
        ValueError: ``state_dict`` is not in torch's layout (an fp16kit checkpoint: use ``optimizer.load_state_dict``),
            it belongs to another optimizer family, or ``fp32_params`` does not match the params.
    """
    fn = f"from_torch_state_dict({type(optimizer).__name__})"
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(f"{fn}: expected a torch optimizer's state_dict() (a dict with 'state' and 'param_groups').")
    writer = _checkpoint.writer_of(state_dict["param_groups"], state_dict["state"])
    if not writer.startswith("torch.optim."):
        raise ValueError(
            f"{fn}: this state_dict is in fp16kit's own layout (written by {writer}), not torch's: load it with "
            f"optimizer.load_state_dict(state_dict). To move it into a torch optimizer, use to_torch_state_dict."
        )
    if fp32_params is not None:
        state_dict = _with_masters(fn, optimizer, state_dict, list(fp32_params))
    optimizer.load_state_dict(state_dict)


def _with_masters(fn: str, optimizer: Any, state_dict: dict[str, Any], values: list[torch.Tensor]) -> dict[str, Any]:
    """A copy of ``state_dict`` whose entries carry ``master`` = the given fp32 value, for the params whose masters
    ``optimizer`` keeps (the loaders keep it exactly; split mode splits it)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    indices = [i for g in state_dict["param_groups"] for i in g["params"]]
    if len(values) != len(params) or len(indices) != len(params):
        raise ValueError(f"{fn}: fp32_params has {len(values)} tensors, the optimizer {len(params)} params and the "
                         f"state_dict {len(indices)}; give one value per param, in param_groups order.")
    state = dict(state_dict["state"])
    missing = 0
    for p, idx, value in zip(params, indices, values):
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"{fn}: fp32_params value of shape {tuple(value.shape)} for a param of shape "
                             f"{tuple(p.shape)}; give them in param_groups order.")
        if not _keeps_master(optimizer, p):
            continue
        if not state.get(idx):
            missing += 1  # no torch state (never stepped): its master starts from the param at its first step
            continue
        state[idx] = {**state[idx], "master": value.detach().to(p.device, torch.float32, copy=True)}
    if missing:
        warnings.warn(f"{fn}: {missing} param(s) have no state in the torch checkpoint (never stepped); their masters "
                      "start from the fp16/bf16 params at their first step.", RuntimeWarning, stacklevel=3)
    return {**state_dict, "state": state}
