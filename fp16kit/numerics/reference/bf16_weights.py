"""float64 references of the two bf16 write rules of ``master_weights="split"``/``"stochastic"``
(``fp16kit/kernels/bf16_weights/modes.py``), written with value arithmetic instead of bit tricks.

For a finite fp32 ``x`` the two bf16 neighbours are multiples of ``q``, bf16's spacing at ``|x|`` (2^(e-8) for
``|x|`` in [2^(e-1), 2^e), at least 2^-133, bf16's subnormal spacing); fp32's spacing there is ``q / 2^16``
(at least 2^-149), so the position of ``|x|`` between them, ``frac * 2^16``, is an integer in ``[0, 2^16)``.
"""

from __future__ import annotations

import math

__all__ = ["split_master", "stochastic_round_bf16"]


def _neighbours(a: float) -> tuple[float, float, int]:
    """``(down, q, k)``: the bf16 value at or below ``a >= 0`` (finite), bf16's spacing ``q`` there, and
    ``k = (a - down) / (q / 2^16)``, an integer in ``[0, 2^16)``."""
    e = math.frexp(a)[1] if a else -200
    q = max(2.0 ** (e - 8), 2.0**-133)
    down = math.floor(a / q) * q
    k = (a - down) / (q / 65536.0)
    assert k == int(k) and 0 <= k < 65536, (a, k)
    return down, q, int(k)


def split_master(x: float) -> tuple[float, int]:
    """``(hi, lo)`` for a non-NaN fp32 ``x``: ``hi`` the bf16 value nearest ``x``, ties away from zero (a value past
    bf16's largest finite one by half a spacing or more is inf), and ``lo`` the remainder ``|x| - |hi|`` counted in
    fp32 spacings of ``x``'s binade: an integer in ``[-32768, 32767]``, so ``|x| = |hi| + lo * spacing`` exactly
    (magnitudes: the sign is in ``hi``, as in the bits)."""
    if math.isinf(x):
        return x, 0
    a = abs(x)
    down, q, k = _neighbours(a)
    hi = down + q if k >= 32768 else down
    lo = k - 65536 if k >= 32768 else k
    if hi >= 2.0**128:  # past fp32's (and bf16's) range: bf16 inf
        hi = math.inf
    return math.copysign(hi, x), lo


def stochastic_round_bf16(x: float, r16: int) -> float:
    """``x`` (a non-NaN fp32 value) rounded to a bf16 neighbour with the random integer ``r16`` in ``[0, 2^16)``:
    away from zero when ``r16 + k >= 2^16`` (``k / 2^16`` is ``|x|``'s position between its neighbours), so with
    probability ``k / 2^16`` for a uniform ``r16``: the mean is ``x`` exactly. bf16 values never move."""
    if math.isinf(x) or x == 0:
        return x
    a = abs(x)
    down, q, k = _neighbours(a)
    out = down + q if r16 + k >= 65536 else down
    return math.copysign(math.inf if out >= 2.0**128 else out, x)
