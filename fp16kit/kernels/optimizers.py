"""Public optimizer update ops: one parameter group's step over whole tensor lists, on the device.

These are the ops ``fp16kit.optim`` (FusedLAMB, FusedAdam, FusedSGD, FusedAdagrad, FusedNovoGrad, the sharded
LAMB step) calls; users writing their own loops get the same functions. Every op plans its rows through the
one planner (``fp16kit/kernels/engine/plan.py``: validation, dtype groups, the plan cache, recorded address tables),
then runs each group once:

* kernel groups (contiguous fp16/bf16/fp32 tensors, fp32 state, Triton or its interpreter): the Triton
  launchers (``triton/lamb.py``, ``triton/adam.py``, ``triton/sgd.py``, ``triton/adagrad.py``,
  ``triton/novograd.py``), one launch set per dtype combination;
* fallback groups (everything else, every row with the torch backend): the one torch implementation of each
  optimizer (``fallback/step.py`` for LAMB/Adam, ``fallback/apex_step.py`` for SGD/Adagrad/NovoGrad), grouped by
  math dtype (float64 for float64 params, else float32); LAMB rows the opt-in native CPU kernel takes
  (``cpu_native.takes``) run there.

The float64 references of the same math are in ``fp16kit.numerics``. ``hp64`` is the float64 hyper-parameter
vector whose layout each kernel module documents; kernels get it rounded once to fp32. Nothing syncs with the
host; when ``found_inf`` is set every op is a no-op on the device. Rows are validated by the planner (pairing,
one device, and no written tensor overlapping another row's tensor, ``ValueError``); state dtypes and
hyper-parameters are the callers' (``fp16kit.optim``) to validate.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch

from .backend import Backend, select_backend
from .bf16_weights import modes as _bf16_weights
from .bf16_weights.modes import Bf16Weights, join_halves, split_halves, stochastic_round
from .engine import launch as _launch
from .engine import plan as _plan
from .engine.results import StepVerify
from .engine.rows import ApexRows
from .engine.step_scalars import DeviceStep
from .engine.table import playing
from .fallback import adagrad as fb_adagrad
from .fallback import adam as fb_adam
from .fallback import apex_step as fb_apex_step
from .fallback import l2norm as fb_l2norm
from .fallback import lamb as fb_lamb
from .fallback import lamb_native as cpu_native
from .fallback import novograd as fb_novograd
from .fallback import sgd as fb_sgd
from .fallback import step as fb_step
from .ops import _L2NORM, l2norm

__all__ = [
    "Bf16Weights",
    "DeviceStep",
    "LambStaged",
    "StepVerify",
    "adagrad_update",
    "adam_update",
    "check_and_norm",
    "join_halves",
    "lamb_stage1",
    "lamb_stage2",
    "lamb_update",
    "novograd_update",
    "record_launches",
    "replay_launches",
    "sgd_update",
    "split_halves",
    "step_check",
    "stochastic_round",
]

F64 = torch.float64


@functools.cache
def _spec(
    fn: str, names: tuple[str, ...], state: tuple[int, ...], with_models: bool, state8: bool = False
) -> _plan.Spec:
    """The planner's description of an optimizer's rows: params (0) and grads (1) first, state rows (written,
    fp32 for the kernels), then the optional model copies (written; ``None`` entries allowed). Kernel groups are
    keyed by the param, grad and model dtypes, fallback groups by the math dtype; empty tensors go to the
    fallback (a no-op there). The grads are loose rows: a step with new grad tensors (``zero_grad(set_to_none=True)``
    and a backward pass) still hits the cached plan when they fit it (``_plan.Spec.loose``). ``state8``: the state
    rows may also be uint8 (8-bit moments, ``state8.py``) in a kernel group."""
    models = len(names) if with_models else None
    extra = () if models is None else (models,)
    return _plan.Spec(
        fn,
        names + (("model_params",) if with_models else ()),
        written=(0, *state, *extra),
        key_rows=(0, 1, *extra),
        state_rows=state,
        optional=models,
        keep_empty=True,
        math_key=True,
        loose=(1,),
        state_dtypes=frozenset({torch.float32, torch.uint8}) if state8 else frozenset({torch.float32}),
    )


def _has_models(models: Sequence[torch.Tensor | None] | None) -> bool:
    """Some entry is a tensor (one C-level pass, no per-entry Python)."""
    return models is not None and any(map(operator.is_not, models, repeat(None)))


def _rows(
    fn: str,
    names: tuple[str, ...],
    state: tuple[int, ...],
    lists: tuple[Sequence[torch.Tensor], ...],
    models: Sequence[torch.Tensor | None] | None,
    extra: tuple | None = None,
    state8: bool = False,
) -> tuple[_plan.Plan, bool]:
    with_models = _has_models(models)
    rows = lists + ((models,) if with_models else ())
    return _plan.plan(_spec(fn, names, state, with_models, state8), rows, extra), with_models


def _models_of(group: _plan.Group, models: Sequence[torch.Tensor | None] | None, with_models: bool, n: int) -> list:
    """The group's model copies (``None`` entries where a row has none)."""
    return group.pick(models) if with_models else [None] * n


def _kernel_models(chosen: list) -> list[torch.Tensor] | None:
    """A kernel group's model copies: all present or all absent (the model dtype is part of the group key)."""
    return None if chosen[0] is None else chosen


# ---------------------------------------------------------------------------------------------------------------
# Recorded launches (a steady device step replayed: fp16kit/optim/_base.py)


def record_launches(device: torch.device) -> _launch.Recording:
    """``with record_launches(device) as rec:`` capture every fp16kit Triton launch of this thread
    (``rec.launches``, replayable by :func:`replay_launches` while their arguments stand); ``rec.ok`` is False when
    anything else ran inside (a torch op other than a view: a fallback row, a fill, a host-side pass), so that a
    replay of the launches alone would not be the same step (``fp16kit/kernels/engine/launch.py``)."""
    return _launch.Recording(device)


def replay_launches(launches: Sequence[Any]) -> None:
    """Issue recorded launches again, in order: the same kernels, grids and arguments (on CUDA with
    ``FP16KIT_BOUND_LAUNCH=1``, through the compiled kernels' C launchers with the arguments bound once)."""
    _launch.replay(launches)


# ---------------------------------------------------------------------------------------------------------------
# LAMB and Adam


_ADAM_NAMES = ("params", "grads", "exp_avgs", "exp_avg_sqs")


def check_and_norm(
    grads: Sequence[torch.Tensor], inv_scale64: torch.Tensor, found_inf: torch.Tensor, *, exact: bool = False
) -> torch.Tensor:
    """Global L2 norm of the unscaled grads ``inv_scale * sqrt(sum g^2)`` (0-dim fp32), raising ``found_inf`` on
    any inf/NaN among the unscaled values: the check pass before an optimizer update.

    Triton backends: :func:`fp16kit.kernels.l2norm` (one read of the grads). Torch backend: the native CPU pass
    when enabled (``cpu_native.takes_grads``), else ``fb_l2norm.check_and_norm`` (``torch._foreach_norm``),
    which unlike ``l2norm``'s fallback materializes no scaled copy. Both sum fp32 squares on the CPU (within
    ``gamma(n)`` of the float64 reference); ``exact=True`` makes the torch backend follow the kernels' arithmetic
    instead (``fb_l2norm.check_and_norm_exact``: float64 sums, the kernels' fp32 norm bit for bit but for the
    summation order), as the 8-bit moments need. Empty tensors add nothing.
    """
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=found_inf.device)
    if select_backend(grads[0].device).backend is not Backend.TORCH:
        return l2norm(grads, pre_scale=inv_scale64.float(), found_inf=found_inf)
    if exact:
        return fb_l2norm.check_and_norm_exact(grads, inv_scale64, found_inf)
    if cpu_native.takes_grads(grads):
        return cpu_native.check_and_norm(grads, inv_scale64, found_inf)
    return fb_l2norm.check_and_norm(grads, inv_scale64, found_inf)


def step_check(
    grads: Sequence[torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    norm_out: torch.Tensor | None,
    *,
    own_flag: bool,
    skip_count: torch.Tensor | None = None,
    check_factor: float = 1.0,
) -> bool:
    """The check pass of a device-resident step in one launch (``l2norm_kernel.launch_step_check``): raise
    ``found_inf`` (float32 ``[1]``; written whole with ``own_flag``) when some ``fp32(g) / grad_scale`` is inf/NaN,
    write the global norm of the unscaled grads into ``norm_out`` (float32 ``[1]``, optional), and add the skip to
    ``skip_count`` (int64 ``[1]``, optional), all on the device.

    Returns False, having done nothing, when the grads are not one Triton kernel group (several dtypes, layouts
    the kernels do not take, the torch backend): the caller then runs ``check_and_norm``/``flag_nonfinite``."""
    if not grads:
        return False
    plan = _plan.plan(_L2NORM, (grads,))  # empty grads are left out of every group (they add nothing)
    if plan.rest or len(plan.kernel) != 1:
        return False
    from .triton.l2norm import launch_step_check

    (g,) = plan.kernel
    with playing(g.tape):
        launch_step_check(g.pick(grads), grad_scale, found_inf, norm_out, own_flag=own_flag, skip_count=skip_count,
                          check_factor=check_factor)
    return True


def _lamb_or_adam(
    kind: str,
    rows: fb_step.Rows,
    hp64: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    modes: dict[str, bool],
    step: torch.Tensor | None,
    state8: bool = False,
    weights: Bf16Weights | None = None,
) -> None:
    """Run ``kind`` ("lamb" or "adam") over ``rows`` (``(params, grads, exp_avgs, exp_avg_sqs, models)``) on the
    kernel groups (one launch set per dtype combination) and the fallback groups (per math dtype). ``step`` (the
    counter ``hp64`` was derived from) lets the CPU fallback hand the Adam math to torch's fused CPU Adam kernel
    (``fallback/step.py``). ``state8``: moments may be 8-bit
    (``state8.py``): the kernels' ``QSTATE``, ``state8/fallback.py``. The 8-bit layout is checked every call
    (``check_state8``: dtypes and storage sizes, no tensor op), not once per plan: room for the absmax is a property
    of the storage, which a plan hit (same addresses and metadata) does not prove. ``weights``: how bf16 params are
    written (``bf16_weights/modes.py``: the kernels' epilogue, the fallback's wrapper)."""
    params, grads, exp_avgs, exp_avg_sqs, models = rows
    if not params:
        return
    fn = f"{kind}_update"
    plan, with_models = _rows(fn, _ADAM_NAMES, (2, 3), (params, grads, exp_avgs, exp_avg_sqs), models, None, state8)
    if state8:
        check_state8(fn, params, exp_avgs, exp_avg_sqs)
    flag = found_inf.reshape(1)
    device_step = hp64 if isinstance(hp64, DeviceStep) else None
    if device_step is not None:
        # Rows the kernels cannot take use the float64 vector of the same step (built before any launch
        # advances the counter); the last kernel launch advances it, or, with no kernel group, a torch op.
        hp64 = device_step.hp64() if plan.rest else None
        if not plan.kernel:
            device_step.step.add_((flag == 0).to(device_step.step.dtype))
    if plan.kernel:
        if kind == "lamb":
            from .triton.lamb import launch_lamb as launch
        else:
            from .triton.adam import launch_adam as launch
        last = len(plan.kernel) - 1
        hp32 = hp64.float() if device_step is None else None
        for i, g in enumerate(plan.kernel):
            if device_step is None:
                hp = hp32
            else:
                hp = dataclasses.replace(device_step, advance=i == last) if last else device_step
            lists = (g.pick(params), g.pick(grads), g.pick(exp_avgs), g.pick(exp_avg_sqs))
            chosen = _kernel_models(_models_of(g, models, with_models, len(g.idx)))
            epilogue = {} if weights is None else {"weights": weights, "row_idx": _row_idx(g, weights)}
            with playing(g.tape):
                launch(*lists, chosen, hp, flag, **modes, state8=state8, **epilogue)
            # Done whether or not ``found_inf`` skipped the write on the device: a spurious bump is harmless.
            fb_step.bump_versions(lists[0], lists[2], lists[3], chosen or [])
    step_fn = fb_lamb.lamb_ if kind == "lamb" else fb_adam.adam_
    for g in plan.rest:
        p = g.pick(params)
        hp = hp64 if p[0].dtype == F64 else hp64.float()
        lists = (p, g.pick(grads), g.pick(exp_avgs), g.pick(exp_avg_sqs))
        chosen = _models_of(g, models, with_models, len(p))
        if state8:  # the kernels' rounding sequence for every row, 8-bit or not: one result per backend
            from .state8 import fallback as fb8

            step8 = functools.partial(fb8.lamb8_ if kind == "lamb" else fb8.adam8_, hp=hp, found_inf=flag, **modes)
            if weights is not None:
                _bf16_weights.fallback_step(step8, lists, chosen, flag, weights, g.idx)
            else:
                step8((*lists, chosen))
            continue
        if weights is None and kind == "lamb" and cpu_native.takes((*lists, chosen)):
            cpu_native.lamb_((*lists, chosen), hp, flag, **modes)
            fb_step.bump_versions(lists[0], lists[2], lists[3], [])
            continue
        fused = None if step is None else fb_step.FusedAdamArgs(step, hp64, g.memo if weights is None else None)
        if weights is not None:
            twin = functools.partial(_on_rows, step_fn, hp=hp, found_inf=flag, fused=fused, **modes)
            _bf16_weights.fallback_step(twin, lists, chosen, flag, weights, g.idx)
            continue
        step_fn(*lists, chosen, hp, flag, **modes, fused=fused)


def _on_rows(step_fn: Any, rows: fb_step.Rows, **kw: Any) -> None:
    """A torch twin's step (``fb_lamb.lamb_``/``fb_adam.adam_``: the rows as five parameters) over a row bundle."""
    step_fn(*rows, **kw)


def _row_idx(g: _plan.Group, weights: Bf16Weights | None) -> torch.Tensor | None:
    """Stochastic rounding's row table (``_bf16_weights.row_table``) of a kernel group that is not the call's whole
    list or whose rows are FSDP2 shards starting inside their tensors: the rows' positions in the call and their
    first elements' indices in their whole tensors (int64, on the device), made once per plan group and offsets
    (``memo``). None (the kernel takes launch tensor ``t`` as row ``t``, offset 0) otherwise."""
    if weights is None or weights.mode != "stochastic":
        return None
    offsets = None if weights.offsets is None else tuple(weights.offsets[i] for i in g.idx)
    if g.whole and not any(offsets or ()):
        return None
    key = ("row_idx", offsets)
    idx = g.memo.get(key)
    if idx is None:
        idx = g.memo[key] = _bf16_weights.row_table(g.idx, offsets or [0] * len(g.idx), weights.step.device)
    return idx


def lamb_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp64: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    weight_decay: float,
    adam_w_mode: bool,
    use_nvlamb: bool,
    step: torch.Tensor | None = None,
    weights: Bf16Weights | None = None,
    state_bits: int = 32,
) -> None:
    """LAMB stages 1 and 2 for one group (validated lists, one device); a no-op on the device when found_inf is
    set. ``hp64``: ``[lr, b1, b2, beta3, 1 - b2, eps, wd, bc1, bc2, inv_scale, clip]`` (``triton/lamb.py``);
    ``models``: model copies written with the rounded params (``None`` entries allowed). ``step``: the counter
    ``hp64`` was built from (optional; it enables the fast CPU path). ``state_bits=8``: the moments of params of
    at least ``state8.SMALL_NUMEL`` elements are 8-bit (``to_state8``; else ``ValueError``), the rest fp32.
    ``weights``: bf16 params without fp32 masters (:class:`Bf16Weights`: ``"split"``, with ``models`` holding the
    int16 low halves as bf16 views, or ``"stochastic"``); docs/optim.md, "bf16 weights without fp32 masters"."""
    modes = {
        "l2_mode": not adam_w_mode and weight_decay != 0,
        "decoupled": adam_w_mode and weight_decay != 0,
        "trust": use_nvlamb or weight_decay != 0,
    }
    run = _lamb_or_adam if weights is None else _bf16_weights_update  # (one graph break under compile)
    run("lamb", (params, grads, exp_avgs, exp_avg_sqs, models), hp64, found_inf, modes, step,
        _state8_flag(state_bits), weights)


def adam_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp64: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    weight_decay: float,
    adam_w_mode: bool,
    step: torch.Tensor | None = None,
    weights: Bf16Weights | None = None,
    state_bits: int = 32,
) -> None:
    """The Adam pass for one group (validated lists, one device); a no-op on the device when found_inf is set.
    ``hp64``: ``[lr, b1, b2, 1 - b1, 1 - b2, eps, wd, -lr/bc1, sqrt(bc2), inv_scale, 1 - lr*wd]``
    (``triton/adam.py``). ``step``: the counter ``hp64`` was built from (optional; it enables the fast CPU path).
    ``state_bits=8``: as :func:`lamb_update`. ``weights``: bf16 params without fp32 masters, as in
    :func:`lamb_update`."""
    modes = {"l2_mode": not adam_w_mode and weight_decay != 0, "decoupled": adam_w_mode and weight_decay != 0}
    run = _lamb_or_adam if weights is None else _bf16_weights_update  # (one graph break under compile)
    run("adam", (params, grads, exp_avgs, exp_avg_sqs, models), hp64, found_inf, modes, step,
        _state8_flag(state_bits), weights)


def _state8_flag(state_bits: int) -> bool:
    if state_bits not in (8, 32):
        raise ValueError(f"fp16kit: state_bits={state_bits!r} is not supported; choose 32 (fp32 moments) or 8.")
    return state_bits == 8


def check_state8(
    fn: str, params: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor]
) -> None:
    """The 8-bit layout the kernels rely on: a param that ``uses_state8`` has 8-bit moments made by ``to_state8``
    (codes with room for their absmax), any other fp32/fp64 moments; else ``ValueError`` naming the position."""
    from .state8.rule import SMALL_NUMEL, check_room, uses_state8

    for i, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
        want = torch.uint8 if uses_state8(p) else (F64 if p.dtype == F64 else torch.float32)
        for name, x in (("exp_avgs", m), ("exp_avg_sqs", v)):
            if x.dtype != want:
                raise ValueError(
                    f"{fn}: {name}[{i}] has dtype {x.dtype} but with state_bits=8 a param of {p.numel()} elements and "
                    f"dtype {p.dtype} needs {want} moments (8-bit from {SMALL_NUMEL} elements up). Make the state with "
                    f"fp16kit.kernels.to_state8 (or let the optimizer make it)."
                )
            if want == torch.uint8:
                check_room(x)


# ---------------------------------------------------------------------------------------------------------------
# LAMB in two stages, for sharded parameters (fp16kit/optim/_sharding.py completes the norms in between)


@dataclass
class LambStaged:
    """Stage 1's result for one group: ``sums[0, i] = sum p_i^2`` (old p) and ``sums[1, i] = sum u_i^2`` (fp32
    [2, N]; a caller may all-reduce columns in place before :func:`lamb_stage2`), and what stage 2 needs."""

    sums: torch.Tensor
    hp64: torch.Tensor
    rows: tuple[list, list, list, list, list]
    parts: list[tuple[str, _plan.Group, Any]]
    state8: bool = False  # state_bits=8: moments may be 8-bit (``state8.py``)
    weights: Bf16Weights | None = None  # the bf16 write epilogue (``bf16_weights/modes.py``), as in :func:`lamb_update`


def lamb_stage1(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp64: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    state_bits: int = 32,
    weights: Bf16Weights | None = None,
) -> LambStaged:
    """LAMB's stage 1 over one group (m, v updated; the update direction ``u`` kept) and the per-tensor sums
    of ``p^2`` and ``u^2`` that stage 2's trust ratio needs. Kernel groups run ``triton/lamb.py``'s stage-1
    kernel; the others the torch stage below. No-op on the device when ``found_inf`` is set. ``state_bits=8``:
    as :func:`lamb_update` (``u`` and its sums from the moments as stored). ``weights``: bf16 params without fp32
    masters, as in :func:`lamb_update` (split: ``p`` is the reassembled master, in the sums too; stage 2 writes
    the epilogue; ``weights.offsets``: where FSDP2 shards start in their tensors, for stochastic rounding)."""
    device = params[0].device
    sums = torch.zeros(2, len(params), dtype=torch.float32, device=device)
    state8 = _state8_flag(state_bits)
    plan, _ = _rows("lamb_stage1", _ADAM_NAMES, (2, 3), (params, grads, exp_avgs, exp_avg_sqs), models, None,
                    state8)
    if state8:
        check_state8("lamb_stage1", params, exp_avgs, exp_avg_sqs)
    rows = (list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(models))
    staged = LambStaged(sums, hp64, rows, [], state8, weights)
    modes = {"l2_mode": l2_mode, "decoupled": decoupled}
    for g in plan.kernel:
        state = _kernel_stage1(staged, g, found_inf, modes)
        sums[0, g.idx], sums[1, g.idx] = state[1], state[2]
        staged.parts.append(("kernel", g, state))
    for g in plan.rest:
        state = _torch_stage1(staged, g, found_inf, modes)
        sums[:, g.idx] = state[-1].to(torch.float32)
        staged.parts.append(("torch", g, state))
    return staged


def lamb_stage2(staged: LambStaged, found_inf: torch.Tensor, *, decoupled: bool, trust: bool) -> None:
    """``p -= ratio * u`` with ``ratio = lr |p| / |u|`` from ``staged.sums`` (when ``trust`` and both norms are
    non-zero, else ``lr``); model copies written. No-op on the device when ``found_inf`` is set."""
    flag = found_inf.reshape(1)
    sums = staged.sums
    for kind, g, state in staged.parts:
        if kind == "kernel":
            _kernel_stage2(staged, g, state[0], sums[1, g.idx].contiguous(), sums[0, g.idx].contiguous(), flag,
                           decoupled, trust)
        else:
            _torch_stage2(staged, g, state, sums[:, g.idx], flag, trust)


def _lists(staged: LambStaged, g: _plan.Group) -> tuple[list, ...]:
    return tuple(g.pick(r) for r in staged.rows)


def _kernel_stage1(staged: LambStaged, g: _plan.Group, flag: torch.Tensor, modes: dict) -> tuple:
    """``launch_lamb``'s first half (``lamb_kernel.launch_lamb_stage1``): ``(table, p_sumsq, u_sumsq)``."""
    from .triton.lamb import launch_lamb_stage1

    params, grads, exp_avgs, exp_avg_sqs, models = _lists(staged, g)
    with playing(g.tape):
        return launch_lamb_stage1(
            (params, grads, exp_avgs, exp_avg_sqs, None if models[0] is None else models), staged.hp64.float(),
            flag.reshape(1), l2_mode=modes["l2_mode"], decoupled=modes["decoupled"], state8=staged.state8,
            weights=staged.weights,
        )


def _kernel_stage2(
    staged: LambStaged, g: _plan.Group, table: Any, u_sumsq: torch.Tensor, p_sumsq: torch.Tensor,
    flag: torch.Tensor, decoupled: bool, trust: bool,
) -> None:
    """``launch_lamb``'s second half (``lamb_kernel.launch_lamb_stage2``) with the completed (all-reduced)
    per-tensor sums."""
    from .triton.lamb import launch_lamb_stage2

    params, _, exp_avgs, exp_avg_sqs, models = _lists(staged, g)
    models = None if models[0] is None else models
    launch_lamb_stage2(table, params, models, staged.hp64.float(), flag, u_sumsq, p_sumsq, decoupled=decoupled,
                       trust=trust, state8=staged.state8, weights=staged.weights, row_idx=_row_idx(g, staged.weights))
    fb_step.bump_versions(params, exp_avgs, exp_avg_sqs, [] if models is None else models)


def _torch_stage1(staged: LambStaged, g: _plan.Group, flag: torch.Tensor, modes: dict) -> tuple:
    """Stage 1 in torch ops (the math of ``fb_lamb.lamb_``), keeping ``u`` for stage 2.

    CPU (the skip read on the host, no queue to drain): nothing at all when skipped, else m, v updated in
    place with host-number hyper-parameters, as the kernel's stage 1 writes them. Elsewhere: m, v computed
    into copies, committed in stage 2 under ``torch.where(found_inf, old, new)``.
    """
    params, grads, exp_avgs, exp_avg_sqs, models = _lists(staged, g)
    hp = staged.hp64 if params[0].dtype == F64 else staged.hp64.float()
    sums = torch.zeros(2, len(params), dtype=F64, device=hp.device)
    if staged.weights is not None:  # the fp32 values of bf16 rows (split: the reassembled masters), before any rule
        params = _bf16_weights.widen(staged.weights, params, models)[1]
    if staged.state8:
        # 8-bit moments: committed here (the state tensors stand in as "new" m, v for stage 2's masked commit)
        from .state8.fallback import lamb8_stage1

        p, u = lamb8_stage1((params, grads, exp_avgs, exp_avg_sqs), hp, flag, **modes)
        sums[0] = torch.stack(torch._foreach_norm(p)).to(F64).square()
        sums[1] = torch.stack(torch._foreach_norm(u)).to(F64).square()
        return hp, flag.reshape(()) != 0, p, list(exp_avgs), list(exp_avg_sqs), u, sums
    skip = fb_step._skip(flag, None)
    if skip is True:
        return hp, skip, None, None, None, None, sums
    scalars = hp.tolist()[1:] if skip is False else hp.unbind()[1:]
    p = [t.to(hp.dtype) for t in params]  # may alias the params: only out-of-place ops on it here
    m, v, u = fb_lamb.lamb_direction(
        p, (grads, exp_avgs, exp_avg_sqs), scalars, (modes["l2_mode"], modes["decoupled"]), in_place=skip is False
    )
    sums[0] = torch.stack(torch._foreach_norm(p)).to(F64).square()
    sums[1] = torch.stack(torch._foreach_norm(u)).to(F64).square()
    return hp, skip, p, m, v, u, sums


def _torch_stage2(
    staged: LambStaged, g: _plan.Group, state: tuple, sums: torch.Tensor, flag: torch.Tensor, trust: bool
) -> None:
    """``p - ratio u`` with the completed norms; p and model copies written (masked off the CPU, with m, v)."""
    params, _, exp_avgs, exp_avg_sqs, models = _lists(staged, g)
    hp, skip, p, m, v, u, _ = state
    if skip is True:
        return
    lr = hp[0]
    if trust:
        pn, un = sums[0].to(hp.dtype).sqrt(), sums[1].to(hp.dtype).sqrt()
        torch._foreach_mul_(u, list(torch.where((pn != 0) & (un != 0), lr * (pn / un), lr).unbind()))
    else:
        torch._foreach_mul_(u, lr)
    if staged.weights is not None:
        _torch_stage2_bf16(staged.weights, g, params, exp_avgs, exp_avg_sqs, models, p, m, v, u, skip)
    elif skip is False:
        torch._foreach_sub_(p, u)
        fb_step._write_params(params, models, p, False)
    else:
        fb_step._finish(params, exp_avgs, exp_avg_sqs, models, p, m, v, u, skip)


def _torch_stage2_bf16(
    weights: Bf16Weights, g: _plan.Group, params: list, exp_avgs: list, exp_avg_sqs: list, models: list, p: list,
    m: list, v: list, u: list, skip: bool | torch.Tensor,
) -> None:
    """Stage 2's writes with the bf16 epilogue: ``p - u`` (fp32) written into the bf16 params by
    ``_bf16_weights.write_back`` (split halves, or stochastic rounding keyed by each row's position ``g.idx`` in the
    call), fp32 params directly; masked with the moments when ``skip`` is a device flag."""
    mine = _bf16_weights.epilogue_rows(weights, params, models)
    if skip is False:
        torch._foreach_sub_(p, u)
        new = p
    else:
        new = torch._foreach_sub(p, u)
        fb_step._commit(exp_avgs, m, skip)
        fb_step._commit(exp_avg_sqs, v, skip)
    written = set(mine)
    plain = [i for i in range(len(params)) if i not in written and params[i] is not new[i]]
    fb_step._commit([params[i] for i in plain], [new[i] for i in plain], skip)
    _bf16_weights.write_back(weights, params, models, new, mine, g.idx, skip)


# ---------------------------------------------------------------------------------------------------------------
# apex's SGD, Adagrad and NovoGrad


def _kernel_hps(plan: _plan.Plan, hp64: torch.Tensor | DeviceStep) -> list[tuple[_plan.Group, Any]]:
    """Each kernel group with what its launch gets: the float32 vector, or the :class:`DeviceStep` (the last group's
    launch advances the counter). A device step takes no fallback rows (the caller planned with ``plan_only``)."""
    if not isinstance(hp64, DeviceStep):
        hp32 = hp64.float()
        return [(g, hp32) for g in plan.kernel]
    if plan.rest:
        raise RuntimeError("a device step got rows outside the Triton kernels; plan with plan_only=True first")
    last = len(plan.kernel) - 1
    return [(g, dataclasses.replace(hp64, advance=i == last) if last else hp64) for i, g in enumerate(plan.kernel)]



def _apex_rows(
    g: _plan.Group, lists: tuple, models: Sequence[torch.Tensor | None] | None, with_models: bool, *, kernel: bool
) -> ApexRows:
    """One plan group's rows of an SGD, Adagrad or NovoGrad call (``lists``: params, grads, then the state lists, as
    planned) as the bundle its launcher (``kernel``: the model copies None when the group has none) or its torch
    twin takes (``engine/rows.py``)."""
    p, grads, *states = (g.pick(x) for x in lists)
    chosen = _models_of(g, models, with_models, len(p))
    return p, grads, tuple(states), _kernel_models(chosen) if kernel else chosen


def _eager_under_compile(fn: Any) -> Any:
    """Run ``fn`` eagerly when Dynamo traces a call to it (one graph break), directly otherwise.

    apex's SGD, Adagrad and NovoGrad passes have no dispatcher op (``library.py`` holds LAMB's and Adam's): their
    launchers read ``data_ptr()`` and write through address tables (``engine/table.py``) that no graph can hold, so a
    compiled step runs them as the eager step does, with the same arguments and the eager bits, instead of Dynamo
    tracing their planning piecewise (a graph break per table, a recompile per flag). (Under ``TRITON_INTERPRET=1``
    the interpreter's launches are kept out of Dynamo as well: ``backend.py``.)"""
    eager = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return eager(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)

    return call


#: The bf16 weight modes' LAMB and Adam updates (``weights``) have no dispatcher op either (``library.py`` holds the
#: fp32 and fp32-master ones): a compiled function calling these public ops runs them eagerly as one graph break, with
#: the eager bits (traced, their planning broke one split-mode step into ~200 frames, past Dynamo's recompile limit).
#: The optimizers' compiled step does not reach them: it runs a bf16-mode step eagerly as a whole
#: (``FusedOptimizer._steps_eagerly_under_compile``, fp16kit/optim/_base.py).
_bf16_weights_update = _eager_under_compile(_lamb_or_adam)


@_eager_under_compile
def sgd_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor] | None,
    models: Sequence[torch.Tensor | None],
    hp64: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    *,
    first_run: Sequence[bool],
    weight_decay: bool,
    wd_after_momentum: bool,
    nesterov: bool,
    verify: bool = False,
    check: StepVerify | None = None,
    plan_only: bool = False,
) -> bool | None:
    """apex's SGD for one group (``triton/sgd.py``: ``hp64 = [lr, momentum, 1 - dampening, wd, inv_scale]``);
    ``momentum_buffers`` None for plain SGD; ``first_run[i]``: the buffer's first use (``m = g``). No-op on the
    device when ``found_inf`` is set. ``verify=True``: the result check instead (``engine/results.py``), which writes
    nothing but raises ``found_inf`` when the step would store an inf/NaN.

    Device step (docs/optim.md, "The step on the device"): ``hp64`` a :class:`DeviceStep` (every row in a kernel
    group: see ``plan_only``), ``verify`` then also the check pass, finished into ``check``; the last update launch
    advances the step counter. ``plan_only``: plan, run nothing, and return whether the kernels take every row."""
    if not params:
        return False if plan_only else None
    bufs = momentum_buffers
    lists = (params, grads) if bufs is None else (params, grads, bufs)
    names = ("params", "grads") if bufs is None else ("params", "grads", "momentum_buffers")
    plan, with_models = _rows("sgd_update", names, () if bufs is None else (2,), lists, models, tuple(first_run))
    if plan_only:
        return not plan.rest
    flag = found_inf.reshape(1)
    modes = {"weight_decay": weight_decay, "wd_after_momentum": wd_after_momentum, "nesterov": nesterov,
             "verify": verify}
    if plan.kernel:
        from .triton.sgd import launch_sgd

        for g, hp in _kernel_hps(plan, hp64):
            with playing(g.tape):
                launch_sgd(_apex_rows(g, lists, models, with_models, kernel=True), hp, flag,
                           first_run=first_run[g.idx[0]], check=check, **modes)
    for g in plan.rest:
        rows = _apex_rows(g, lists, models, with_models, kernel=False)
        hp = hp64 if rows[0][0].dtype == F64 else hp64.float()
        fb_sgd.sgd_(rows, hp, flag, first_run=first_run[g.idx[0]], **modes)


@_eager_under_compile
def adagrad_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    sums: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp64: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    verify: bool = False,
    check: StepVerify | None = None,
    plan_only: bool = False,
) -> bool | None:
    """apex's Adagrad for one group (``triton/adagrad.py``: ``hp64 = [lr, eps, wd, inv_scale]``). No-op on the
    device when ``found_inf`` is set; ``verify=True``: the result check instead; a :class:`DeviceStep`, ``check``
    and ``plan_only`` as in :func:`sgd_update`."""
    if not params:
        return False if plan_only else None
    lists = (params, grads, sums)
    plan, with_models = _rows("adagrad_update", ("params", "grads", "sums"), (2,), lists, models)
    if plan_only:
        return not plan.rest
    flag = found_inf.reshape(1)
    modes = {"l2_mode": l2_mode, "decoupled": decoupled, "verify": verify}
    if plan.kernel:
        from .triton.adagrad import launch_adagrad

        for g, hp in _kernel_hps(plan, hp64):
            with playing(g.tape):
                launch_adagrad(_apex_rows(g, lists, models, with_models, kernel=True), hp, flag, check=check, **modes)
    for g in plan.rest:
        rows = _apex_rows(g, lists, models, with_models, kernel=False)
        hp = hp64 if rows[0][0].dtype == F64 else hp64.float()
        fb_adagrad.adagrad_(rows, hp, flag, **modes)


@_eager_under_compile
def novograd_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp64: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    *,
    new: Sequence[bool],
    beta2: float,
    eps: float,
    bc2_sqrt: torch.Tensor | None,
    norm_type: int,
    init_zero: bool,
    reg_inside_moment: bool,
    verify: bool = False,
    check: StepVerify | None = None,
    plan_only: bool = False,
) -> bool | None:
    """apex's NovoGrad for one group (``triton/novograd.py``: ``hp64 = [lr, b1, beta3, wd, bc1, inv_scale]``).

    Per param, with ``n`` the norm (``norm_type`` 2: L2, 0: max) of its unscaled gradient and ``v`` its
    one-element second moment (``exp_avg_sqs[i]``)::

        v = n              on its first step taken (``new[i]``, or ``v`` is -0.0) unless ``init_zero``
        v = sqrt(b2 v^2 + (1 - b2) n^2)  (L2)   or   b2 v + (1 - b2) n  (max norm)
        denom = v / bc2_sqrt + eps;  then the moment/param update of the kernel with that denominator

    ``v`` is committed only for a step that is taken (``found_inf`` clear): a skipped step leaves it bit for bit,
    so a moment created as -0.0 ("not initialised", fp16kit/optim/novograd.py) is initialised by the first step
    that is not skipped. ``verify=True``: the result check instead (see :func:`sgd_update`; an inf ``v`` counts).

    Device step (the L2 norm, no state created this step): ``hp64`` a :class:`DeviceStep` whose host numbers hold
    ``beta2``, ``one_minus_beta2`` and ``eps`` too; the norms, the blend of ``v`` and the denominators are computed
    on the device by the ``verify`` launches (``novograd_kernel.launch_novograd``), ``v`` committed by the update.
    ``check`` and ``plan_only`` as in :func:`sgd_update`.
    """
    if not params:
        return False if plan_only else None
    device = params[0].device
    lists = (params, grads, exp_avgs)
    plan, with_models = _rows("novograd_update", ("params", "grads", "exp_avgs"), (2,), lists, models)
    if plan_only:
        return not plan.rest
    flag = found_inf.reshape(1)
    if isinstance(hp64, DeviceStep):
        from .triton.novograd import launch_novograd

        for g, hp in _kernel_hps(plan, hp64):
            with playing(g.tape):
                launch_novograd(_apex_rows(g, lists, models, with_models, kernel=True), hp, None, flag,
                                reg_inside_moment=reg_inside_moment, verify=verify,
                                exp_avg_sqs=g.pick(exp_avg_sqs), init_zero=init_zero, check=check)
        return None
    for kernel, g in [(True, g) for g in plan.kernel] + [(False, g) for g in plan.rest]:
        rows = _apex_rows(g, lists, models, with_models, kernel=kernel)
        math = F64 if rows[0][0].dtype == F64 else torch.float32
        gs = rows[1]
        n = _novograd_norms(gs, norm_type, hp64[5:6], kernel, g)
        vs = g.pick(exp_avg_sqs)
        v_old = torch.cat(vs).to(F64)
        fresh = torch.signbit(v_old)  # -0.0: no step taken yet
        if any(new[i] for i in g.idx):
            fresh = fresh | torch.tensor([new[i] for i in g.idx], device=device)
        start = torch.where(fresh, torch.zeros_like(n) if init_zero else n, v_old)
        v = (beta2 * start * start + (1.0 - beta2) * n * n).sqrt() if norm_type == 2 else beta2 * start + (
            1.0 - beta2) * n
        v = v.to(math)
        denoms = v.to(F64) / bc2_sqrt + eps
        if verify:
            fb_apex_step.raise_if_nonfinite([(v, math)], hp64[0], flag)
        else:
            torch._foreach_copy_(vs, list(torch.where(flag != 0, v_old.to(math), v).split(1)))
        if kernel:
            from .triton.novograd import launch_novograd

            with playing(g.tape):
                launch_novograd(rows, hp64.float(), denoms.float(), flag, reg_inside_moment=reg_inside_moment,
                                verify=verify)
        else:
            fb_novograd.novograd_(rows, hp64.to(math), denoms.to(math), flag, reg_inside_moment=reg_inside_moment,
                                  verify=verify)


def _novograd_norms(
    grads: list[torch.Tensor], norm_type: int, inv64: torch.Tensor, kernel: bool, g: _plan.Group
) -> torch.Tensor:
    """Per-tensor norms of the unscaled grads (one multi-tensor pass), as a float64 [N] vector."""
    if not kernel:
        return fb_novograd.per_tensor_norms(grads, norm_type, inv64, F64)
    if norm_type == 2:
        return l2norm(grads, per_tensor=True, pre_scale=inv64.float())[1].to(F64)
    from .triton.novograd import absmax_per_tensor

    return absmax_per_tensor(grads, inv64.float()).to(F64)
