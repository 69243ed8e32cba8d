"""Torch implementation of Adam and LAMB with 8-bit moments (``state_bits=8``): the math of the Triton kernels under
``QSTATE`` (``adam_kernel.py``, ``lamb_kernel.py``), built on the fp32 torch implementation (``optim_fallback.py``).

Per step, for the positions whose moments are 8-bit (uint8 codes, ``state8.uses_state8``): dequantize m and v into
fp32 temporaries, run the fp32 rule on them, quantize the new moments back (``state8.quantize``). Positions with
fp32 moments (small tensors) run the fp32 rule on their own state. Adam updates p from the new fp32 moments; LAMB
computes ``u`` and its norms from the moments as stored (quantized, then dequantized), as the kernel does. The
masked (device-flag) sequence of ``optim_fallback`` is used throughout, so the moments, codes and absmax match the
kernels' bit for bit (under ``state_bits=8`` every fallback row takes this path, fp32-state rows included); with
``found_inf`` set nothing is written (codes and absmax included).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import optim_fallback
from .state8 import absmax_of, dequantize, quantize

_U8 = torch.uint8


def _dequantized(codes: Sequence[torch.Tensor], signed: bool) -> tuple[list[torch.Tensor], list[int]]:
    """The moments in fp32 (8-bit ones dequantized into new tensors, fp32 ones as they are) and the 8-bit
    positions."""
    quant = [i for i, c in enumerate(codes) if c.dtype == _U8]
    values = list(codes)
    for i in quant:
        values[i] = dequantize(codes[i], absmax_of(codes[i]), signed)
    return values, quant


def _requantize(
    codes: Sequence[torch.Tensor],
    values: list[torch.Tensor],
    quant: list[int],
    signed: bool,
    skip: torch.Tensor,
    stored: bool = False,
) -> None:
    """Quantize ``values[i]`` into the 8-bit moment ``codes[i]`` for ``i`` in ``quant`` (kept where ``skip``); with
    ``stored``, replace ``values[i]`` by the values as stored."""
    for i in quant:
        q, a = quantize(values[i], signed)
        old = absmax_of(codes[i])
        codes[i].copy_(torch.where(skip, codes[i], q))
        old.copy_(torch.where(skip, old, a))
        if stored:
            values[i] = dequantize(q, a, signed)


def adam8_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
) -> None:
    """One Adam/AdamW step (``adam_kernel.py``) over moments that may be 8-bit."""
    if not params:
        return
    m, quant = _dequantized(exp_avgs, True)
    v, _ = _dequantized(exp_avg_sqs, False)
    optim_fallback.adam_(params, grads, m, v, models, hp, found_inf, l2_mode=l2_mode, decoupled=decoupled,
                         host_branch=False)
    skip = found_inf.reshape(()) != 0
    _requantize(exp_avgs, m, quant, True, skip)
    _requantize(exp_avg_sqs, v, quant, False, skip)


def lamb8_stage1(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """LAMB's stage 1 over moments that may be 8-bit: the new moments committed (quantized where 8-bit; kept
    where ``found_inf``), and ``(p, u)``: the params in fp32 and the update direction from the moments as stored."""
    skip = found_inf.reshape(()) != 0
    scalars = hp.unbind()
    _, _, _, _, _, eps, wd, bc1, bc2, _, _ = scalars
    p = optim_fallback._math(params, hp.dtype)
    m_old, quant = _dequantized(exp_avgs, True)
    v_old, _ = _dequantized(exp_avg_sqs, False)
    m, v, u = optim_fallback.lamb_direction(p, grads, m_old, v_old, scalars[1:], l2_mode, decoupled, in_place=False)
    m, v = list(m), list(v)
    _requantize(exp_avgs, m, quant, True, skip, stored=True)
    _requantize(exp_avg_sqs, v, quant, False, skip, stored=True)
    if quant:
        u = optim_fallback.lamb_u(p, m, v, eps, wd, bc1, bc2, decoupled)
    plain = [i for i in range(len(params)) if i not in set(quant)]
    optim_fallback._commit([exp_avgs[i] for i in plain], [m[i] for i in plain], skip)
    optim_fallback._commit([exp_avg_sqs[i] for i in plain], [v[i] for i in plain], skip)
    return p, list(u)


def lamb8_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    models: Sequence[torch.Tensor | None],
    hp: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    l2_mode: bool,
    decoupled: bool,
    trust: bool,
) -> None:
    """Both LAMB stages (``lamb_kernel.py``) over moments that may be 8-bit; ``u`` from the stored moments."""
    if not params:
        return
    p, u = lamb8_stage1(params, grads, exp_avgs, exp_avg_sqs, hp, found_inf, l2_mode=l2_mode, decoupled=decoupled)
    torch._foreach_mul_(u, optim_fallback._trust_ratios(p, u, hp[0], trust))
    optim_fallback._write_params(params, models, torch._foreach_sub(p, u), found_inf.reshape(()) != 0)
