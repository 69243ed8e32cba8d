"""Triton kernels and launchers: the two LAMB passes over many tensors (apex ``FusedLAMB`` math).

One address table per dtype combination with five rows: ``0`` params (the fp32 master in master-weights
mode), ``1`` grads, ``2`` exp_avg (fp32), ``3`` exp_avg_sq (fp32), ``4`` model copy (the low-precision
model param in master-weights mode; row 0 again otherwise, and never written then; in split mode the int16
low halves of the bf16 params' masters, read by both stages and written by stage 2: ``bf16_weights/modes.py``, the
constexpr ``EPILOGUE``).

Hyper-parameters are read from ``hp``, a float32 device tensor (built by ``fp16kit.optim.functional``)::

    hp = [lr, beta1, beta2, beta3, 1 - beta2, eps, weight_decay, bc1, bc2, inv_scale, clip]

Stage 1, per element (fp32 math; all reads once, m and v written once)::

    g = (g * inv_scale) / clip
    if L2_MODE:     g = g + wd * p                 # weight decay enters the moments
    m = m * beta1 + beta3 * g
    v = v * beta2 + (1 - beta2) * g * g
    u = (m / bc1) / (sqrt(v / bc2) + eps)
    if DECOUPLED:   u = u + wd * p                 # AdamW-style decay
    partials_u[c] = sum(u * u); partials_p[c] = sum(p * p)    # per chunk, reduced per tensor after

Stage 2 recomputes ``u`` from the new m, v and the old p (so ``p.grad`` is never overwritten, unlike apex,
and no update buffer is needed), then ``p = p - ratio * u`` with the per-tensor trust ratio
``ratio = lr * |p| / |u|`` when ``TRUST`` and both norms are non-zero, else ``lr``; it writes p and, in
master-weights mode, ``round_to_nearest_even(p)`` into the model copy.

``QSTATE`` (``state_bits=8``): rows 2 and 3 of a tensor of at least ``state8.SMALL_NUMEL`` elements hold 8-bit
moments (``fp16kit/kernels/state8/rule.py``), dequantized on load and quantized on store. Stage 1 computes ``u`` and
its norms from the moments as stored (quantized, then dequantized in registers), so stage 2, which reloads them,
recomputes the same ``u``.

Both stages read ``found_inf`` first: when it is non-zero they run zero loop iterations and write nothing.
Divisions and square roots are the IEEE-rounded ``div_rn``/``sqrt_rn`` (plain ``/`` and ``sqrt`` are
approximate on NVIDIA GPUs), as apex's CUDA code is with nvcc's default flags.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..bf16_weights.modes import (
    Bf16Weights,
    Epilogue,
    epilogue_mode,
    launch_arguments,
    load_master,
    rng_step,
    store_weights,
)
from ..engine.skeleton import chunk_rows, end_pass, load_grad, skip_and_stop
from ..engine.step_scalars import DeviceStep, bias_correction64, step_host64, step_inv_scale64, step_lr64, step_number
from ..engine.table import (
    STEP_PROGRAMS_PER_SM,
    STEP_WARPS_GPU,
    ChunkTable,
    num_programs,
    triton_dtype,
)
from ..state8.triton import book, load_state, moment_table, store_state
from .l2norm import segment_sums, segment_total

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _lamb_stage1_kernel: the moments and ``u`` must round each operation as the torch fallback and the float64
    # reference do.
    "_lamb_stage1_kernel": {"num_warps": STEP_WARPS_GPU, "enable_fp_fusion": False},
    # with QSTATE (8-bit moments): 16 warps keep the two block quantizations within 128 registers (8 warps: 234)
    "_lamb_stage1_kernel_state8": {"num_warps": 16, "enable_fp_fusion": False},
    # _lamb_stage2_kernel: the same ``u`` as stage 1 bit for bit (the trust-ratio norms were taken from stage 1's
    # ``u``); 8 warps: at 16 ptxas (with Triton's ``--regAllocOptLevel=2``) caps it at 64 registers and spills.
    "_lamb_stage2_kernel": {"num_warps": 8, "enable_fp_fusion": False},
}


@triton.jit
def _lamb_update(m, v, p, mask, eps, wd, bc1, bc2, DECOUPLED: tl.constexpr):
    """``u`` from the new moments (identical arithmetic in both stages)."""
    u = tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps)
    if DECOUPLED:
        u = u + wd * p
    # Masked lanes hold m = v = 0: 0 / (0 + eps) is 0, but 0/0 when eps == 0.
    return tl.where(mask, u, 0.0)


#: The host numbers of a device step, in the order of the step bundle (``_step_scalars.step_host64``).
HOST = ("lr", "beta1", "beta2", "beta3", "eps", "weight_decay", "max_grad_norm")


@triton.jit
def _lamb_scalars(hp_ptr, step, gnorm_ptr, STEP: tl.constexpr):
    """The float32 hyper-parameters ``(lr, b1, b2, beta3, 1 - b2, eps, wd, bc1, bc2, inv_scale, clip)``: read
    from ``hp_ptr`` (the vector of the module docstring), or derived from the step bundle ``step`` (host numbers
    :data:`HOST`) on the device as ``fp16kit.optim.functional.lamb_hparams`` derives them (float64 math, each value
    rounded once; the clip divisor ``gnorm / max_grad_norm`` when ``0 < max_grad_norm < gnorm``, else 1)."""
    if STEP.HP_DEVICE:
        t = step_number(step)
        b1 = step_host64(step, 1)
        b2 = step_host64(step, 2)
        g = tl.load(gnorm_ptr).to(tl.float64)
        mx = step_host64(step, 6)
        clip = tl.where((mx > 0) & (g > mx), g / mx, 1.0)
        return (
            step_lr64(step, STEP.LR_TENSOR).to(tl.float32),
            b1.to(tl.float32),
            b2.to(tl.float32),
            step_host64(step, 3).to(tl.float32),
            (1.0 - b2).to(tl.float32),
            step_host64(step, 4).to(tl.float32),
            step_host64(step, 5).to(tl.float32),
            bias_correction64(b1, t, STEP.BIAS_CORRECTION).to(tl.float32),
            bias_correction64(b2, t, STEP.BIAS_CORRECTION).to(tl.float32),
            step_inv_scale64(step, STEP.HAS_SCALE).to(tl.float32),
            clip.to(tl.float32),
        )
    else:
        return (
            tl.load(hp_ptr).to(tl.float32),
            tl.load(hp_ptr + 1).to(tl.float32),
            tl.load(hp_ptr + 2).to(tl.float32),
            tl.load(hp_ptr + 3).to(tl.float32),
            tl.load(hp_ptr + 4).to(tl.float32),
            tl.load(hp_ptr + 5).to(tl.float32),
            tl.load(hp_ptr + 6).to(tl.float32),
            tl.load(hp_ptr + 7).to(tl.float32),
            tl.load(hp_ptr + 8).to(tl.float32),
            tl.load(hp_ptr + 9).to(tl.float32),
            tl.load(hp_ptr + 10).to(tl.float32),
        )


@triton.jit
def _lamb_moments(table, c, state, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, EPILOGUE: tl.constexpr,
                  BLOCK: tl.constexpr, ALIGNED: tl.constexpr, QSTATE: tl.constexpr):
    """``(span, p_ptr, g_ptr, m_ptr, v_ptr, p, m, v)`` of chunk ``c`` as both stages start it: its span and rows
    (``chunk_rows``), the param (the split master reassembled) and the moments loaded (8-bit: dequantized)."""
    span, p_ptr, g_ptr, m_ptr, v_ptr = chunk_rows(table, c, P_DTYPE, G_DTYPE, BLOCK, ALIGNED)
    p, m, v = load_state(table, span, p_ptr, m_ptr, v_ptr, state, QSTATE, BLOCK, ALIGNED)
    p = load_master(p, table, span, EPILOGUE, ALIGNED)
    return span, p_ptr, g_ptr, m_ptr, v_ptr, p, m, v


@triton.jit
def _lamb_stage1_kernel(
    table,
    hp_ptr,
    found_inf_ptr,
    step,
    gnorm_ptr,
    sums,
    state,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    L2_MODE: tl.constexpr,
    EPILOGUE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr,
    FINISH_SUMS: tl.constexpr,
    QSTATE: tl.constexpr,
):
    """Bundles (``engine/skeleton.py``): ``table``, ``step`` (host numbers :data:`HOST`; switches ``STEP``),
    ``state`` (``state8/triton.py``; ``EPILOGUE``: the split master's low half is read), and ``sums``
    (:func:`launch_lamb_stage1`):
    ``u_partials, p_partials, done, chunk_counts, first_chunk, u_sumsq, p_sumsq``."""
    pid = tl.program_id(0)
    _, beta1, beta2, beta3, one_minus_beta2, eps, wd, bc1, bc2, inv_scale, clip = _lamb_scalars(
        hp_ptr, step, gnorm_ptr, STEP
    )
    u_partials, p_partials, done_ptr, chunk_counts, first_chunk, u_sumsq, p_sumsq = sums
    # found_inf set: zero iterations, nothing read or written.
    _, stop = skip_and_stop(found_inf_ptr, table[5])
    for c in range(pid, stop, tl.num_programs(0)):
        span, _p_ptr, g_ptr, m_ptr, v_ptr, p, m, v = _lamb_moments(table, c, state, P_DTYPE, G_DTYPE, EPILOGUE,
                                                                  BLOCK, ALIGNED, QSTATE)
        t = span[0]
        g = tl.div_rn(load_grad(g_ptr, span) * inv_scale, clip)
        if L2_MODE:
            g = g + wd * p
        m = m * beta1 + beta3 * g
        v = v * beta2 + one_minus_beta2 * g * g
        m, v = store_state(table, span, m_ptr, v_ptr, m, v, state, QSTATE, BLOCK, ALIGNED)
        u = _lamb_update(m, v, p, span[2], eps, wd, bc1, bc2, DECOUPLED)
        tl.store(u_partials + c, tl.sum(u * u, axis=0))
        tl.store(p_partials + c, tl.sum(p * p, axis=0))
        if FINISH_SUMS:
            # The program that completes tensor t's last chunk sums its partials (in chunk order), so the
            # per-tensor sums need no launch of their own; it leaves the tensor's counter at zero.
            tl.debug_barrier()
            count = tl.load(chunk_counts + t).to(tl.int32)
            if tl.atomic_add(done_ptr + t, 1, sem="acq_rel") == count - 1:
                first = tl.load(first_chunk + t)
                tl.store(u_sumsq + t, segment_total(u_partials, first, count))
                tl.store(p_sumsq + t, segment_total(p_partials, first, count))
                tl.atomic_xchg(done_ptr + t, 0, sem="acq_rel")


@triton.jit
def _lamb_stage2_kernel(
    table,
    hp_ptr,
    found_inf_ptr,
    step,
    gnorm_ptr,
    u_sumsq,
    p_sumsq,
    weights,
    state,
    P_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    DECOUPLED: tl.constexpr,
    TRUST: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr,
    EPILOGUE: tl.constexpr,
    QSTATE: tl.constexpr,
):
    """Bundles (``engine/skeleton.py``): ``table``, ``step`` (host numbers :data:`HOST`; switches ``STEP``),
    ``weights`` (the bf16 write epilogue, ``bf16_weights/modes.py``; switches ``EPILOGUE``), ``state``
    (``state8/triton.py``)."""
    pid = tl.program_id(0)
    lr, _, _, _, _, eps, wd, bc1, bc2, _, _ = _lamb_scalars(hp_ptr, step, gnorm_ptr, STEP)
    skip, stop = skip_and_stop(found_inf_ptr, table[5])
    rng = rng_step(weights, STEP.HP_DEVICE, EPILOGUE)
    for c in range(pid, stop, tl.num_programs(0)):
        span, p_ptr, _grads, _m_ptr, _v_ptr, p, m, v = _lamb_moments(table, c, state, P_DTYPE, P_DTYPE, EPILOGUE,
                                                                    BLOCK, ALIGNED, QSTATE)
        u = _lamb_update(m, v, p, span[2], eps, wd, bc1, bc2, DECOUPLED)
        ratio = lr
        if TRUST:
            pn = tl.sqrt_rn(tl.load(p_sumsq + span[0]))
            un = tl.sqrt_rn(tl.load(u_sumsq + span[0]))
            ratio = tl.where((pn != 0.0) & (un != 0.0), lr * tl.div_rn(pn, un), lr)
        p = p - ratio * u
        store_weights(table, span, p_ptr, p, weights, rng, P_DTYPE, MODEL_DTYPE, HAS_MODEL, ALIGNED, EPILOGUE)
    end_pass(skip, step, STEP)


def launch_lamb(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor] | None,
    hp: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    trust: bool,
    weights: Bf16Weights | None = None,
    row_idx: torch.Tensor | None = None,
    state8: bool = False,
) -> None:
    """Both LAMB stages for contiguous, non-empty tensors of one dtype combination (fp32 m, v; with ``state8``,
    8-bit moments where ``state8.uses_state8``).

    ``models`` (master-weights mode) receives the rounded copy of the updated ``params``; ``weights``, ``row_idx``:
    the bf16 write epilogue, as in ``adam_kernel.launch_adam`` (split mode: ``models`` holds the low halves).
    """
    table, p_sumsq, u_sumsq = launch_lamb_stage1(
        (params, grads, exp_avgs, exp_avg_sqs, models), hp, found_inf, l2_mode=l2_mode, decoupled=decoupled,
        weights=weights, state8=state8,
    )
    launch_lamb_stage2(table, params, models, hp, found_inf, u_sumsq, p_sumsq, decoupled=decoupled, trust=trust,
                       weights=weights, row_idx=row_idx, state8=state8)


def launch_lamb_stage1(
    rows: tuple[Sequence[torch.Tensor], ...],
    hp: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    weights: Bf16Weights | None = None,
    state8: bool = False,
) -> tuple[ChunkTable, torch.Tensor, torch.Tensor]:
    """Stage 1 (m, v written; ``u`` not stored) and the per-tensor sums of ``p^2`` and ``u^2``, over ``rows``:
    ``(params, grads, exp_avgs, exp_avg_sqs, models)``, ``models`` None when there are no model copies.

    Returns ``(table, p_sumsq, u_sumsq)``: the address table stage 2 reuses (its rows include ``models``, so it is
    built for the whole step) and two ``[N]`` sums. A sharded step all-reduces the sums in between
    (``fp16kit/kernels/optimizers.py``); :func:`launch_lamb` hands them straight to :func:`launch_lamb_stage2`.
    """
    params, grads, exp_avgs, exp_avg_sqs, models = rows
    device = params[0].device
    table, state = moment_table(params, grads, exp_avgs, exp_avg_sqs, models, state8)
    hp_ptr, step, flags = DeviceStep.arguments(hp, table, HOST)
    finish = isinstance(hp, DeviceStep)
    n = table.num_tensors
    if finish:  # per-tensor sums finished in the launch: buffers of the table, made once
        u_partials = table.scratch_buffer("u_partials", table.num_chunks, torch.float32)
        p_partials = table.scratch_buffer("p_partials", table.num_chunks, torch.float32)
        sums = table.scratch_buffer("lamb_sums", 2 * n, torch.float32)
        done = table.scratch_buffer("lamb_done", n, torch.int32, zero=True)
        gnorm = hp.gnorm if hp.gnorm is not None else hp.step
    else:
        u_partials = torch.empty(table.num_chunks, dtype=torch.float32, device=device)
        p_partials = torch.empty(table.num_chunks, dtype=torch.float32, device=device)
        sums = done = gnorm = u_partials
    _lamb_stage1_kernel[(num_programs(device, table.num_chunks, STEP_PROGRAMS_PER_SM),)](
        table.leading_args(),
        hp_ptr,
        found_inf,
        step,
        gnorm,
        (u_partials, p_partials, done, table.chunk_counts, table.first_chunk, sums[n:] if finish else sums,
         sums[:n] if finish else sums),
        state,
        P_DTYPE=triton_dtype(params[0].dtype),
        G_DTYPE=triton_dtype(grads[0].dtype),
        L2_MODE=l2_mode,
        EPILOGUE=Epilogue(epilogue_mode(weights, params, models is not None)),
        DECOUPLED=decoupled,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        FINISH_SUMS=finish,
        QSTATE=state8,
        **flags,
        **LAUNCH["_lamb_stage1_kernel_state8" if state8 else "_lamb_stage1_kernel"],
    )
    if finish:
        return table, sums[:n], sums[n:]
    return table, segment_sums(p_partials, table), segment_sums(u_partials, table)


def launch_lamb_stage2(
    table: ChunkTable,
    params: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor] | None,
    hp: torch.Tensor | DeviceStep,
    found_inf: torch.Tensor,
    u_sumsq: torch.Tensor,
    p_sumsq: torch.Tensor,
    *,
    decoupled: bool,
    trust: bool,
    weights: Bf16Weights | None = None,
    row_idx: torch.Tensor | None = None,
    state8: bool = False,
) -> None:
    """Stage 2 over ``table`` (from :func:`launch_lamb_stage1`): ``p -= ratio * u`` with the per-tensor trust
    ratio from the completed sums; model copies written."""
    device = params[0].device
    p_dtype = triton_dtype(params[0].dtype)
    hp_ptr, step, flags = DeviceStep.arguments(hp, table, HOST)
    gnorm = hp.gnorm if isinstance(hp, DeviceStep) and hp.gnorm is not None else hp_ptr
    epilogue, modes, has_model = launch_arguments(weights, params, models is not None, found_inf, row_idx)
    _lamb_stage2_kernel[(num_programs(device, table.num_chunks, STEP_PROGRAMS_PER_SM),)](
        table.leading_args(),
        hp_ptr,
        found_inf,
        step,
        gnorm,
        u_sumsq,
        p_sumsq,
        epilogue,
        (book(device) if state8 else p_sumsq,),
        P_DTYPE=p_dtype,
        MODEL_DTYPE=p_dtype if not has_model else triton_dtype(models[0].dtype),
        HAS_MODEL=has_model,
        **modes,
        DECOUPLED=decoupled,
        TRUST=trust,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        QSTATE=state8,
        **flags,
        **LAUNCH["_lamb_stage2_kernel"],
    )
