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

