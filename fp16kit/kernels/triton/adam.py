"""Triton kernel and launcher: one Adam/AdamW pass over many tensors, in ``torch.optim.Adam``'s order of ops.

Address-table rows: ``0`` params (the fp32 master in master-weights mode), ``1`` grads, ``2`` exp_avg
(fp32), ``3`` exp_avg_sq (fp32), ``4`` model copy (row 0 again when there is none; never written then), or in
split mode the int16 low halves of the bf16 params' masters. The param is read through ``load_master`` and written
through ``store_weights`` (``bf16_weights/modes.py``: plain, split or stochastic rounding, the constexpr ``EPILOGUE``).

Hyper-parameters come from ``hp``, a float32 device tensor (built by ``fp16kit.optim.functional``; the
derived values are computed in float64 and rounded once, as torch does with its Python-float scalars)::

    hp = [lr, beta1, beta2, 1 - beta1, 1 - beta2, eps, weight_decay, -lr / bc1, sqrt(bc2), inv_scale,
          1 - lr * weight_decay]

Per element (fp32 math, each tensor read once and written once)::

    g = g * inv_scale
    if L2_MODE:   g = g + wd * p                          # Adam: L2 penalty
    m = lerp(m, g, 1 - beta1)                             # torch's lerp formula
    v = v * beta2 + (1 - beta2) * g * g
    if DECOUPLED: p = p * (1 - lr * wd)                   # AdamW
    p = p + (-lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps))

``found_inf`` non-zero: zero loop iterations, nothing written.

``QSTATE`` (``state_bits=8``): rows 2 and 3 of a tensor of at least ``state8.SMALL_NUMEL`` elements hold 8-bit
moments (``fp16kit/kernels/state8/rule.py``): they are dequantized on load and the new m, v quantized on store
(``_state8.load_state``/``store_state``); p is updated from the new fp32 m, v before quantization.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..bf16_weights.modes import Bf16Weights, launch_arguments, load_master, rng_step, store_weights
from ..engine.skeleton import chunk_rows, end_pass, load_grad, skip_and_stop
from ..engine.step_scalars import DeviceStep, bias_correction64, step_host64, step_inv_scale64, step_lr64, step_number
from ..engine.table import STEP_PROGRAMS_PER_SM, STEP_WARPS_GPU, num_programs, triton_dtype
from ..state8.triton import load_state, moment_table, store_state

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _adam_kernel: each operation rounded as in ``torch.optim.Adam``'s for-each path and the torch fallback.
    "_adam_kernel": {"num_warps": STEP_WARPS_GPU, "enable_fp_fusion": False},
    # with QSTATE (8-bit moments): 16 warps, so that the two block quantizations (an 8-step search each) fit in
    # <= 128 registers without spills (8 warps: 221-240 registers on sm_90, tests/kernels/test_gpu_compile.py)
    "_adam_kernel_state8": {"num_warps": 16, "enable_fp_fusion": False},
}


#: The host numbers of a device step, in the order of the step bundle (``_step_scalars.step_host64``).
HOST = ("lr", "beta1", "beta2", "eps", "weight_decay")


@triton.jit
def _adam_kernel(
    table,
    hp_ptr,
    found_inf_ptr,
    step,
    weights,
    state,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    L2_MODE: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    STEP: tl.constexpr,
    EPILOGUE: tl.constexpr,
    QSTATE: tl.constexpr,
):
    """Bundles (``engine/skeleton.py``): ``table`` the address table, ``step`` the step (host numbers :data:`HOST`;
    its switches ``STEP``), ``weights`` the bf16 write epilogue (``bf16_weights/modes.py``; its switches ``EPILOGUE``),
    ``state`` the 8-bit moments' (``state8/triton.py``)."""
    pid = tl.program_id(0)
    if STEP.HP_DEVICE:
        # adam_hparams (fp16kit/optim/functional.py) on the device: float64 math, each value rounded once
        t_step = step_number(step)  # int64; ``t`` is the loop's tensor index (int32) below
        lr = step_lr64(step, STEP.LR_TENSOR)
        b1 = step_host64(step, 1)
        b2 = step_host64(step, 2)
        wd64 = step_host64(step, 4)
        beta2 = b2.to(tl.float32)
        one_minus_beta1 = (1.0 - b1).to(tl.float32)
        one_minus_beta2 = (1.0 - b2).to(tl.float32)
        eps = step_host64(step, 3).to(tl.float32)
        wd = wd64.to(tl.float32)
        neg_step_size = (-lr / bias_correction64(b1, t_step, STEP.BIAS_CORRECTION)).to(tl.float32)
        bc2_sqrt = tl.sqrt(bias_correction64(b2, t_step, STEP.BIAS_CORRECTION)).to(tl.float32)
        inv_scale = step_inv_scale64(step, STEP.HAS_SCALE).to(tl.float32)
        decay = (1.0 - lr * wd64).to(tl.float32)
    else:
        beta2 = tl.load(hp_ptr + 2).to(tl.float32)
        one_minus_beta1 = tl.load(hp_ptr + 3).to(tl.float32)
        one_minus_beta2 = tl.load(hp_ptr + 4).to(tl.float32)
        eps = tl.load(hp_ptr + 5).to(tl.float32)
        wd = tl.load(hp_ptr + 6).to(tl.float32)
        neg_step_size = tl.load(hp_ptr + 7).to(tl.float32)
        bc2_sqrt = tl.load(hp_ptr + 8).to(tl.float32)
        inv_scale = tl.load(hp_ptr + 9).to(tl.float32)
        decay = tl.load(hp_ptr + 10).to(tl.float32)
    skip, stop = skip_and_stop(found_inf_ptr, table[5])
    rng = rng_step(weights, STEP.HP_DEVICE, EPILOGUE)
    for c in range(pid, stop, tl.num_programs(0)):
        span, p_ptr, g_ptr, m_ptr, v_ptr = chunk_rows(table, c, P_DTYPE, G_DTYPE, BLOCK, ALIGNED)
        p, m, v = load_state(table, span, p_ptr, m_ptr, v_ptr, state, QSTATE, BLOCK, ALIGNED)
        p = load_master(p, table, span, EPILOGUE, ALIGNED)
        g = load_grad(g_ptr, span) * inv_scale
        if L2_MODE:
            g = g + wd * p
        # torch.lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w).
        diff = g - m
        m = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * diff, g - diff * (1.0 - one_minus_beta1))
        v = v * beta2 + one_minus_beta2 * g * g
        if DECOUPLED:
            p = p * decay
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p + neg_step_size * tl.div_rn(m, denom)
        store_state(table, span, m_ptr, v_ptr, m, v, state, QSTATE, BLOCK, ALIGNED)
        store_weights(table, span, p_ptr, p, weights, rng, P_DTYPE, MODEL_DTYPE, HAS_MODEL, ALIGNED, EPILOGUE)
    end_pass(skip, step, STEP)


def launch_adam(
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
    weights: Bf16Weights | None = None,
    row_idx: torch.Tensor | None = None,
    state8: bool = False,
) -> None:
    """One Adam launch for contiguous, non-empty tensors of one dtype combination (fp32 m, v; with ``state8``,
    8-bit moments where ``state8.uses_state8``).

    ``hp``: the float32 vector of the module docstring, or a :class:`DeviceStep` (the hyper-parameters derived
    in the kernel from the device step counter, which the launch advances when ``hp.advance``). ``weights``: the
    bf16 write epilogue (``bf16_weights/modes.py``; split mode: ``models`` holds the low halves); ``row_idx``: the row
    table of stochastic rounding's counters (``_bf16_weights.row_table``: each tensor's position in the update call
    and its first element's index in its whole tensor, int64, device), when not ``0..n-1`` and all 0."""
    device = params[0].device
    table, state = moment_table(params, grads, exp_avgs, exp_avg_sqs, models, state8)
    p_dtype = triton_dtype(params[0].dtype)
    hp_ptr, step, flags = DeviceStep.arguments(hp, table, HOST)
    epilogue, modes, has_model = launch_arguments(weights, params, models is not None, found_inf, row_idx)
    _adam_kernel[(num_programs(device, table.num_chunks, STEP_PROGRAMS_PER_SM),)](
        table.leading_args(),
        hp_ptr,
        found_inf,
        step,
        epilogue,
        state,
        P_DTYPE=p_dtype,
        G_DTYPE=triton_dtype(grads[0].dtype),
        MODEL_DTYPE=p_dtype if not has_model else triton_dtype(models[0].dtype),
        HAS_MODEL=has_model,
        **modes,
        L2_MODE=l2_mode,
        DECOUPLED=decoupled,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        QSTATE=state8,
        **flags,
        **LAUNCH["_adam_kernel_state8" if state8 else "_adam_kernel"],
    )
