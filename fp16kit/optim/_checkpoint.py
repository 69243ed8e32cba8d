"""Loading checkpoints into FusedLAMB/FusedAdam: import, restore, validate — all before anything is committed.

``FusedOptimizer.load_state_dict`` runs these steps and restores the optimizer as it was if any raises:

1. :func:`import_groups` — groups written by ``torch.optim.Adam``/``AdamW`` (or an older fp16kit) get the
   fp16kit keys they lack from the optimizer's defaults (``bias_correction``, ...); torch's flags are checked
   and dropped: ``amsgrad=True`` or ``maximize=True`` fail here, at load, and so does a
   ``decoupled_weight_decay`` that contradicts ``adam_w_mode`` while the weight decay is non-zero.
2. :func:`restore_state` — per-param state with the saved values: moments become contiguous float32
   (float64 for float64 params) on the param's device, masters contiguous float32; torch's per-param
   ``step`` becomes the group's counter; a missing master (``master_weights=True``) is rebuilt from the param.
   Split mode (``master_weights="split"``) converts both ways, losslessly: a checkpoint's fp32 ``master`` becomes
   the param's high half and ``master_low`` (:func:`finish_split`, after the commit); a ``master_low`` loaded by a
   ``master_weights=True`` optimizer becomes the fp32 master ``(p << 16) + low``, which needs the params of the
   same checkpoint (load the model's state first).
3. :func:`check_state` — structure (shapes, dtypes, devices against the params: the raw-address kernels
   trust them) and values (finite moments, ``exp_avg_sq >= 0``, finite masters, a finite step >= 0),
   with one host read for all the values (loading is not on the hot path).

8-bit moments (``state_bits=8``; docs/optim.md, "8-bit moments") travel as uint8 ``exp_avg``/``exp_avg_sq`` codes
with fp32 ``exp_avg_absmax``/``exp_avg_sq_absmax``. :func:`split_state8` dequantizes them before step 2 (so every
check above runs on their fp32 values) and keeps the originals; :func:`apply_state8` then gives an 8-bit optimizer
8-bit moments: the saved codes and absmax themselves where the checkpoint had them (a round trip is exact), else
the fp32 moments quantized. A ``state_bits=32`` optimizer keeps the dequantized fp32 values. ``state_dict()`` gives
copies of the codes and absmax (:func:`saveable_state8`), so the result goes through ``torch.save`` and
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from fp16kit.distributed import is_dtensor
from fp16kit.kernels import dequantize_state8, join_halves, split_halves, state8_absmax, to_state8

from . import _state8_dtensor
from ._validate import check_state_tensor, check_step_value, state_dtype

__all__ = [
    "apply_state8",
    "check_state",
    "finish_split",
    "import_groups",
    "refuse_foreign",
    "restore_state",
    "saveable_state8",
    "split_state8",
    "writer_of",
]

LOW_KEY = "master_low"  # split mode's int16 low halves (fp16kit/optim/_rows.py)

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# torch.optim flags without a counterpart in fp16kit's groups: harmless at these values, dropped on import.
TORCH_FLAGS = ("foreach", "capturable", "differentiable", "fused")


# State that is a sum or mean of squares: a negative value would become NaN in a square root.
_NON_NEGATIVE = ("exp_avg_sq", "sum")

UNKNOWN = "an unknown optimizer"
# The optimizer families whose state only they (and the optimizers listed with them) can continue.
ADAM_FAMILY = ("FusedAdam", "FusedLAMB", "torch.optim.Adam/AdamW")


def writer_of(saved_groups: Sequence[dict[str, Any]], saved_state: dict[Any, Any]) -> str:
    """The optimizer class that wrote a state_dict, told apart by its group and state keys (each family has
    keys no other has): ``norm_type`` (NovoGrad), ``momentum``/``momentum_buffer`` (SGD), ``sum``/``lr_decay``
    (Adagrad), ``max_grad_norm`` (LAMB), ``betas`` (Adam). torch's optimizers add ``maximize``."""
    g: set[str] = set()
    for group in saved_groups:
        g.update(group if isinstance(group, dict) else ())
    s: set[str] = set()
    for entry in saved_state.values():
        s.update(entry if isinstance(entry, dict) else ())
    torch_optim = "maximize" in g
    if "norm_type" in g or "init_zero" in g:
        return "FusedNovoGrad"
    if "momentum_buffer" in s or "momentum" in g or "dampening" in g:
        return "torch.optim.SGD" if torch_optim else "FusedSGD"
    if "sum" in s or "lr_decay" in g:
        return "torch.optim.Adagrad" if torch_optim or "lr_decay" in g else "FusedAdagrad"
    if "max_grad_norm" in g:
        return "FusedLAMB"
    if "betas" in g or "exp_avg" in s:
        return "torch.optim.Adam/AdamW" if torch_optim or "amsgrad" in g else "FusedAdam"
    if "eps" in g:
        return "FusedAdagrad"  # lr, eps, weight_decay and nothing else
    return UNKNOWN


def refuse_foreign(fn: str, state_dict: dict[str, Any], accepts: Sequence[str]) -> str:
    """The writer of ``state_dict`` (:func:`writer_of`) when it is one of ``accepts``; otherwise a ValueError
    naming both classes (before anything changes). ``fn`` is the loading class's name."""
    writer = writer_of(state_dict["param_groups"], state_dict["state"])
    if writer not in accepts and writer != UNKNOWN:  # no marker at all: left to the checks of keys and shapes
        groups = sorted({k for g in state_dict["param_groups"] for k in g if k != "params"})
        keys = sorted({k for s in state_dict["state"].values() if isinstance(s, dict) for k in s})
        raise ValueError(
            f"{fn}.load_state_dict: this state_dict was saved by {writer} (param group keys {groups}, state keys "
            f"{keys}), not by a {fn}: its state and hyper-parameters belong to another update rule and cannot "
            f"continue a {fn} run ({fn} loads the state of {' and '.join(accepts)}). Load the checkpoint of the "
            f"same optimizer class, or start fresh."
        )
    return writer


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
        for key in TORCH_FLAGS:
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
    bf16_weights: str | None = None,
) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """The new ``optimizer.state`` (see the module docstring, step 2); sets each group's ``step``. The state of
    another family (SGD, Adagrad, NovoGrad) is refused naming both classes (:func:`refuse_foreign`)."""
    refuse_foreign(fn, {"param_groups": saved_groups, "state": saved_state}, ADAM_FAMILY)
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
                if key not in (*moment_keys, "master", LOW_KEY):
                    raise ValueError(
                        f"{where} has a key {key!r} that {fn} does not use (its keys are "
                        f"{[*moment_keys, 'master', LOW_KEY]}); the checkpoint comes from another optimizer."
                    )
                if key == LOW_KEY:
                    dropped += _restore_low(where, entry, p, value, master_weights, bf16_weights)
                    continue
                if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    raise ValueError(f"{where}: {key!r} must be a floating tensor, got {type(value).__name__}.")
                split = bf16_weights == "split" and p.dtype == torch.bfloat16  # converted after the commit
                if key == "master" and not (master_weights and p.dtype in _LOW_PRECISION) and not split:
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
            if bf16_weights == "split" and p.dtype == torch.bfloat16 and "master" not in entry and LOW_KEY not in entry:
                # a bf16 run without masters: the param is its own fp32 master exactly (nothing lost)
                entry[LOW_KEY] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)
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
            f"{fn}.load_state_dict: ignored the fp32 master weights (or split mode's low halves, 'master_low') of "
            f"{dropped} param(s): this optimizer keeps none for them (master_weights=False or 'stochastic', or not "
            f"an fp16/bf16 param). Construct it with master_weights=True (or 'split') to resume from the masters.",
            RuntimeWarning,
            stacklevel=3,
        )
    return state


def _restore_low(
    where: str, entry: dict[str, torch.Tensor], p: torch.Tensor, value: Any, master_weights: bool,
    bf16_weights: str | None,
) -> int:
    """A checkpoint's split-mode low half: kept (split mode), turned into the fp32 master ``(p << 16) + low``
    (``master_weights=True``: ``p`` must be the checkpoint's param), or dropped (returns 1)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int16:
        raise ValueError(f"{where}: {LOW_KEY!r} must be an int16 tensor (split mode's low halves), got "
                         f"{getattr(value, 'dtype', type(value).__name__)}.")
    if p.dtype != torch.bfloat16:
        raise ValueError(f"{where}: {LOW_KEY!r} belongs to a bf16 param, but the param has dtype {p.dtype}.")
    if value.shape != p.shape:
        raise ValueError(f"{where}: {LOW_KEY!r} has shape {tuple(value.shape)} but the param has shape "
                         f"{tuple(p.shape)}.")
    low = value.detach().to(p.device, memory_format=torch.contiguous_format, copy=True)
    if bf16_weights == "split":
        entry[LOW_KEY] = low
    elif master_weights:
        entry["master"] = join_halves(p.detach(), low)
    else:
        return 1
    return 0


def finish_split(
    groups: Sequence[dict[str, Any]], state: dict[torch.Tensor, dict[str, torch.Tensor]], bf16_weights: str | None
) -> None:
    """After a committed load in split mode: every fp32 ``master`` (from a ``master_weights=True`` checkpoint)
    becomes the param's high half and its ``master_low``, losslessly (the params are written)."""
    if bf16_weights != "split":
        return
    for group in groups:
        for p in group["params"]:
            entry = state.get(p)
            master = entry.pop("master", None) if entry else None
            if master is None:
                continue
            hi, lo = split_halves(master)
            with torch.no_grad():
                p.copy_(hi)
            entry[LOW_KEY] = lo


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
                dtype = torch.int16 if key == LOW_KEY else torch.float32 if key == "master" else state_dtype(p)
                check_state_tensor(fn, gi, i, key, t, p, dtype)
                entries.append((gi, i, key, t))
    check_state_values(fn, entries)


def check_state_values(fn: str, entries: Sequence[tuple[int, int, str, torch.Tensor]]) -> None:
    """Every ``(group, index, key, tensor)`` is finite, and an ``exp_avg_sq`` is >= 0; else a ValueError naming
    the first bad one. One host read for all of them (loading is not on the hot path)."""
    names, flags = [], []
    for gi, i, key, t in entries:
        names.append((gi, i, key, "holds inf or NaN"))
        flags.append(_whole(~torch.isfinite(t).all()))
        if key in _NON_NEGATIVE:
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


_MOMENTS8 = (("exp_avg", True), ("exp_avg_sq", False))


def saveable_state8(state: dict[Any, Any]) -> dict[Any, Any]:
    """``state`` (a ``state_dict()``'s, whose entries are the optimizer's live per-param dicts) with every entry that
    holds 8-bit moments replaced by a new dict whose codes and ``*_absmax`` are copies: each in its own storage, so
    ``torch.save`` accepts them (the live absmax is a float32 view of the uint8 codes' storage, ``state8.new_state``),
    and a consistent snapshot that later steps do not change. Other entries are left as they are."""
    out = {}
    for idx, entry in state.items():
        if isinstance(entry, dict) and any(f"{k}_absmax" in entry for k, _ in _MOMENTS8):
            entry = dict(entry)
            for key, _ in _MOMENTS8:
                for k in (key, f"{key}_absmax"):
                    if isinstance(entry.get(k), torch.Tensor):
                        entry[k] = entry[k].detach().clone(memory_format=torch.contiguous_format)
        out[idx] = entry
    return out


def split_state8(fn: str, saved_state: dict[Any, Any]) -> tuple[dict[Any, Any], dict[Any, dict[str, tuple]]]:
    """``(state, originals)``: ``saved_state`` with every 8-bit moment dequantized to fp32 (its ``*_absmax`` key
    dropped), and per saved index the original ``(codes, absmax)`` of each 8-bit moment. Raises ``ValueError``
    for codes without a matching absmax (or an absmax without codes), naming the entry and the fix."""
    out: dict[Any, Any] = {}
    originals: dict[Any, dict[str, tuple]] = {}
    negative: list[tuple[Any, str, torch.Tensor]] = []
    for idx, entry in saved_state.items():
        if not isinstance(entry, dict) or not any(f"{k}_absmax" in entry for k, _ in _MOMENTS8):
            out[idx] = entry
            continue
        entry = dict(entry)
        for key, signed in _MOMENTS8:
            codes, absmax = entry.get(key), entry.pop(f"{key}_absmax", None)
            where = f"{fn}.load_state_dict: state[{idx!r}][{key!r}]"
            if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
                raise ValueError(
                    f"{where}: the checkpoint has {key}_absmax but {key} is not uint8 codes; an 8-bit moment is "
                    f"saved as both. The checkpoint was edited or mixed from two optimizers: load an unmodified one."
                )
            blocks = -(-codes.numel() // 256)
            if not isinstance(absmax, torch.Tensor) or absmax.dtype != torch.float32 or absmax.numel() != blocks:
                got = "nothing" if absmax is None else f"{getattr(absmax, 'dtype', type(absmax).__name__)} " \
                    f"{getattr(absmax, 'numel', lambda: '?')()} entries"
                raise ValueError(
                    f"{where}: 8-bit codes of {codes.numel()} elements need a float32 {key}_absmax of {blocks} "
                    f"entries (one per 256-element block), got {got}. Load an unmodified checkpoint."
                )
            codes, absmax = codes.contiguous(), absmax.contiguous().to(codes.device)
            if not is_dtensor(absmax):
                absmax = absmax.reshape(-1)  # an FSDP2 "rows" absmax gathered whole is 2-D (_state8_dtensor.py)
            originals.setdefault(idx, {})[key] = (codes, absmax)
            negative.append((idx, key, _whole((absmax < 0).any())))
            if is_dtensor(codes):  # an FSDP2 param's: shard by shard (_state8_dtensor.py)
                entry[key] = _state8_dtensor.dequantize_dtensor(codes, absmax, signed)
            else:
                entry[key] = dequantize_state8(codes, absmax, signed)
        out[idx] = entry
    _refuse_negative_absmax(fn, negative)
    return out, originals


def _refuse_negative_absmax(fn: str, flags: list[tuple[Any, str, torch.Tensor]]) -> None:
    """A block's absmax is ``max |x|``: never negative (NaN marks a poisoned block, which the value checks refuse as
    NaN moments). A negative one would flip the signs of its block's values, which no later check sees in
    ``exp_avg``: a ValueError naming the first, with one host read for all of them."""
    if not flags:
        return
    bad = torch.stack([f.to(flags[0][2].device) for _, _, f in flags]).nonzero().flatten().tolist()
    if bad:
        idx, key, _ = flags[bad[0]]
        raise ValueError(
            f"{fn}.load_state_dict: state[{idx!r}][{key + '_absmax'!r}] holds negative values; a block's absmax is the "
            f"largest magnitude of its values (>= 0). The checkpoint is corrupt: load an earlier one."
        )


def apply_state8(
    optimizer: Any,
    groups: Sequence[dict[str, Any]],
    saved_groups: Sequence[dict[str, Any]],
    state: dict[torch.Tensor, dict[str, torch.Tensor]],
    originals: dict[Any, dict[str, tuple]],
) -> None:
    """Give the params whose moments are 8-bit in ``optimizer`` (``optimizer._state8(p)``) 8-bit moments, in
    place in ``state``: the saved codes and absmax where ``originals`` has them for the param's saved index (exact),
    else the restored fp32 moments quantized."""
    for group, saved_group in zip(groups, saved_groups):
        for p, idx in zip(group["params"], saved_group["params"]):
            entry = state.get(p)
            kind = optimizer._state8(p) if entry else False
            if not kind:
                continue
            saved = originals.get(idx, {})
            for key, signed in _MOMENTS8:
                if is_dtensor(p):  # FSDP2: DTensor codes and absmax (_state8_dtensor.py)
                    got = saved.get(key)
                    if got is not None and not (is_dtensor(got[0]) and is_dtensor(got[1])):
                        got = None  # whole-tensor codes (a single-process checkpoint): quantize the values
                    entry[key], entry[f"{key}_absmax"] = _state8_dtensor.moment(
                        p, kind, signed, x=entry[key] if got is None else None, saved=got)
                    continue
                if key in saved:
                    codes_in, absmax_in = saved[key]
                    codes = to_state8(torch.zeros(p.shape, dtype=torch.float32, device=p.device), signed)
                    codes.copy_(codes_in.view(p.shape))
                    state8_absmax(codes).copy_(absmax_in)
                else:
                    codes = to_state8(entry[key].float(), signed)
                entry[key] = codes
                entry[f"{key}_absmax"] = state8_absmax(codes)
