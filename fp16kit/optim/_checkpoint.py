"""Loading checkpoints into FusedLAMB/FusedAdam: import, restore, validate — all before anything is committed.

``FusedOptimizer.load_state_dict`` runs these steps and restores the optimizer as it was if any raises:

1. :func:`import_groups` — groups written by ``torch.optim.Adam``/``AdamW`` (or an older fp16kit) get the
   fp16kit keys they lack from the optimizer's defaults (``bias_correction``, ...); torch's flags are checked
   and dropped: ``amsgrad=True`` or ``maximize=True`` fail here, at load, and so does a
   ``decoupled_weight_decay`` that contradicts ``adam_w_mode`` while the weight decay is non-zero.
2. :func:`restore_state` — per-param state with the saved values: moments become contiguous float32
   (float64 for float64 params) on the param's device, masters contiguous float32; torch's per-param
   ``step`` becomes the group's counter; a missing master (``master_weights=True``) is rebuilt from the param.
3. :func:`check_state` — structure (shapes, dtypes, devices against the params: the raw-address kernels
   trust them) and values (finite moments, ``exp_avg_sq >= 0``, finite masters, a finite step >= 0),
   with one host read for all the values (loading is not on the hot path).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from fp16kit.distributed import is_dtensor

from ._validate import check_state_tensor, check_step_value, state_dtype

__all__ = ["check_state", "import_groups", "restore_state"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# torch.optim flags without a counterpart in fp16kit's groups: harmless at these values, dropped on import.
_TORCH_FLAGS = ("foreach", "capturable", "differentiable", "fused")


def import_groups(
    fn: str, saved_groups: Sequence[dict[str, Any]], defaults: dict[str, Any], *, adam_w_mode: bool
) -> list[dict[str, Any]]:
    """Copies of the saved groups in fp16kit's form (see the module docstring, step 1)."""
    out = []
    for gi, saved in enumerate(saved_groups):
        group = dict(saved)
        where = f"{fn}.load_state_dict: the checkpoint's param_groups[{gi}]"
        if group.pop("amsgrad", False):
            raise ValueError(
                f"{where} has amsgrad=True (its state holds max_exp_avg_sq); {fn} does not support AMSGrad. "
                f"Resume it with torch.optim.Adam(amsgrad=True)."
            )
        if group.pop("maximize", False):
            raise ValueError(f"{where} has maximize=True; {fn} minimizes. Negate the loss instead, and start afresh.")
        for key in _TORCH_FLAGS:
            group.pop(key, None)
        if "decoupled_weight_decay" in group:
            decoupled = bool(group.pop("decoupled_weight_decay"))
            if decoupled != adam_w_mode and group.get("weight_decay", 0) != 0:
                origin = "torch.optim.AdamW (decoupled weight decay)" if decoupled else "torch.optim.Adam (L2 decay)"
                raise ValueError(
                    f"{where} comes from {origin} with weight_decay={group['weight_decay']}, but this {fn} has "
                    f"adam_w_mode={adam_w_mode}. Construct it with adam_w_mode={decoupled} to continue that run."
                )
        for key, value in defaults.items():
            group.setdefault(key, value)
        out.append(group)
    return out


def restore_state(
    fn: str,
    groups: Sequence[dict[str, Any]],
    saved_groups: Sequence[dict[str, Any]],
    saved_state: dict[Any, dict[str, Any]],
    *,
    moment_keys: Sequence[str],
    master_weights: bool,
) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """The new ``optimizer.state`` (see the module docstring, step 2); sets each group's ``step``."""
    state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    rebuilt = dropped = 0
    for gi, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        steps = []
        for i, (p, idx) in enumerate(zip(group["params"], saved_group["params"])):
            saved = saved_state.get(idx)
            if not saved:
                continue
            where = f"{fn}.load_state_dict: state of param_groups[{gi}]['params'][{i}]"
            entry: dict[str, torch.Tensor] = {}
            for key, value in saved.items():
                if key == "step":  # torch.optim keeps the counter per param
                    steps.append(float(value))
                    continue
                if key not in (*moment_keys, "master"):
                    raise ValueError(
                        f"{where} has a key {key!r} that {fn} does not use (its keys are {[*moment_keys, 'master']}); "
                        f"the checkpoint comes from another optimizer."
                    )
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    raise ValueError(f"{where}: {key!r} must be a floating tensor, got {type(value).__name__}.")
                if key == "master" and not (master_weights and p.dtype in _LOW_PRECISION):
                    dropped += 1
                    continue
                dtype = torch.float32 if key == "master" else state_dtype(p)
                entry[key] = value.detach().to(p.device, dtype, memory_format=torch.contiguous_format, copy=True)
            missing = [k for k in moment_keys if k not in entry]
            if missing:
                raise ValueError(f"{where} lacks {missing}; a checkpoint holds every moment of a param or none.")
            if master_weights and p.dtype in _LOW_PRECISION and "master" not in entry:
                entry["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
                rebuilt += 1
            state[p] = entry
        _set_group_step(fn, gi, group, steps)
    if rebuilt:
        warnings.warn(
            f"{fn}.load_state_dict: the checkpoint holds no fp32 master weights for {rebuilt} fp16/bf16 param(s) "
            f"of this master_weights=True optimizer; rebuilt them from the params (the bits the low-precision "
            f"params lost are not recovered).",
            RuntimeWarning,
            stacklevel=3,
        )
    if dropped:
        warnings.warn(
            f"{fn}.load_state_dict: ignored the fp32 master weights of {dropped} param(s): this optimizer keeps "
            f"none for them (master_weights=False, or not an fp16/bf16 param). Construct it with "
            f"master_weights=True to resume from the masters.",
            RuntimeWarning,
            stacklevel=3,
        )
    return state


def _set_group_step(fn: str, gi: int, group: dict[str, Any], steps: list[float]) -> None:
    """The group's counter from the group itself (fp16kit, apex) or from torch's per-param counters."""
    if "step" in group:
        value = group["step"]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"{fn}.load_state_dict: param_groups[{gi}]['step'] has {value.numel()} elements.")
            value = value.reshape(())
        check_step_value(f"{fn}.load_state_dict", gi, float(value))
        return
    if not steps:
        return
    if any(s != steps[0] for s in steps):
        raise ValueError(
            f"{fn}.load_state_dict: the params of the checkpoint's param_groups[{gi}] took different numbers of "
            f"steps ({sorted(set(steps))}); {fn} keeps one counter per group. Split them into groups that agree."
        )
    check_step_value(f"{fn}.load_state_dict", gi, steps[0])
    group["step"] = steps[0]


def _whole(flag: torch.Tensor) -> torch.Tensor:
    """A flag over a sharded (FSDP2 DTensor) state tensor, combined over its ranks: every rank sees the same
    verdict, so every rank raises together instead of one rank leaving the others waiting in a collective."""
    return flag.full_tensor() if is_dtensor(flag) else flag


def check_state(
    fn: str,
    groups: Sequence[dict[str, Any]],
    state: dict[torch.Tensor, dict[str, torch.Tensor]],
    moment_keys: Sequence[str],
) -> None:
    """Structure, then values, of every state tensor (see the module docstring, step 3)."""
    fn = f"{fn}.load_state_dict"
    entries = []
    for gi, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            entry = state.get(p)
            if not entry:
                continue
            for key, t in entry.items():
                check_state_tensor(fn, gi, i, key, t, p, torch.float32 if key == "master" else state_dtype(p))
                entries.append((gi, i, key, t))
    check_state_values(fn, entries)


def check_state_values(fn: str, entries: Sequence[tuple[int, int, str, torch.Tensor]]) -> None:
    """Every ``(group, index, key, tensor)`` is finite, and an ``exp_avg_sq`` is >= 0; else a ValueError naming
    the first bad one. One host read for all of them (loading is not on the hot path)."""
    names, flags = [], []
    for gi, i, key, t in entries:
        names.append((gi, i, key, "holds inf or NaN"))
        flags.append(_whole(~torch.isfinite(t).all()))
        if key == "exp_avg_sq":
            names.append((gi, i, key, "holds negative values (a second moment is a mean of squares)"))
            flags.append(_whole((t < 0).any()))
    if not flags:
        return
    bad = torch.stack([f.to(flags[0].device) for f in flags]).nonzero().flatten().tolist()  # one host read
    if bad:
        gi, i, key, problem = names[bad[0]]
        raise ValueError(
            f"{fn}: state[{key!r}] of param_groups[{gi}]['params'][{i}] {problem}; loading it would put NaN into "
            f"the weights. The checkpoint is corrupt: load an earlier one."
        )
