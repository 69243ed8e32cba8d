"""Fixtures shared by the amp tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo cache around a compile test (no graph compiled by another test is reused)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def mode_engine():
    """The ``TorchFunctionMode`` engine for one test: for contracts only that engine makes (its own weight cache,
    which re-casts after in-place updates and never grows under ``no_grad``; docs/autocast.md, "The two engines")."""
    from fp16kit.amp import autocast_mode

    before = autocast_mode.engine()
    autocast_mode.set_engine("mode")
    yield
    autocast_mode.set_engine(before)
