"""Fixtures of the plan-cache tests (``test_plan_cache.py``, ``test_plan_loose_rows.py``, which use ``plan_guard``
for every test): both backends, and both plan guards (torch's C++ tensor guard and the portable Python one),
from an empty cache."""

from __future__ import annotations

import pytest

from fp16kit.kernels.engine import plan as _plan


@pytest.fixture(params=[pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"])
def backend(request):
    return request.param


@pytest.fixture(params=["torch", "python"])
def plan_guard(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(_plan, "make_guard", _plan._PyGuard)
    elif _plan.make_guard is _plan._PyGuard:
        pytest.skip("torch's tensor guard is not available in this torch")
    _plan.clear()
    yield request.param
    _plan.clear()
