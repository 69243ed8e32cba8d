"""Assertions for numeric code: ulp-bounded closeness, bit equality, and non-finite agreement.

Each failure message says which elements differ, by how much (in ulps and absolutely), and shows the
worst few, so a failing property test points straight at the offending value.
"""

from __future__ import annotations

import torch

from .formats import format_of, ulp

__all__ = ["assert_bitwise_equal", "assert_nonfinite_agree", "assert_ulp_close"]

_SHOW = 5


def _label(what: str) -> str:
    return f"{what}: " if what else ""


def _where(mask: torch.Tensor, shape: torch.Size) -> list[tuple[int, ...]]:
    idx = mask.reshape(shape).nonzero()[:_SHOW]
    return [tuple(int(v) for v in row) for row in idx]


def assert_nonfinite_agree(actual: torch.Tensor, expected: torch.Tensor, *, what: str = "") -> None:
    """NaN, +inf and -inf appear at exactly the same positions in both tensors."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{_label(what)}shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    for name, fa, fe in (
        ("NaN", torch.isnan(a), torch.isnan(e)),
        ("+inf", a == float("inf"), e == float("inf")),
        ("-inf", a == float("-inf"), e == float("-inf")),
    ):
        bad = fa != fe
        if bool(bad.any()):
            at = _where(bad, actual.shape)
            raise AssertionError(
                f"{_label(what)}{int(bad.sum())} element(s) disagree on {name}; first at {at}: "
                f"actual {[float(a[i]) for i in at]}, expected {[float(e[i]) for i in at]}"
            )


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, *, what: str = "") -> None:
    """Same dtype, shape and bits everywhere; any NaN matches any NaN (payloads are not compared)."""
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{_label(what)}dtypes differ: {actual.dtype} vs {expected.dtype}")
    assert_nonfinite_agree(actual, expected, what=what)
    int_dtype = format_of(actual.dtype).int_dtype
    a_bits = actual.contiguous().view(int_dtype)
    e_bits = expected.contiguous().view(int_dtype)
    bad = (a_bits != e_bits) & ~torch.isnan(actual.to(torch.float64))
    if bool(bad.any()):
        at = _where(bad, actual.shape)
        a, e = actual.to(torch.float64), expected.to(torch.float64)
        raise AssertionError(
            f"{_label(what)}{int(bad.sum())} of {actual.numel()} element(s) differ bitwise; first at {at}: "
            f"actual {[float(a[i]) for i in at]}, expected {[float(e[i]) for i in at]}"
        )


def assert_ulp_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    max_ulp: float,
    *,
    dtype: torch.dtype | None = None,
    what: str = "",
) -> None:
    """``|actual - expected| <= max_ulp * ulp(expected, dtype)`` elementwise, with non-finite agreement.

    ``expected`` may be a float64 reference; ``dtype`` (default: ``actual.dtype``) is the format
    whose ulp sets the budget. The ulp is taken at the expected value, so the bound is symmetric
    around the true result and does not depend on the error being tested.
    """
    fmt_dtype = dtype or actual.dtype
    a = actual.to(torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64).expand_as(a)
    assert_nonfinite_agree(a, e, what=what)
    finite = torch.isfinite(e)
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    budget = torch.where(finite, max_ulp * ulp(e, fmt_dtype), torch.ones_like(a))
    in_ulps = err / budget * max_ulp
    bad = err > budget
    if bool(bad.any()):
        worst = int(torch.argmax(torch.where(bad, in_ulps, torch.zeros_like(in_ulps))))
        flat_a, flat_e, flat_u = a.reshape(-1), e.reshape(-1), in_ulps.reshape(-1)
        at = _where(bad, a.shape)
        raise AssertionError(
            f"{_label(what)}{int(bad.sum())} of {a.numel()} element(s) exceed {max_ulp} ulp "
            f"({format_of(fmt_dtype).name}); worst: element {worst} is {float(flat_u[worst]):.3g} ulp off "
            f"(actual {float(flat_a[worst])!r}, expected {float(flat_e[worst])!r}, "
            f"abs err {abs(float(flat_a[worst]) - float(flat_e[worst])):.3g}); first offenders at {at}"
        )
