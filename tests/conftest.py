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

from fp16kit import _versions  # noqa: E402  (after TRITON_INTERPRET is set)

if not _versions.inductor_cache_keys_autocast_dtype():
    # torch < 2.13 serves a graph compiled under one autocast dtype to the same graph under another from its
    # persistent caches (fp16kit/_versions.py, inductor_cache_keys_autocast_dtype): the suite compiles the same
    # models in fp16 and bf16, so it runs those caches off there (docs/compat.md says the same to users)
    import torch._inductor.config as _inductor_config

    _inductor_config.fx_graph_cache = False  # enough: with it off the stale graph no longer comes back (checked)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interp = pytest.mark.skip(reason="triton is not installed, or not in interpreter mode")
    skip_slow = pytest.mark.skip(reason="long run: select it with -m slow (or FP16KIT_SLOW=1)")
    interp_ok = triton_available() and interpreter_active()
    # Long runs (soak, full compile sweeps) stay out of the default suite, which must finish in minutes on a
    # 2-core CI box; `-m slow` (any marker expression naming slow) or FP16KIT_SLOW=1 runs them.
    want_slow = "slow" in (config.option.markexpr or "") or os.environ.get("FP16KIT_SLOW") == "1"
    for item in items:
        if "slow" in item.keywords and not want_slow:
            item.add_marker(skip_slow)
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


@pytest.fixture
def compiled_triton():
    """Skips (saying why) unless a CUDA GPU runs the compiled Triton kernels (``TRITON_INTERPRET=0``)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    from fp16kit.kernels import Backend, select_backend

    if select_backend(torch.device("cuda")).backend is not Backend.TRITON:
        pytest.skip("compiled Triton is not the CUDA backend here: run with TRITON_INTERPRET=0")


@pytest.fixture
def mode_engine():
    """The ``TorchFunctionMode`` engine for one test: for contracts only that engine makes (its own weight cache,
    which re-casts after in-place updates and never grows under ``no_grad``; docs/autocast.md, "Two engines, one
    table")."""
    from fp16kit.amp import autocast_mode

    before = autocast_mode.engine()
    autocast_mode.set_engine("mode")
    yield
    autocast_mode.set_engine(before)
