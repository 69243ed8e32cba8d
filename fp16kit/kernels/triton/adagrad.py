"""Triton kernel and launcher: one Adagrad pass over many tensors (apex ``FusedAdagrad`` math).

Address-table rows: ``0`` params (the fp32 master in master-weights mode), ``1`` grads, ``2`` sum of
squared gradients (fp32), ``3`` model copy (row 0 again when there is none; never written then).

Hyper-parameters come from ``hp``, a float32 device tensor (built by ``fp16kit.optim.adagrad``)::

    hp = [lr, eps, weight_decay, inv_scale]

Per element (fp32 math, each tensor read once and written once)::

    g = g * inv_scale
    if L2_MODE:     g = g + wd * p                       # adagrad_w_mode=False: L2 penalty in the gradient
    h = h + g * g
    u = g / (sqrt(h) + eps)
    if DECOUPLED:   u = u + wd * p                       # adagrad_w_mode=True: decoupled decay
    p = p + (-lr) * u

``found_inf`` non-zero: zero loop iterations, nothing written. ``VERIFY``: the same math, nothing stored;
``found_inf`` raised when a stored value (rounded param, model copy, sum) would be inf/NaN (``engine/results.py``:
``g * g`` overflows fp32 for |g| > 1.8e19). Divisions and square roots are the
IEEE-rounded ``div_rn``/``sqrt_rn`` (plain ``/`` and ``sqrt`` are approximate on NVIDIA GPUs).
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
    # _adagrad_kernel: each operation rounded as in the torch fallback.
    "_adagrad_kernel": {"num_warps": 16, "enable_fp_fusion": False},
}


#: The host numbers of a device step, in the order of the step bundle and of ``hp`` (``skeleton.hp_value``).
HOST = ("lr", "eps", "weight_decay")


@triton.jit
def _adagrad_kernel(
    table,
    hp_ptr,
    found_inf_ptr,
    step,
    results,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    L2_MODE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    VERIFY: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr = HOST_VECTOR,
):
    """Bundles (``engine/skeleton.py``): ``table``, ``step`` (host numbers :data:`HOST`), ``results`` (the result
    check's pointers, ``_results.step_arguments``); ``STEP`` the step's switches (``_step_scalars.StepFlags``)."""
    pid = tl.program_id(0)
    # hp = [lr, eps, weight_decay, inv_scale], or the same values derived on the device
    neg_lr = hp_neg_lr(hp_ptr, step, STEP)
    eps = hp_value(hp_ptr, step, 1, STEP)
    wd = hp_value(hp_ptr, step, 2, STEP)
    inv_scale = hp_inv_scale(hp_ptr, 3, step, STEP)
    entry, skip, stop, bad, gbad = pass_start(found_inf_ptr, table[5], BLOCK, VERIFY, STEP)
    for c in range(pid, stop, tl.num_programs(0)):
        span, p_ptr, h_ptr, p, g, gbad = chunk_start(table, c, inv_scale, gbad, P_DTYPE, G_DTYPE, BLOCK, ALIGNED,
                                                     VERIFY, STEP)
        h = load_span(h_ptr, span)
        if L2_MODE:
            g = g + wd * p
        h = h + g * g
        u = tl.div_rn(g, tl.sqrt_rn(h) + eps)
        if DECOUPLED:
            u = u + wd * p
        p = p + neg_lr * u
        bad = chunk_end(table, span, p, h, p_ptr, h_ptr, bad, P_DTYPE, MODEL_DTYPE, True, HAS_MODEL, ALIGNED, VERIFY)
    pass_end(found_inf_ptr, step, results, gbad, bad, neg_lr, entry, skip, VERIFY, STEP)


def launch_adagrad(
    rows: ApexRows,
    hp: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    verify: bool = False,
    check: StepVerify | None = None,
) -> None:
    """One Adagrad launch over ``rows`` (``engine/rows.py``; ``models`` None without model copies) for contiguous,
    non-empty tensors of one dtype combination (the state: fp32 sums). ``verify``:
    the result check (``engine/results.py``), nothing written but ``found_inf``. ``hp``: the float32 vector of the
    module docstring, or a :class:`DeviceStep` (host numbers ``lr``, ``eps``, ``weight_decay``; see
    ``sgd_kernel.launch_sgd``)."""
    table, row_consts = apex_rows(rows)
    device = rows[0][0].device
    hp_ptr, step, results, flags = step_arguments(hp, table, HOST, verify, check)
    _adagrad_kernel[(num_programs(device, table.num_chunks),)](
        table.leading_args(),
        hp_ptr,
        found_inf,
        step,
        results,
        **row_consts,
        L2_MODE=l2_mode,
        DECOUPLED=decoupled,
        VERIFY=verify,
        **flags,
        **LAUNCH["_adagrad_kernel"],
    )
