"""Test session set-up.

Triton fixes interpreter mode when it is first imported, so it is switched on here, before anything
imports triton: tests marked ``interpreter`` run the real Triton kernels on CPU tensors. Every other
test runs with the torch fallback (fast), unless it asks for a backend itself.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from fp16kit.kernels.backend import interpreter_active, triton_available, use_backend

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="triton is not installed, or not in interpreter mode")
    interp_ok = triton_available() and interpreter_active()
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not interp_ok:
            item.add_marker(skip_interp)


@pytest.fixture(autouse=True)
def _default_backend(request):
    """``interpreter``/``gpu`` tests pick backends automatically; the rest use the torch fallback."""
    if "interpreter" in request.keywords or "gpu" in request.keywords:
        with use_backend("auto"):
            yield
    else:
        with use_backend("torch"):
            yield
