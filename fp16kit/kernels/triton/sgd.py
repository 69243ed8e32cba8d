"""Triton kernel and launcher: one SGD pass over many tensors (apex ``FusedSGD`` math, ``torch.optim.SGD`` order).

Address-table rows: ``0`` params (the fp32 master in master-weights mode), ``1`` grads, ``2`` momentum
buffers (fp32; row 0 again when ``MOMENTUM`` is off, never read then), ``3`` model copy (row 0 again when
there is none; never written then).

Hyper-parameters come from ``hp``, a float32 device tensor (built by ``fp16kit.optim.sgd``)::

    hp = [lr, momentum, 1 - dampening, weight_decay, inv_scale]

Per element (fp32 math, each tensor read once and written once)::

    g = g * inv_scale
    if WD and not WD_AFTER:   g = g + wd * p
    if MOMENTUM:
        m = g                                       if FIRST_RUN (apex/torch: buffer = grad on first use)
        m = m * momentum + (1 - dampening) * g      otherwise
        g = g + momentum * m                        if NESTEROV, else g = m
    if WD and WD_AFTER:       g = g + wd * p        # apex's wd_after_momentum
    p = p + (-lr) * g

``found_inf`` non-zero: zero loop iterations, nothing written. ``VERIFY``: the same math, nothing stored;
``found_inf`` raised when a stored value (the rounded param, the model copy, the buffer) would be inf/NaN
(``engine/results.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..engine.results import StepVerify, apex_rows, chunk_end, chunk_start, pass_end, pass_start, step_arguments
from ..engine.rows import ApexRows
from ..engine.skeleton import hp_inv_scale, hp_neg_lr, hp_value, load_span
from ..engine.step_scalars import HOST_VECTOR, DeviceStep
from ..engine.table import num_programs

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _sgd_kernel: each operation rounded as in ``torch.optim.SGD`` and the torch fallback.
    "_sgd_kernel": {"num_warps": 16, "enable_fp_fusion": False},
}


#: The host numbers of a device step, in the order of the step bundle and of ``hp`` (``skeleton.hp_value``).
HOST = ("lr", "momentum", "one_minus_dampening", "weight_decay")


@triton.jit
def _sgd_kernel(
    table,
    hp_ptr,
    found_inf_ptr,
    step,
    results,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    WD: tl.constexpr,
    WD_AFTER: tl.constexpr,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    FIRST_RUN: tl.constexpr,
    VERIFY: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr = HOST_VECTOR,
):
    """Bundles (``engine/skeleton.py``): ``table``, ``step`` (host numbers :data:`HOST`), ``results`` (the result
    check's pointers, ``_results.step_arguments``); ``STEP`` the step's switches (``_step_scalars.StepFlags``)."""
    pid = tl.program_id(0)
    # hp = [lr, momentum, 1 - dampening, weight_decay, inv_scale], or the same values derived on the device
    neg_lr = hp_neg_lr(hp_ptr, step, STEP)
    momentum = hp_value(hp_ptr, step, 1, STEP)
    one_minus_dampening = hp_value(hp_ptr, step, 2, STEP)
    wd = hp_value(hp_ptr, step, 3, STEP)
    inv_scale = hp_inv_scale(hp_ptr, 4, step, STEP)
    entry, skip, stop, bad, gbad = pass_start(found_inf_ptr, table[5], BLOCK, VERIFY, STEP)
    for c in range(pid, stop, tl.num_programs(0)):
        span, p_ptr, m_ptr, p, g, gbad = chunk_start(table, c, inv_scale, gbad, P_DTYPE, G_DTYPE, BLOCK, ALIGNED,
                                                     VERIFY, STEP)
        if WD and not WD_AFTER:
            g = g + wd * p
        if MOMENTUM:
            if FIRST_RUN:  # noqa: SIM108  (a compile-time branch: the buffer is not even loaded)
                m = g
            else:
                m = load_span(m_ptr, span) * momentum + one_minus_dampening * g
            if NESTEROV:  # noqa: SIM108  (a compile-time branch)
                g = g + momentum * m
            else:
                g = m
        else:  # no buffer (row 2 is row 0 again): a placeholder for check_or_store, which ignores it (HAS_STATE off)
            m = g
        if WD and WD_AFTER:
            g = g + wd * p
        p = p + neg_lr * g
        bad = chunk_end(table, span, p, m, p_ptr, m_ptr, bad, P_DTYPE, MODEL_DTYPE, MOMENTUM, HAS_MODEL, ALIGNED,
                        VERIFY)
    pass_end(found_inf_ptr, step, results, gbad, bad, neg_lr, entry, skip, VERIFY, STEP)


def launch_sgd(
    rows: ApexRows,
    hp: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    *,
    weight_decay: bool,
    wd_after_momentum: bool,
    nesterov: bool,
    first_run: bool,
    verify: bool = False,
    check: StepVerify | None = None,
) -> None:
    """One SGD launch over ``rows`` (``engine/rows.py``; ``models`` None without model copies) for contiguous,
    non-empty tensors of one dtype combination (the state: fp32 momentum buffers, or none for plain SGD without
    momentum). ``verify``: the result check (``engine/results.py``), nothing written
    but ``found_inf``.

    ``hp``: the float32 vector of the module docstring, or a :class:`DeviceStep` (host numbers ``lr``, ``momentum``,
    ``one_minus_dampening``, ``weight_decay`` as launch arguments, a tensor ``lr`` and the loss scale read on the
    device; the launch that is not ``verify`` advances the step counter). With a ``DeviceStep``, ``verify`` is the
    step's check pass as well, finished on the device into ``check`` (``_results.finish_check_and_verify``)."""
    table, row_consts = apex_rows(rows)
    device = rows[0][0].device
    hp_ptr, step, results, flags = step_arguments(hp, table, HOST, verify, check)
    _sgd_kernel[(num_programs(device, table.num_chunks),)](
        table.leading_args(),
        hp_ptr,
        found_inf,
        step,
        results,
        **row_consts,
        WD=weight_decay,
        WD_AFTER=wd_after_momentum,
        MOMENTUM=bool(rows[2]),
        NESTEROV=nesterov,
        FIRST_RUN=first_run,
        VERIFY=verify,
        **flags,
        **LAUNCH["_sgd_kernel"],
    )
