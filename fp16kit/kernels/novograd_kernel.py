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
(``_results.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._chunks import chunk_span, load_chunk, row_pointer
from ._results import check_or_store, lr_arms, raise_found_inf
from ._rounding import to_fp32
from ._table import chunk_table, num_programs, triton_dtype

#: Launch options pinned per kernel: no FMA contraction, <= 128 registers (docs/kernels.md, "GPU readiness").
LAUNCH: dict[str, dict] = {
    # _absmax_kernel: a max, no multiply-add.
    "_absmax_kernel": {"num_warps": 16, "enable_fp_fusion": False},
    # _novograd_kernel: each operation rounded as in the torch fallback.
    "_novograd_kernel": {"num_warps": 16, "enable_fp_fusion": False},
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


@triton.jit
def _novograd_kernel(
    ptrs,
    num_tensors,
    numels,
    chunk_tensor,
    chunk_start,
    num_chunks,
    hp_ptr,
    denoms_ptr,
    found_inf_ptr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    MODEL_DTYPE: tl.constexpr,
    HAS_MODEL: tl.constexpr,
    REG_INSIDE: tl.constexpr,
    VERIFY: tl.constexpr,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    neg_lr = -tl.load(hp_ptr).to(tl.float32)
    beta1 = tl.load(hp_ptr + 1).to(tl.float32)
    beta3 = tl.load(hp_ptr + 2).to(tl.float32)
    wd = tl.load(hp_ptr + 3).to(tl.float32)
    bc1 = tl.load(hp_ptr + 4).to(tl.float32)
    inv_scale = tl.load(hp_ptr + 5).to(tl.float32)
    stop = tl.where(tl.load(found_inf_ptr) != 0, 0, num_chunks)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for c in range(pid, stop, tl.num_programs(0)):
        t, offs, mask, full = chunk_span(c, chunk_tensor, chunk_start, numels, BLOCK, ALIGNED)
        denom = tl.load(denoms_ptr + t).to(tl.float32)
        p_ptr = row_pointer(ptrs, 0, num_tensors, t, P_DTYPE, ALIGNED)
        g_ptr = row_pointer(ptrs, 1, num_tensors, t, G_DTYPE, ALIGNED)
        m_ptr = row_pointer(ptrs, 2, num_tensors, t, tl.float32, ALIGNED)
        p = to_fp32(load_chunk(p_ptr, offs, mask, full))
        g = to_fp32(load_chunk(g_ptr, offs, mask, full)) * inv_scale
        m = load_chunk(m_ptr, offs, mask, full)
        if REG_INSIDE:
            g = tl.div_rn(g, denom) + wd * p
            m = beta1 * m + beta3 * g
            u = tl.div_rn(m, bc1)
        else:
            m = beta1 * m + beta3 * g
            u = tl.div_rn(tl.div_rn(m, bc1), denom) + wd * p
        p = p + neg_lr * u
        model_ptr = row_pointer(ptrs, 3, num_tensors, t, MODEL_DTYPE, ALIGNED)
        bad = check_or_store(p, m, p_ptr, m_ptr, model_ptr, offs, mask, full, bad, P_DTYPE, MODEL_DTYPE, True,
                             HAS_MODEL, VERIFY)
    if VERIFY:
        raise_found_inf(found_inf_ptr, bad, lr_arms(neg_lr))


def launch_novograd(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor] | None,
    hp: torch.Tensor,
    denoms: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    reg_inside_moment: bool,
    verify: bool = False,
) -> None:
    """One NovoGrad launch for contiguous, non-empty tensors of one dtype combination (fp32 exp_avg);
    ``denoms`` is the fp32 [N] vector of per-tensor denominators, in the order of ``params``. ``verify``: the
    result check (``_results.py``), nothing written but ``found_inf``."""
    table = chunk_table(
        [params, grads, exp_avgs, params if models is None else models],
        written=(0, 2) if models is None else (0, 2, 3),
    )
    device = params[0].device
    p_dtype = triton_dtype(params[0].dtype)
    _novograd_kernel[(num_programs(device, table.num_chunks),)](
        *table.leading_args(),
        hp,
        denoms,
        found_inf,
        P_DTYPE=p_dtype,
        G_DTYPE=triton_dtype(grads[0].dtype),
        MODEL_DTYPE=p_dtype if models is None else triton_dtype(models[0].dtype),
        HAS_MODEL=models is not None,
        REG_INSIDE=reg_inside_moment,
        VERIFY=verify,
        BLOCK=table.block,
        ALIGNED=table.aligned,
        **LAUNCH["_novograd_kernel"],
    )
