"""Assertions for numeric code: error budgets (ulp, relative, ``gamma(n)``), bit equality, non-finite agreement.

Every assertion first checks what ``torch.testing.assert_close`` checks: the two tensors have the same
**shape** (no silent broadcasting; pass ``broadcast=True`` to allow it), live on the same **device**, and
have compatible **dtypes** (``expected`` is either of ``actual``'s dtype or a float64 reference; pass
``check_dtype=False`` to compare anything). Then NaN, +inf and -inf must sit at the same positions, and
the finite elements must be within the budget.

A budget is a sum of terms, each one a source of error the caller can name::

    |actual - expected| <= ulp * ulp(expected, dtype)        # roundings in the output format
                           + rel * |expected|                 # a relative bound
                           + gamma(gamma_n, accum_dtype) * magnitude   # a reduction of gamma_n terms
                           + atol                             # an absolute floor (underflow)

``gamma(n) = n u / (1 - n u)`` with ``u`` the unit roundoff of the accumulation format: a sum of ``n``
terms computed in that format, in any order, is off by at most ``gamma(n - 1) * sum |term|`` (Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., chapter 4), so ``magnitude`` is the float64
sum of the absolute values of the terms; it defaults to ``|expected|``, which is that sum when the terms
are non-negative (norms, sums of squares, softmax denominators).

A failure names the worst element by its N-d index and lists the first few offenders with the actual and
expected values, the error in ulps of ``dtype`` and the relative error. The assertions hide their own
frames from pytest (``__tracebackhide__``), so a failing test shows the test's line and the message.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .formats import FORMATS, format_of, gamma
from .formats import ulp as _spacing  # `ulp` is also a budget keyword below

__all__ = [
    "assert_bitwise_equal",
    "assert_close_within",
    "assert_gamma_close",
    "assert_nonfinite_agree",
    "assert_rel_close",
    "assert_ulp_close",
]

_SHOW = 5  # offenders listed in a failure message

TensorLike = torch.Tensor | float | int | Sequence[float]


def _label(what: str) -> str:
    return f"{what}: " if what else ""


def _fmt(v: float) -> str:
    return repr(float(v))


def _index(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for side in reversed(tuple(shape)):
        flat, r = divmod(flat, side)
        out.append(r)
    return tuple(reversed(out))


def _first(mask: torch.Tensor) -> list[tuple[int, ...]]:
    """N-d indices of the first ``_SHOW`` true elements of ``mask``, in row-major order."""
    flat = mask.reshape(-1).nonzero().reshape(-1)[:_SHOW].tolist()
    return [_index(i, mask.shape) for i in flat]


def _as_tensor(expected: TensorLike, actual: torch.Tensor) -> torch.Tensor:
    if isinstance(expected, torch.Tensor):
        return expected
    # Python numbers and lists are a float64 reference on actual's device (their shape is still checked).
    return torch.as_tensor(expected, dtype=torch.float64, device=actual.device)


def _check_meta(
    actual: torch.Tensor,
    expected: TensorLike,
    *,
    what: str,
    broadcast: bool,
    check_dtype: bool,
    same_dtype: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shape, device and dtype checks shared by every assertion; returns the (broadcast) pair."""
    __tracebackhide__ = True
    if not isinstance(actual, torch.Tensor):
        raise TypeError(f"{_label(what)}actual must be a torch.Tensor, got {type(actual).__name__}")
    expected = _as_tensor(expected, actual)
    for name, t in (("actual", actual), ("expected", expected)):
        if t.dtype not in FORMATS:
            raise TypeError(
                f"{_label(what)}{name} has dtype {t.dtype}; these assertions compare floating tensors of "
                f"{sorted(str(d) for d in FORMATS)}"
            )
    if actual.device != expected.device:
        raise AssertionError(
            f"{_label(what)}devices differ: actual on {actual.device}, expected on {expected.device}; "
            f"move one (e.g. expected.to(actual.device)) so the comparison is explicit"
        )
    if check_dtype:
        if same_dtype and actual.dtype != expected.dtype:
            raise AssertionError(f"{_label(what)}dtypes differ: actual {actual.dtype}, expected {expected.dtype}")
        if not same_dtype and expected.dtype not in (actual.dtype, torch.float64):
            raise AssertionError(
                f"{_label(what)}dtypes differ: actual {actual.dtype}, expected {expected.dtype}; expected must "
                f"have actual's dtype or be a float64 reference (or pass check_dtype=False)"
            )
    if actual.shape != expected.shape:
        if not broadcast:
            raise AssertionError(
                f"{_label(what)}shapes differ: actual {tuple(actual.shape)}, expected {tuple(expected.shape)} "
                f"(pass broadcast=True to compare broadcastable shapes)"
            )
        try:
            actual, expected = torch.broadcast_tensors(actual, expected)
        except RuntimeError:
            raise AssertionError(
                f"{_label(what)}shapes {tuple(actual.shape)} and {tuple(expected.shape)} do not broadcast"
            ) from None
    return actual, expected


def _nonfinite(a: torch.Tensor, e: torch.Tensor, what: str) -> None:
    """NaN, +inf and -inf at the same positions of two float64 tensors of one shape."""
    __tracebackhide__ = True
    inf = math.inf
    both_inf = torch.isinf(a) & torch.isinf(e)
    for name, bad in (
        ("NaN", torch.isnan(a) != torch.isnan(e)),
        ("the sign of inf", both_inf & (a != e)),
        ("+inf", (a == inf) != (e == inf)),
        ("-inf", (a == -inf) != (e == -inf)),
    ):
        if bool(bad.any()):
            at = _first(bad)
            rows = "\n".join(f"  {i}: actual {_fmt(a[i])}, expected {_fmt(e[i])}" for i in at)
            raise AssertionError(
                f"{_label(what)}{int(bad.sum())} of {a.numel()} element(s) disagree on {name}; first at {at}:\n{rows}"
            )


def assert_nonfinite_agree(
    actual: torch.Tensor,
    expected: TensorLike,
    *,
    what: str = "",
    broadcast: bool = False,
    check_dtype: bool = True,
) -> None:
    """NaN, +inf and -inf appear at exactly the same positions in both tensors (same shape and device)."""
    __tracebackhide__ = True
    a, e = _check_meta(actual, expected, what=what, broadcast=broadcast, check_dtype=check_dtype)
    _nonfinite(a.to(torch.float64), e.to(torch.float64), what)


def assert_bitwise_equal(
    actual: torch.Tensor, expected: torch.Tensor, *, what: str = "", broadcast: bool = False
) -> None:
    """Same dtype, shape, device and bits everywhere; any NaN matches any NaN (payloads are not compared).

    ``-0.0`` and ``+0.0`` differ. The failure lists the first offenders with their values and bit patterns.
    """
    __tracebackhide__ = True
    a, e = _check_meta(actual, expected, what=what, broadcast=broadcast, check_dtype=True, same_dtype=True)
    a64, e64 = a.to(torch.float64), e.to(torch.float64)
    _nonfinite(a64, e64, what)
    int_dtype = format_of(a.dtype).int_dtype
    a_bits = a.contiguous().view(int_dtype)
    e_bits = e.contiguous().view(int_dtype)
    bad = (a_bits != e_bits) & ~torch.isnan(a64)
    if bool(bad.any()):
        at = _first(bad)
        width = format_of(a.dtype).bits // 4
        mask = (1 << format_of(a.dtype).bits) - 1

        def hexbits(t: torch.Tensor, i: tuple[int, ...]) -> str:
            return f"0x{int(t[i]) & mask:0{width}x}"

        rows = "\n".join(
            f"  {i}: actual {_fmt(a64[i])} ({hexbits(a_bits, i)}), expected {_fmt(e64[i])} ({hexbits(e_bits, i)})"
            for i in at
        )
        raise AssertionError(
            f"{_label(what)}{int(bad.sum())} of {a.numel()} element(s) differ bitwise ({a.dtype}); "
            f"first at {at}:\n{rows}"
        )


def _budget_text(
    ulp_: float, rel: float, gamma_n: int | None, accum_dtype: torch.dtype, atol: float, dtype: torch.dtype,
    magnitude_given: bool,
) -> str:
    terms = []
    if ulp_:
        terms.append(f"{ulp_:g} ulp ({format_of(dtype).name})")
    if rel:
        terms.append(f"{rel:.3g} * |expected|")
    if gamma_n is not None:
        g = gamma(gamma_n, accum_dtype)
        terms.append(
            f"gamma({gamma_n}, {format_of(accum_dtype).name}) = {g:.3g} * "
            f"{'magnitude' if magnitude_given else '|expected|'}"
        )
    if atol:
        terms.append(f"{atol:.3g} absolute")
    return " + ".join(terms) if terms else "0 (exact equality)"


def assert_close_within(
    actual: torch.Tensor,
    expected: TensorLike,
    *,
    ulp: float = 0.0,
    rel: float = 0.0,
    gamma_n: int | None = None,
    accum_dtype: torch.dtype = torch.float32,
    magnitude: torch.Tensor | float | None = None,
    atol: float = 0.0,
    dtype: torch.dtype | None = None,
    what: str = "",
    broadcast: bool = False,
    check_dtype: bool = True,
) -> None:
    """``|actual - expected| <= budget`` elementwise, with shape, device, dtype and non-finite agreement.

    ``budget = ulp * ulp(expected, dtype) + rel * |expected| + gamma(gamma_n, accum_dtype) * magnitude + atol``
    (each term optional; all zero means exact equality of values). ``dtype`` (default ``actual.dtype``) is
    the format whose ulp is the unit of the ``ulp`` term and of the reported errors. The ulp is taken at the
    expected value, so the bound does not depend on the error being tested. ``magnitude`` (default
    ``|expected|``) must broadcast to the compared shape: for a reduction, the float64 sum of ``|term|``.

    Raises ``AssertionError`` naming the mismatch (shape, device, dtype, NaN/inf position) or, for values,
    the count of offenders, the worst one's N-d index, and the first offenders with ulp and relative errors.
    """
    __tracebackhide__ = True
    for name, v in (("ulp", ulp), ("rel", rel), ("atol", atol)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{_label(what)}{name} must be a finite number >= 0, got {v!r}")
    if gamma_n is not None and (not isinstance(gamma_n, int) or gamma_n < 0):
        raise ValueError(
            f"{_label(what)}gamma_n must be the number of terms of the reduction (an int >= 0), got {gamma_n!r}"
        )
    a, e = _check_meta(actual, expected, what=what, broadcast=broadcast, check_dtype=check_dtype)
    fmt_dtype = dtype or a.dtype
    a, e = a.to(torch.float64), e.to(torch.float64)
    _nonfinite(a, e, what)
    finite = torch.isfinite(e)
    zero = torch.zeros_like(a)
    err = torch.where(finite, (a - e).abs(), zero)
    e_safe = torch.where(finite, e, zero)
    budget = torch.full_like(a, float(atol))
    if ulp:
        budget = budget + ulp * _spacing(e_safe, fmt_dtype)
    if rel:
        budget = budget + rel * e_safe.abs()
    if gamma_n is not None:
        mag = e_safe.abs() if magnitude is None else torch.as_tensor(magnitude, dtype=torch.float64, device=a.device)
        budget = budget + gamma(gamma_n, accum_dtype) * torch.broadcast_to(mag.to(torch.float64), a.shape)
    bad = err > budget
    if not bool(bad.any()):
        return
    in_ulps = err / _spacing(e_safe, fmt_dtype)
    rel_err = torch.where(e_safe != 0, err / e_safe.abs(), torch.where(err > 0, math.inf, 0.0))
    over = torch.where(bad, err / budget, zero)  # inf where the budget is 0
    worst = _index(int(torch.argmax(torch.where(bad, torch.nan_to_num(over, posinf=1e308), zero))), a.shape)
    desc = _budget_text(ulp, rel, gamma_n, accum_dtype, atol, fmt_dtype, magnitude is not None)

    def row(i: tuple[int, ...]) -> str:
        return (
            f"{i}: actual {_fmt(a[i])}, expected {_fmt(e[i])}, abs err {float(err[i]):.3g}, "
            f"{float(in_ulps[i]):.3g} ulp, rel err {float(rel_err[i]):.3g}"
        )

    rows = "\n".join(f"  {row(i)}" for i in _first(bad))
    ratio = f", {float(over[worst]):.3g}x the budget" if math.isfinite(float(over[worst])) else ""
    raise AssertionError(
        f"{_label(what)}{int(bad.sum())} of {a.numel()} element(s) exceed the budget of {desc}\n"
        f"worst at {row(worst)}{ratio}\n"
        f"first offenders:\n{rows}"
    )


def assert_ulp_close(
    actual: torch.Tensor,
    expected: TensorLike,
    max_ulp: float,
    *,
    dtype: torch.dtype | None = None,
    what: str = "",
    broadcast: bool = False,
    check_dtype: bool = True,
    rel: float = 0.0,
    gamma_n: int | None = None,
    accum_dtype: torch.dtype = torch.float32,
    magnitude: torch.Tensor | float | None = None,
    atol: float = 0.0,
) -> None:
    """``|actual - expected| <= max_ulp * ulp(expected, dtype)`` elementwise (plus any other budget terms).

    ``expected`` is usually a float64 reference; ``dtype`` (default: ``actual.dtype``) is the format whose
    ulp sets the budget. Shapes must match exactly (``broadcast=True`` to allow broadcasting). See
    :func:`assert_close_within` for the other terms and the failure message.
    """
    __tracebackhide__ = True
    assert_close_within(
        actual, expected, ulp=max_ulp, rel=rel, gamma_n=gamma_n, accum_dtype=accum_dtype, magnitude=magnitude,
        atol=atol, dtype=dtype, what=what, broadcast=broadcast, check_dtype=check_dtype,
    )


def assert_rel_close(
    actual: torch.Tensor,
    expected: TensorLike,
    rel: float,
    *,
    atol: float = 0.0,
    ulp: float = 0.0,
    dtype: torch.dtype | None = None,
    what: str = "",
    broadcast: bool = False,
    check_dtype: bool = True,
) -> None:
    """``|actual - expected| <= rel * |expected| + atol`` elementwise (plus ``ulp`` ulps, if given)."""
    __tracebackhide__ = True
    assert_close_within(
        actual, expected, rel=rel, atol=atol, ulp=ulp, dtype=dtype, what=what, broadcast=broadcast,
        check_dtype=check_dtype,
    )


def assert_gamma_close(
    actual: torch.Tensor,
    expected: TensorLike,
    n: int,
    *,
    accum_dtype: torch.dtype = torch.float32,
    magnitude: torch.Tensor | float | None = None,
    ulp: float = 0.0,
    atol: float = 0.0,
    dtype: torch.dtype | None = None,
    what: str = "",
    broadcast: bool = False,
    check_dtype: bool = True,
) -> None:
    """A reduction's bound: ``|actual - expected| <= gamma(n, accum_dtype) * magnitude + ulp * ulp(expected) + atol``.

    ``n`` is stated by the caller: for a sum of ``k`` terms, ``n = k - 1`` additions (``k`` for a dot
    product: ``k`` products and ``k - 1`` additions). ``magnitude`` defaults to ``|expected|`` (right for
    non-negative terms); for terms of either sign pass the float64 sum of ``|term|``. Add ``ulp=0.5``
    when the accumulated value is then rounded to a narrower output format.
    """
    __tracebackhide__ = True
    assert_close_within(
        actual, expected, gamma_n=n, accum_dtype=accum_dtype, magnitude=magnitude, ulp=ulp, atol=atol,
        dtype=dtype, what=what, broadcast=broadcast, check_dtype=check_dtype,
    )
