"""Bytecode tooling behind autocast: pass-through copies of torch's Python composite functions.

torch's Python composites (``F.multi_head_attention_forward``, ``F.embedding``...) first ask
``has_torch_function*(...)`` and, under a ``TorchFunctionMode``, hand the whole call to the mode. An op that is
absent from the cast policy table but whose body reaches a table op must still have those inner ops cast (torch's
autocast works at the aten level, which has that effect). So autocast runs such a composite through a *copy* whose
``has_torch_function*`` globals answer False: the body runs with the mode still pushed and each inner op is seen.

What this module reads and rebuilds is torch's own Python source as CPython compiled it: the names a function's
code loads (``co_names``), its binary-operator instructions (``dis``), its globals and its closure. Those are
internals of a given torch release, so the tooling is enabled only on the torch versions it was checked against
(:data:`SUPPORTED_TORCH`: fp16kit's tested range, ``fp16kit._versions.TORCH_RANGE``, which ``pyproject.toml``
requires). On any other torch it disables itself: autocast still applies every row of the table, and absent
composites run as called (their inner ops are not cast). That torch already got one
:class:`UnsupportedTorchWarning` when fp16kit was imported; the tooling warns itself only about a torch that
import did not warn about (e.g. one whose version changed since). ``FP16KIT_AMP_BYTECODE=force`` enables it
anyway (at your own risk, e.g. to test a new torch); ``FP16KIT_AMP_BYTECODE=off`` disables it on any torch.
"""

from __future__ import annotations

import dis
import os
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _versions

__all__ = [
    "SUPPORTED_TORCH",
    "UnsupportedTorchWarning",
    "enabled",
    "passthrough_copies",
    "reach",
    "super_redirects",
    "torch_version_problem",
]

#: ``(lowest, first unsupported)`` torch ``(major, minor)`` the tooling was checked against: fp16kit's tested range.
SUPPORTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = _versions.TORCH_RANGE
_ENV = "FP16KIT_AMP_BYTECODE"
_HTF_NAMES = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


#: The installed torch is outside :data:`SUPPORTED_TORCH` (the pass-through copies are disabled): the warning
#: ``import fp16kit`` gives for a torch outside the tested range.
UnsupportedTorchWarning = _versions.UnsupportedVersionWarning


def torch_version_problem(version: str | None = None) -> str | None:
    """Why the tooling cannot run on torch ``version`` (default: the installed one), or None when it can."""
    version = torch.__version__ if version is None else version
    got = _versions.parse(version)
    if got is None:
        return f"cannot read the torch version {version!r}"
    lo, hi = SUPPORTED_TORCH
    if not lo <= got < hi:
        return f"torch {version} is outside the checked range {lo[0]}.{lo[1]} <= torch < {hi[0]}.{hi[1]}"
    missing = [n for n in _HTF_NAMES if not callable(getattr(torch.overrides, n, None))]
    if missing:
        return f"torch {version} has no torch.overrides.{missing[0]}"
    return None


def enabled(version: str | None = None) -> bool:
    """Whether autocast may use the pass-through copies; warns once per call site when it may not."""
    setting = os.environ.get(_ENV, "").strip().lower()
    if setting == "off":
        return False
    problem = torch_version_problem(version)
    if problem is None or setting == "force":
        return True
    if version is None and _versions.WARNED.get("torch") == torch.__version__ and "outside" in problem:
        return False  # import fp16kit warned about this torch already (one message)
    warnings.warn(
        f"fp16kit.amp: {problem}, so autocast does not look inside torch's Python composite functions that are "
        f"absent from the cast policy (e.g. F.multi_head_attention_forward): they run as called and their inner "
        f"ops are not cast; every op of the table still is. Install a torch in that range, or set {_ENV}=force "
        f"to enable it anyway.",
        UnsupportedTorchWarning,
        stacklevel=2,
    )
    return False


def _never(*_args: Any) -> bool:
    return False


def _copy(fn: Any, htf_objs: tuple[Any, ...], patched_globals: dict[int, dict[str, Any]]) -> Callable[..., Any] | None:
    """A copy of ``fn`` whose ``has_torch_function*`` globals are ``False``, or None when not applicable."""
    if not isinstance(fn, types.FunctionType) or fn.__module__ == "torch._tensor":
        # Tensor's Python methods are thin wrappers over one C method (nothing inside for the policy to see),
        # and several use zero-argument super(), which Dynamo cannot trace in a copy.
        return None
    code, glb = fn.__code__, fn.__globals__
    used = [n for n in _HTF_NAMES if n in code.co_names]
    # Only when every check the function makes goes through a patched global; anything else (an attribute
    # access such as torch.overrides.has_torch_function) would re-dispatch to the mode forever.
    if not used or any(glb.get(n) is not o for n, o in zip(_HTF_NAMES, htf_objs) if n in used):
        return None
    if "overrides" in code.co_names or ("_C" in code.co_names and "_has_torch_function" in code.co_names):
        return None
    patched = patched_globals.get(id(glb))
    if patched is None:
        patched = dict(glb)  # snapshot of the module's globals (torch internals are not re-bound at runtime)
        patched.update(dict.fromkeys(_HTF_NAMES, _never))
        patched_globals[id(glb)] = patched
    copy = types.FunctionType(code, patched, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def passthrough_copies(fns: Iterable[Any]) -> dict[Any, Callable[..., Any]]:
    """``{fn: pass-through copy}`` for the Python composites among ``fns``; ``{}`` when :func:`enabled` is False."""
    if not enabled():
        return {}
    htf_objs = tuple(getattr(torch.overrides, n) for n in _HTF_NAMES)
    patched_globals: dict[int, dict[str, Any]] = {}  # one patched globals dict per torch module
    out: dict[Any, Callable[..., Any]] = {}
    for fn in fns:
        copy = _copy(fn, htf_objs, patched_globals)
        if copy is not None:
            out[fn] = copy
    return out


def _code_facts(code: types.CodeType) -> tuple[set[str], bool]:
    """Names a code object (and the code nested in it) loads, and whether it applies a binary operator."""
    names = set(code.co_names)
    binop = any(
        ins.opname.startswith(("BINARY_", "INPLACE_")) and ins.opname not in ("BINARY_SUBSCR", "BINARY_SLICE")
        for ins in dis.get_instructions(code)
    )
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            inner, inner_binop = _code_facts(const)
            names |= inner
            binop = binop or inner_binop
    return names, binop


def reach(fn: types.FunctionType, depth: int = 3) -> tuple[frozenset[str], bool]:
    """Names loaded by ``fn`` and by the Python helpers of its module it calls (a few levels deep), and whether
    any of them applies a binary operator (``a + b`` on tensors is a PROMOTE op)."""
    names, binop = _code_facts(fn.__code__)
    out = set(names)
    if depth:
        for n in names:
            g = fn.__globals__.get(n)
            # helpers of the same module (F._in_projection_packed); not the torch-function machinery itself
            if isinstance(g, types.FunctionType) and g is not fn and g.__module__ == fn.__module__:
                inner, inner_binop = reach(g, depth - 1)
                out |= inner
                binop = binop or inner_binop
    return frozenset(out), binop


def super_redirects() -> dict[str, Callable[..., Any]]:
    """``Tensor`` Python methods that call zero-argument ``super()`` -> the in-graph torch function of that name.

    E.g. ``Tensor.unflatten`` -> ``torch.unflatten`` (torch 2.13: Dynamo fails on ``super().unflatten`` under a
    mode). Keyed by name: Dynamo hands such methods to the mode as a different variable than a dict key.
    """
    out: dict[str, Callable[..., Any]] = {}
    for fn in vars(torch.Tensor).values():
        if isinstance(fn, types.FunctionType) and "super" in fn.__code__.co_names:
            base = getattr(torch, fn.__name__, None)  # torch.unflatten(input, dim, sizes): an in-graph op
            if base is not None:
                out[fn.__name__] = base
    return out
