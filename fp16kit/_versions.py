"""The torch and Triton releases fp16kit supports, and every branch on their version or on a feature probe.

One place for it all: code elsewhere asks a function here (``ddp_sync_buffers_arg()``, ``dtensor_class()``...) and
never reads ``torch.__version__`` / ``triton.__version__`` or probes ``hasattr(torch, ...)`` itself. Each branch
has a test in ``tests/test_versions.py``; ``docs/compat.md`` says which pairs were run and when.

The supported range is the tested one (``pyproject.toml`` requires exactly it): the oldest pair is the one GPU images
have (torch 2.11 + Triton 3.6), the newest the one CI runs (torch 2.13 CPU + Triton 3.9). Importing fp16kit with
a torch or Triton outside it warns once (:class:`UnsupportedVersionWarning`), naming both versions and the fix.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import sys
import warnings
from typing import Any

__all__ = [
    "TORCH_RANGE",
    "TRITON_RANGE",
    "UnsupportedVersionWarning",
    "check_installed",
    "ddp_sync_buffers_arg",
    "dtensor_class",
    "dynamo_traces_any_id",
    "installed_version",
    "parse",
    "patch_triton_interpreter",
    "version_problem",
]

#: ``(lowest, first unsupported)`` torch ``(major, minor)``: the tested range (docs/compat.md).
TORCH_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 14))
#: ``(lowest, first unsupported)`` Triton ``(major, minor)``: the tested range (docs/compat.md).
TRITON_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((3, 6), (3, 10))
_RANGES = {"torch": TORCH_RANGE, "triton": TRITON_RANGE}


class UnsupportedVersionWarning(UserWarning):
    """The installed torch or Triton is outside the range fp16kit was tested on."""


def parse(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string (``"2.11.0+cu130"`` -> ``(2, 11)``), None when unreadable."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def installed_version(dist: str) -> str | None:
    """The version of ``dist`` (``"torch"`` or ``"triton"``): the imported module's ``__version__`` when it is
    imported (what runs), else the installed distribution's (read without importing it); None when absent."""
    module = sys.modules.get(dist)
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _range_text(dist: str) -> str:
    lo, hi = _RANGES[dist]
    return f"{dist}>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}"


def version_problem(dist: str, version: str | None = None) -> str | None:
    """Why ``version`` of ``dist`` (default: the installed one) is unsupported, or None when it is in range (or
    ``dist`` is not installed: Triton is optional off Linux)."""
    version = installed_version(dist) if version is None else version
    if version is None:
        return None
    got = parse(version)
    lo, hi = _RANGES[dist]
    if got is None:
        return f"cannot read the {dist} version {version!r}"
    if not lo <= got < hi:
        return f"{dist} {version} is outside the tested range {_range_text(dist)}"
    return None


#: The versions :func:`check_installed` warned about (so a later, narrower check need not warn again).
WARNED: dict[str, str] = {}


def check_installed() -> None:
    """Warn once (:class:`UnsupportedVersionWarning`) when the installed torch or Triton is outside the tested
    range. Called when ``fp16kit`` is imported; reads versions without importing torch or triton."""
    problems = {}
    for dist in _RANGES:
        problem = version_problem(dist)
        if problem is not None:
            problems[dist] = problem
            WARNED[dist] = installed_version(dist) or ""
    if not problems:
        return
    fix = " ".join(f"'{_range_text(dist)}'" for dist in _RANGES)
    warnings.warn(
        f"fp16kit: {'; '.join(problems.values())}. fp16kit is tested on exactly that range (docs/compat.md); "
        f"outside it a kernel, torch.compile or autocast may fail or be slower. Fix: pip install {fix} "
        f"(GPU images: torch 2.11 + triton 3.6 is the oldest supported pair).",
        UnsupportedVersionWarning,
        stacklevel=3,
    )


# -- Triton -------------------------------------------------------------------------------------------------------


def _index_fixed(self: Any) -> int:
    # Triton >= 3.7's own definition: a 1-element array is squeezed before int()
    return int(self.handle.data.squeeze())


def _interpreter_index_broken(interpreter: Any) -> bool:
    """Does the interpreter's ``tl.tensor.__index__`` fail on a 1-element array? Triton <= 3.6 wrote
    ``int(self.handle.data)``, which NumPy >= 2.4 rejects for arrays of shape (1,) ("only 0-dimensional arrays can
    be converted to Python scalars"): every ``range(pid, n, tl.num_programs(0))`` in an interpreted kernel failed.
    """
    import numpy as np

    class _Probe:
        pass

    class _Handle:
        data = np.array([3], dtype=np.int32)

    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(_Probe, scope)
    try:
        probe = _Probe()
        probe.handle = _Handle()
        return _Probe.__index__(probe) != 3
    except TypeError:
        return True
    finally:
        scope.restore()


def patch_triton_interpreter(interpreter: Any = None) -> bool:
    """Make Triton's interpreter convert 1-element integer tensors to Python ints the way Triton >= 3.7 does, when
    the installed Triton's interpreter cannot (Triton 3.6 with NumPy >= 2.4; probed, not read from the version).
    Kernel numerics are untouched: only loop bounds go through ``__index__``. Idempotent; True when patched.
    ``interpreter``: the module to patch (default ``triton.runtime.interpreter``)."""
    if interpreter is None:
        try:
            from triton.runtime import interpreter
        except ImportError:  # no triton, or one without an interpreter
            return False
    if getattr(interpreter, "_fp16kit_index_patch", False):
        return True
    if not hasattr(interpreter, "_patch_lang_tensor") or not _interpreter_index_broken(interpreter):
        return False
    original = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index_fixed)

    interpreter._patch_lang_tensor = _patch_lang_tensor
    interpreter._fp16kit_index_patch = True
    return True


# -- torch --------------------------------------------------------------------------------------------------------


def dynamo_traces_any_id(version: str | None = None) -> bool:
    """Can Dynamo trace ``id(x)`` of any object: a torch function handed to a ``TorchFunctionMode`` (``F.linear``, a
    Tensor method called on an intermediate), a param-group dict? torch 2.13 can (a real id, or a fake one for
    sourceless objects); torch 2.11 graph-breaks ("id() with unsupported args"). Where it cannot, autocast reads
    its table by callable while Dynamo traces (``_AutocastModeByFn`` in ``fp16kit/amp/autocast_mode.py``) and
    ``torch.compile`` runs the fused optimizers' ``step`` eagerly (``fp16kit/optim/_base.py``). 2.12 is untested
    and takes the safe path."""
    got = parse(installed_version("torch") if version is None else version)
    return got is not None and got >= (2, 13)


def dynamo_calls_ctx_property_setters(version: str | None = None) -> bool:
    """Does Dynamo, tracing an autograd.Function's forward, run a ``property`` setter of its ``ctx`` class? torch 2.13
    inlines it; torch 2.11 stores the attribute without calling it. Where it does, a Function with
    ``torch.amp.custom_fwd`` called inside an fp16kit region under ``torch.compile`` runs eagerly, so its backward
    re-enters the region (``fp16kit/amp/_torch_custom_fn.py``); where it does not, the compiled backward runs under
    torch's table (docs/autocast.md, "Decorators"). 2.12 is untested and counted with 2.11."""
    got = parse(installed_version("torch") if version is None else version)
    return got is not None and got >= (2, 13)


def inductor_cache_keys_autocast_dtype(version: str | None = None) -> bool:
    """Do Inductor's persistent caches (the FX graph cache and the AOT-autograd cache) key a graph by the autocast
    dtype it was traced under? torch 2.13 does; torch 2.11 does not: a model compiled under
    ``torch.autocast("cpu", torch.float16)`` and then, unchanged, under ``torch.bfloat16`` (in the same process after
    ``torch._dynamo.reset()``, or in a later process) gets the fp16 graph back. This is torch's (plain
    ``torch.autocast`` shows it) and fp16kit's default autocast engine inherits it, since its Dynamo graphs, like
    torch.autocast's, carry no casts. Workaround there: ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` or
    ``TORCHINDUCTOR_AUTOGRAD_CACHE=0`` (docs/compat.md). 2.12 is untested and takes the safe answer."""
    got = parse(installed_version("torch") if version is None else version)
    return got is not None and got >= (2, 13)


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor``, or None on a build without torch.distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - platforms without torch.distributed
        return None
    return DTensor


@functools.cache
def ddp_sync_buffers_arg() -> str:
    """The ``DistributedDataParallel`` argument that turns off the buffer broadcast before each forward: newer
    torch spells it ``forward_sync_buffers``, older ``broadcast_buffers`` (probed on the signature)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
