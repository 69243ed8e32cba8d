"""float64 references for the ops people write mixed-precision kernels for, each with its error bound.

Inputs of any floating dtype are converted to float64 exactly; results are float64. Each docstring states
how far the reference may be from the exact (real-number) result of its float64 inputs, with
``u = 2^-53`` (the unit roundoff of float64) and ``n`` the length of the reduced dimension. Those bounds are
checked against mpmath at 40 significant digits (``tests/numerics/test_reference_ops.py``), and are many
orders of magnitude below an fp32, bf16 or fp16 ulp, so a test may treat the reference as exact and spend
its whole budget on the code under test.

The formulas are chosen for accuracy over the whole range, not for speed: softmax subtracts the row
maximum; GELU uses ``erfc`` and a logistic form so negative inputs do not cancel; layer norm corrects its
mean with a second pass; non-finite inputs give what torch gives (NaN rows for NaN or +inf in a row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "MatmulReference",
    "cross_entropy",
    "gelu",
    "layer_norm",
    "log_softmax",
    "matmul",
    "rms_norm",
    "softmax",
]

U = 2.0**-53  # float64 unit roundoff


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x_i - m) / sum_j exp(x_j - m)`` along ``dim``, ``m`` the maximum.

    Bound: relative error at most ``(n + |x_i - m| + 760) u`` wherever the exact result is a normal float64
    (``|x_i - m| <= 745`` there, so at most ``(n + 1505) u``: about ``2e-13`` for ``n = 1024``).
    """
    x = _f64(x)
    if x.numel() == 0:
        return x.clone()  # (amax refuses an empty dimension; torch returns the empty tensor)
    m = x.amax(dim=dim, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(dim=dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x_i - m - log(sum_j exp(x_j - m))`` along ``dim``, ``m`` the maximum.

    Bound: absolute error at most ``(|x_i - m| + n + 770) u`` (the log of the sum lies in ``[0, log n]``).
    """
    x = _f64(x)
    if x.numel() == 0:
        return x.clone()  # (amax refuses an empty dimension; torch returns the empty tensor)
    m = x.amax(dim=dim, keepdim=True)
    shifted = x - m
    return shifted - torch.log(torch.exp(shifted).sum(dim=dim, keepdim=True))


def _weights(t: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.full(shape, fill, dtype=torch.float64, device=like.device) if t is None else _f64(t)


def rms_norm(
    x: torch.Tensor, normalized_shape: tuple[int, ...] | int, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dimensions.

    Squares of fp32 (and narrower) values are exact in float64 and never overflow there, so the only
    errors are the sum and four roundings. Bound: relative error at most ``(n + 6) u``.
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    dims = tuple(range(-len(shape), 0))
    x = _f64(x)
    ms = (x * x).mean(dim=dims, keepdim=True)
    return x / torch.sqrt(ms + eps) * _weights(weight, shape, x, 1.0)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...] | int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing dimensions (biased variance).

    The mean is corrected by a second pass (``mean + mean(x - mean)``), so rows with a large mean and a
    small spread keep their digits. Bound: with ``s = sqrt(var + eps)``, absolute error at most
    ``(4 n + 20) u * (|weight_i| * (|x_i - mean| + |mean| + s) / s + |bias_i|)``.
    """
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    dims = tuple(range(-len(shape), 0))
    x = _f64(x)
    mean = x.mean(dim=dims, keepdim=True)
    mean = mean + (x - mean).mean(dim=dims, keepdim=True)
    d = x - mean
    var = (d * d).mean(dim=dims, keepdim=True)
    return d / torch.sqrt(var + eps) * _weights(weight, shape, x, 1.0) + _weights(bias, shape, x, 0.0)


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU as ``torch.nn.functional.gelu`` defines it, for ``approximate="none"`` or ``"tanh"``.

    ``none``: ``x/2 * erfc(-x / sqrt 2)`` (equal to ``x/2 * (1 + erf(x / sqrt 2))`` but without its
    cancellation for negative ``x``). Bound: relative error at most ``(2 x^2 + 16) u``.

    ``tanh``: ``x * sigmoid(2 z)`` with ``z = sqrt(2/pi) (x + 0.044715 x^3)`` (equal to
    ``x/2 * (1 + tanh(z))``, again without the cancellation). Bound: relative error at most ``(8 |z| + 16) u``.

    Both: plus ``(|x| + 8) * 2^-1074`` absolute, which matters only where the result is in float64's
    subnormal range (``x`` below about -37 and -21).
    """
    x = _f64(x)
    if approximate == "none":
        return 0.5 * x * torch.special.erfc(-x / math.sqrt(2.0))
    if approximate == "tanh":
        z = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        # sigmoid(2z) as e/(1+e) with e = exp(2z) for z < 0, so its tail underflows gradually, never to 0 at once
        e = torch.exp(-2.0 * z.abs())
        return torch.where(z < 0, x * e / (1.0 + e), x / (1.0 + e))
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean", ignore_index: int = -100
) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` for class indices: ``-log_softmax(logits)[i, target_i]``.

    ``logits`` is ``(N, C)`` (or ``(C,)``), ``target`` holds class indices; rows whose target is
    ``ignore_index`` count for nothing, and ``mean`` divides by the number of the other rows (NaN when there
    are none, as torch). Bound: each row's loss is within ``(|x_t - m| + C + 770) u`` absolutely (see
    :func:`log_softmax`); ``sum`` and ``mean`` add ``(N + 2) u`` relative (the losses are non-negative).
    """
    logits = _f64(logits)
    if logits.dim() == 1:
        logits, target = logits.unsqueeze(0), target.reshape(1)
    keep = target != ignore_index
    picked = torch.where(keep, target, torch.zeros_like(target)).to(torch.int64)
    losses = -log_softmax(logits, dim=1).gather(1, picked.unsqueeze(1)).squeeze(1)
    losses = torch.where(keep, losses, torch.zeros_like(losses))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / keep.sum()
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")


@dataclass(frozen=True)
class MatmulReference:
    """What a matmul with fp32 accumulation is held to (see :func:`matmul`)."""

    value: torch.Tensor  # float64 ``a @ b``
    magnitude: torch.Tensor  # float64 ``|a| @ |b|``: the scale of the accumulation error
    k: int  # the inner dimension: products summed per output


def matmul(a: torch.Tensor, b: torch.Tensor) -> MatmulReference:
    """``a @ b`` in float64, with ``|a| @ |b|`` and the inner dimension ``k``, for a gamma budget.

    Products of fp32 (and narrower) values are exact in float64, so the reference's own error is the float64
    sum: at most ``gamma(k, float64) * magnitude``. A kernel that multiplies in fp32 and accumulates the ``k``
    products in fp32, in any order or blocking, is within ``gamma(k, float32) * magnitude`` of the exact
    result, plus half an ulp of its output format when it rounds the sum to a narrower one::

        ref = reference.matmul(a, b)
        assert_gamma_close(out, ref.value, ref.k, magnitude=ref.magnitude, ulp=0.5)
    """
    a64, b64 = _f64(a), _f64(b)
    return MatmulReference(a64 @ b64, a64.abs() @ b64.abs(), int(a.shape[-1]))
