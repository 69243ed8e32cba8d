"""The installed torch's ``torch.testing._internal.autocast_test_lists`` module, for tests that run its op lists.

Importing it normally needs torch's test harness (``common_utils`` imports ``expecttest``). When that is missing,
the same file is loaded with a stand-in ``common_utils`` holding the only two names it uses (``TEST_WITH_ROCM``,
``TestCase``); the stand-in is removed from ``sys.modules`` again afterwards. Skips when torch ships no such file.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

import pytest


@functools.cache
def _load() -> types.ModuleType | None:
    try:
        from torch.testing._internal import autocast_test_lists

        return autocast_test_lists
    except ImportError:
        pass
    spec = importlib.util.find_spec("torch.testing._internal.autocast_test_lists")
    if spec is None or spec.origin is None:
        return None
    stub = types.ModuleType("torch.testing._internal.common_utils")
    stub.TEST_WITH_ROCM = False
    stub.TestCase = object
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        module = importlib.util.module_from_spec(
            importlib.util.spec_from_file_location("_fp16kit_torch_autocast_lists", spec.origin)
        )
        module.__loader__.exec_module(module)
    finally:
        if saved is None:
            del sys.modules[stub.__name__]
        else:
            sys.modules[stub.__name__] = saved
    return module


def autocast_lists_module() -> types.ModuleType:
    module = _load()
    if module is None:
        pytest.skip("this torch install has no torch/testing/_internal/autocast_test_lists.py")
    return module
