"""Triton kernels and launchers for NovoGrad (apex ``FusedNovoGrad`` math): per-tensor inf-norms of the
gradients, and the elementwise update with a per-tensor (per-layer) second moment.

Per-tensor norms. The L2 norm reuses ``fp16kit.kernels.l2norm(per_tensor=True)``; the inf-norm (apex's
``norm_type=0``) is ``_absmax_kernel`` here: one fp32 partial ``max |g * pre_scale|`` per chunk, reduced
per tensor by ``absmax_per_tensor`` (max is exact and order-free, so the result is deterministic).
A NaN anywhere in a tensor makes its partial NaN (``tl.maximum`` propagates NaN).

Update. Address-table rows: ``0`` params (the fp32 master in master-weights mode), ``1`` grads, ``2``
exp_avg (fp32), ``3`` model copy (row 0 again when there is none; never written then). ``denoms[t]`` is
tensor ``t``'s ``v_t / bc2 + eps`` (computed on the device from the blended per-tensor norm ``v_t``), and
``hp`` a float32 device tensor (built by ``fp16kit.optim.novograd``)::

    hp = [lr, beta1, beta3, weight_decay, bc1, inv_scale]

Per element (fp32 math)::

    g = g * inv_scale
    if REG_INSIDE (apex moment_mode 0):   g = g / denom + wd * p;  m = beta1 m + beta3 g;  u = m / bc1
    else          (moment_mode 1):        m = beta1 m + beta3 g;   u = (m / bc1) / denom + wd * p
    p = p + (-lr) * u

``found_inf`` non-zero: zero loop iterations, nothing written. ``VERIFY``: the same math, nothing stored;
``found_inf`` raised when a stored value (rounded param, model copy, exp_avg) would be inf/NaN
(``engine/results.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..engine.chunks import chunk_span, load_chunk, row_pointer
from ..engine.results import (
    StepVerify,
    apex_rows,
    check_grad,
    chunk_end,
    lr_arms,
    nonfinite,
    pass_end,
    pass_start,
    step_arguments,
)
from ..engine.rounding import to_fp32
from ..engine.rows import ApexRows
from ..engine.skeleton import chunk_rows_one_state, hp_inv_scale, hp_neg_lr, hp_value, load_param_grad, load_span
from ..engine.step_scalars import (
    HOST_VECTOR,
    DeviceStep,
    bias_correction64,
    join3,
    lr64,
    next_step,
    split3_cached,
    step_host64,
    step_number,
)
from ..engine.table import STEP_PROGRAMS_PER_SM, chunk_table, num_programs, step_block, triton_dtype
from . import l2norm as l2norm_kernel
from .l2norm import segment_total

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _absmax_kernel: a max, no multiply-add.
    "_absmax_kernel": {"num_warps": 16, "enable_fp_fusion": False},
    # _novograd_kernel: each operation rounded as in the torch fallback.
    "_novograd_kernel": {"num_warps": 16, "enable_fp_fusion": False},
    # _novograd_prepare_kernel: float64 products and sums rounded one by one, as the torch blend.
    "_novograd_prepare_kernel": {"num_warps": 4, "enable_fp_fusion": False},
}


@triton.jit
def _absmax_kernel(
    ptrs,
    numels,
    chunk_tensor,
    chunk_start,
    num_chunks,
    pre_scale_ptr,
    partials_ptr,
    IN_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    pre_scale = tl.load(pre_scale_ptr).to(tl.float32)
    for c in range(pid, num_chunks, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        src = row_pointer(ptrs, 0, 0, t, IN_DTYPE, ALIGNED)
        x = tl.abs(to_fp32(load_chunk(src, offs, mask, full)) * pre_scale)
        # NaN-propagating max: |NaN| compares false, so pick it explicitly.
        nan = tl.max(tl.where(x != x, 1, 0), axis=0)
        part = tl.max(tl.where(mask, x, 0.0), axis=0)
        tl.store(partials_ptr + c, tl.where(nan > 0, float("nan"), part))


def absmax_per_tensor(tensors: Sequence[torch.Tensor], pre_scale: torch.Tensor) -> torch.Tensor:
    """``max |x * pre_scale|`` of each tensor (fp32 [N]; NaN for a tensor holding a NaN), one launch for
    contiguous, non-empty tensors of one dtype."""
    table = chunk_table([tensors])
    device = tensors[0].device
    partials = torch.empty(table.num_chunks, dtype=torch.float32, device=device)
    _absmax_kernel[(num_programs(device, table.num_chunks),)](
        table.ptrs,
        table.numels,
        table.chunk_tensor,
        table.chunk_start,
        table.num_chunks,
        pre_scale,
        partials,
        IN_DTYPE=triton_dtype(tensors[0].dtype),
        BLOCK=table.block,
        ALIGNED=table.aligned,
        **LAUNCH["_absmax_kernel"],
    )
    # Chunks of a tensor are adjacent in the table: a segmented max over the per-chunk partials.
    return torch.segment_reduce(partials, "max", lengths=table.chunk_counts)


#: The host numbers of the update's device step, in the order of the step bundle and of ``hp``
#: (``skeleton.hp_value``).
HOST = ("lr", "beta1", "beta3", "weight_decay")


@triton.jit
def _novograd_kernel(
    table,
    hp_ptr,
    denoms_ptr,
    found_inf_ptr,
    step,
    results,
    v_ptrs,
    v_new_ptr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    REG_INSIDE: tl.constexpr,
    VERIFY: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr = HOST_VECTOR,
):
    """Bundles (``engine/skeleton.py``): ``table``, ``step`` (host numbers :data:`HOST`), ``results`` (the result
    check's pointers, ``_results.step_arguments``); ``STEP`` the step's switches (``_step_scalars.StepFlags``)."""
    pid = tl.program_id(0)
    # hp = [lr, beta1, beta3, weight_decay, bc1, inv_scale], or the same values derived on the device
    neg_lr = hp_neg_lr(hp_ptr, step, STEP)
    beta1 = hp_value(hp_ptr, step, 1, STEP)
    beta3 = hp_value(hp_ptr, step, 2, STEP)
    wd = hp_value(hp_ptr, step, 3, STEP)
    if STEP.HP_DEVICE:  # bc1 = 1 - beta1^t from the device step counter, in float64, rounded once
        bc1 = bias_correction64(step_host64(step, 1), step_number(step), STEP.BIAS_CORRECTION).to(tl.float32)
    else:
        bc1 = tl.load(hp_ptr + 4).to(tl.float32)
    inv_scale = hp_inv_scale(hp_ptr, 5, step, STEP)
    entry, skip, stop, bad, gbad = pass_start(found_inf_ptr, table[5], BLOCK, VERIFY, STEP)
    for c in range(pid, stop, tl.num_programs(0)):
        # (not _results.chunk_start: the denominator is loaded between the rows' addresses and their data)
        span, p_ptr, g_ptr, m_ptr = chunk_rows_one_state(table, c, P_DTYPE, G_DTYPE, BLOCK, ALIGNED)
        t = span[0]
        denom = tl.load(denoms_ptr + t).to(tl.float32)
        p, g = load_param_grad(p_ptr, g_ptr, span, inv_scale)
        gbad = check_grad(gbad, g, span, VERIFY, STEP)
        if STEP.HP_DEVICE and not VERIFY:  # noqa: SIM102  (a compile-time branch around a runtime one)
            # the tensor's new second moment (from _novograd_prepare_kernel), committed by its first chunk's program
            if tl.load(table[4] + c) == 0:
                tl.store(tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32)), tl.load(v_new_ptr + t))
        m = load_span(m_ptr, span)
        if REG_INSIDE:
            g = tl.div_rn(g, denom) + wd * p
            m = beta1 * m + beta3 * g
            u = tl.div_rn(m, bc1)
        else:
            m = beta1 * m + beta3 * g
            u = tl.div_rn(tl.div_rn(m, bc1), denom) + wd * p
        p = p + neg_lr * u
        bad = chunk_end(table, span, p, m, p_ptr, m_ptr, bad, P_DTYPE, MODEL_DTYPE, True, HAS_MODEL, ALIGNED, VERIFY)
    pass_end(found_inf_ptr, step, results, gbad, bad, neg_lr, entry, skip, VERIFY, STEP)


@triton.jit
def _novograd_prepare_kernel(
    partials_ptr,
    first_chunk,
    chunk_counts,
    num_tensors,
    v_ptrs,
    v_new_ptr,
    denoms_ptr,
    bad_ptr,
    step_ptr,
    lr_ptr,
    lr_hi, lr_mid, lr_lo,
    b2_hi, b2_mid, b2_lo,
    omb2_hi, omb2_mid, omb2_lo,
    eps_hi, eps_mid, eps_lo,
    LR_TENSOR: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    INIT_ZERO: tl.constexpr,
):
    """Per tensor ``t`` (``novograd_update``'s float64 blend, on the device): its L2 norm ``n`` from the chunk
    partials of ``_sumsq_kernel`` (summed as ``l2norm`` sums them, rounded to fp32 as ``l2norm`` returns it), the new
    second moment ``v = sqrt(b2 s^2 + (1 - b2) n^2)`` with ``s`` the stored ``v`` (or ``n``, 0 with ``INIT_ZERO``,
    while it is -0.0: no step taken yet), rounded to fp32, into ``v_new[t]``, and ``denoms[t] = v / sqrt(bc2) + eps``
    (fp32). A non-finite ``v`` raises the result check's lane ``bad_ptr[1]`` (with a valid ``lr``)."""
    pid = tl.program_id(0)
    b2 = join3(b2_hi, b2_mid, b2_lo)
    one_minus_b2 = join3(omb2_hi, omb2_mid, omb2_lo)
    eps = join3(eps_hi, eps_mid, eps_lo)
    bc2_sqrt = tl.sqrt(bias_correction64(b2, next_step(step_ptr), BIAS_CORRECTION))
    armed = lr_arms(-lr64(lr_hi, lr_mid, lr_lo, lr_ptr, LR_TENSOR).to(tl.float32))
    bad = tl.zeros((), dtype=tl.int32)
    for t in range(pid, num_tensors, tl.num_programs(0)):
        total = segment_total(partials_ptr, tl.load(first_chunk + t), tl.load(chunk_counts + t))
        n = tl.sqrt(total).to(tl.float32).to(tl.float64)  # (float64 sqrt is IEEE-rounded: sqrt.rn.f64)
        old = tl.load(tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32)))
        fresh = old.to(tl.int32, bitcast=True) < 0  # -0.0 (or a negative value, refused at load): not yet set
        if INIT_ZERO:  # noqa: SIM108  (a compile-time branch)
            start = tl.where(fresh, 0.0, old.to(tl.float64))
        else:
            start = tl.where(fresh, n, old.to(tl.float64))
        v = tl.sqrt(b2 * start * start + one_minus_b2 * n * n).to(tl.float32)
        tl.store(v_new_ptr + t, v)
        tl.store(denoms_ptr + t, (v.to(tl.float64) / bc2_sqrt + eps).to(tl.float32))
        bad = tl.maximum(bad, nonfinite(v).to(tl.int32))
    tl.atomic_max(bad_ptr + 1, bad * armed)


def launch_novograd(
    rows: ApexRows,
    hp: torch.Tensor | DeviceStep,
    denoms: torch.Tensor | None,
    found_inf: torch.Tensor,
    *,
    reg_inside_moment: bool,
    verify: bool = False,
    exp_avg_sqs: Sequence[torch.Tensor] | None = None,
    init_zero: bool = False,
    check: StepVerify | None = None,
) -> None:
    """One NovoGrad launch over ``rows`` (``engine/rows.py``; ``models`` None without model copies) for contiguous,
    non-empty tensors of one dtype combination (the state: fp32 exp_avg); ``denoms`` is the fp32 [N] vector of
    per-tensor denominators, in the order of the params. ``verify``: the
    result check (``engine/results.py``), nothing written but ``found_inf``.

    ``hp`` a :class:`DeviceStep` (host numbers ``lr``, ``beta1``, ``beta3``, ``weight_decay``, ``beta2``,
    ``one_minus_beta2``, ``eps``; the L2 norm only): ``denoms`` is None and ``exp_avg_sqs`` the per-tensor second
    moments (fp32 ``[1]`` each). ``verify`` then runs the norms' partials (``_sumsq_kernel``), the per-tensor blend
    (``_novograd_prepare_kernel``: new moments and denominators into the table's scratch) and the check-and-verify
    launch; the update launch commits the new moments with the step, advancing the counter."""
    table, row_consts = apex_rows(rows)
    params, grads = rows[0], rows[1]
    device = params[0].device
    device_step = isinstance(hp, DeviceStep)
    if device_step:
        if exp_avg_sqs is None:
            raise RuntimeError("a NovoGrad device step needs the per-tensor second moments")
        v_table = chunk_table([exp_avg_sqs], written=(0,))
        v_ptrs, v_new = v_table.ptrs, table.scratch_buffer("novograd_v", table.num_tensors, torch.float32)
        denoms = table.scratch_buffer("novograd_denoms", table.num_tensors, torch.float32)
        if verify:
            _novograd_prepare(table, grads, hp, v_ptrs, v_new, denoms, init_zero)
    else:
        v_ptrs = v_new = denoms
    hp_ptr, step, results, flags = step_arguments(hp, table, HOST, verify, check)
    _novograd_kernel[(num_programs(device, table.num_chunks),)](
        table.leading_args(),
        hp_ptr,
        denoms,
        found_inf,
        step,
        results,
        v_ptrs,
        v_new,
        **row_consts,
        REG_INSIDE=reg_inside_moment,
        VERIFY=verify,
        **flags,
        **LAUNCH["_novograd_kernel"],
    )


def _novograd_prepare(table, grads: Sequence[torch.Tensor], hp: DeviceStep, v_ptrs: torch.Tensor,
                      v_new: torch.Tensor, denoms: torch.Tensor, init_zero: bool) -> None:
    """The per-tensor L2 norms of the unscaled grads (``_sumsq_kernel``'s chunk partials over the table ``l2norm``
    uses, with the same unscale factor), then ``_novograd_prepare_kernel``; the result-check lane it raises is the
    check-and-verify launch's (``table``'s ``verify_bad``)."""
    device = grads[0].device
    g_table = chunk_table([grads], step_block(device))
    partials = g_table.scratch_buffer("novograd_partials", g_table.num_chunks, torch.float64)
    if hp.scale is None:  # unscale by 1: a constant of the table, filled once
        scale = g_table.scratch.get("one")
        if scale is None:
            scale = g_table.scratch["one"] = torch.ones(1, dtype=torch.float32, device=device)
    else:
        scale = hp.scale
    l2norm_kernel._sumsq_kernel[(num_programs(device, g_table.num_chunks, STEP_PROGRAMS_PER_SM),)](
        g_table.ptrs, g_table.numels, g_table.chunk_tensor, g_table.chunk_start, g_table.num_chunks,
        scale, partials, partials, partials, partials, partials, partials, 1.0,
        IN_DTYPE=triton_dtype(grads[0].dtype),
        CHECK=False,
        BLOCK=g_table.block,
        ALIGNED=g_table.aligned,
        NORM=True,
        SCALE_IS_GRAD_SCALE=hp.scale is not None,
        **l2norm_kernel.LAUNCH["_sumsq_kernel"],
    )
    bad = table.scratch_buffer("verify_bad", 2, torch.int32, zero=True)
    parts: tuple[float, ...] = ()
    for name in ("lr", "beta2", "one_minus_beta2", "eps"):
        parts += split3_cached(float(hp.host.get(name, 0.0)))
    _novograd_prepare_kernel[(num_programs(device, g_table.num_tensors),)](
        partials, g_table.first_chunk, g_table.chunk_counts, g_table.num_tensors, v_ptrs, v_new, denoms, bad,
        hp.step, hp.step if hp.lr is None else hp.lr, *parts,
        LR_TENSOR=hp.lr is not None,
        BIAS_CORRECTION=hp.bias_correction,
        INIT_ZERO=init_zero,
        **LAUNCH["_novograd_prepare_kernel"],
    )
