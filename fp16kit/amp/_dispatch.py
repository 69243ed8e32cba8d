"""The dispatcher engine of ``fp16kit.amp.autocast`` (the default): the policy table applied below Python.

An fp16kit region is ``torch.autocast(device, dtype)`` for CPU (and CUDA when available) plus a *marker*:
``torch.autocast(MARKER, dtype)`` with ``MARKER = "ipu"``. Turning on a device type's autocast takes that device's
autocast dispatch key out of the thread's excluded keys; no CPU or CUDA tensor carries ``AutocastIPU``, but this
module puts it in the thread's *included* keys (:func:`include_key`; harmless while it stays excluded, as torch
keeps every autocast key outside an enabled region). So inside a region, and only there, every op dispatches
through ``AutocastIPU``, where torch registers nothing and this module registers a fallthrough and its kernels.

* torch's own C++ autocast kernels (``AutocastCPU`` / ``AutocastCUDA``) do every op where they agree with fp16kit's
  table (``linear``, ``addmm``, ``mm``, ``conv*``, ``bmm``: LOW on both; the CPU fp32 losses ...): no Python runs.
* For exactly the aten ops whose fp16kit rule differs from torch's kernel on CPU or on CUDA (:func:`live_plan`), a
  Python kernel is registered on ``AutocastIPU``: it applies fp16kit's rule (``autocast_mode.cast_args``, the same
  function the mode engine uses, so the rules and their error messages are written once) and runs the op with
  every autocast key excluded (its internals run as called, as under the mode engine). ``AutocastIPU`` is above
  ``AutocastCPU`` and below ``AutocastCUDA`` in the dispatcher's order: on CPU tensors the kernel replaces torch's;
  on CUDA tensors torch's kernel, where it has one, runs first and the kernel then sees its result (they agree for
  every default row: ``cuda_overrides``). Inside one of torch's autocast kernels (its key is excluded) the kernel
  runs the op as called.
* torch's own autocast keys carry no kernel of ours with the default table, so plain ``torch.autocast`` code pays
  nothing for this engine, before, during (on other threads) or after fp16kit regions. A row the user changes
  against a torch CUDA kernel (:func:`cuda_overrides`) gets a kernel on ``AutocastCUDA`` too (the documented cost).

Which ops differ (:func:`plan`): every aten op an entry of ``policy.RESOLVED`` names (all overloads but ``out=``
ones; ``exp`` also gives ``exp_``), compared with torch's rule for that key, read from the installed torch's
autocast test lists (``_torch_lists``: ``AutocastCPUTestLists`` for CPU, ``AutocastTestLists`` for CUDA) for the
ops that have a kernel there. They agree when the rule is the same and the op is not in-place (torch has no kernel
for in-place forms), or when the op's own type promotion is the PROMOTE row (``cat``, ``stack``). An op with a
torch kernel and no fp16kit row runs as called (the table says absent). torch's CUDA kernels that run an FP32 op
as ``op(x, dtype=float32)`` are taken as agreeing (docs/specs/cast-policy.md allows it). The plan is recomputed on
every change of the table (``policy.add_listener``); kernels, once registered, stay and read the live plan.

Rows without an aten op (Python composites: ``F.normalize``, ``F.softmin``, ``F.interpolate``, user functions)
are applied one level up, by wrappers on ``torch.nn.functional`` (:func:`wrapped_functions`); :func:`composite_rows`
lists them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from . import _torch_lists, policy
from .policy import Rule

__all__ = [
    "MARKER",
    "EagerRegion",
    "Replay",
    "composite_rows",
    "install",
    "installed_ops",
    "plan",
    "region",
    "region_active",
    "replaying",
    "uninstall",
    "wrapped_functions",
]

#: the autocast device type whose enabled state marks an fp16kit region, and the dispatch key it drives: no CPU or
#: CUDA tensor carries it, torch registers no kernel on it, and it sits above ``AutocastCPU`` (below
#: ``AutocastCUDA``) in the dispatcher's order
MARKER = "ipu"
KEY = "AutocastIPU"
_DK = torch._C.DispatchKey
_OWN_DK = getattr(_DK, KEY)
_CUDA = torch.cuda.is_available()
#: dispatch key -> the device type of torch.autocast that drives it
KEYS: dict[str, str] = {"AutocastCPU": "cpu", "AutocastCUDA": "cuda"}
#: a dispatch key's torch lists: (class in autocast_test_lists.py, list attribute -> rule)
_LISTS: dict[str, tuple[str, dict[str, Rule]]] = {
    "AutocastCPU": (
        "AutocastCPUTestLists",
        {"torch_16": Rule.LOW, "nn_16": Rule.LOW, "torch_fp32": Rule.FP32, "nn_fp32": Rule.FP32},
    ),
    "AutocastCUDA": (
        "AutocastTestLists",
        {attr: Rule[rule] for attr, (rule, _spelling) in _torch_lists.LIST_RULES.items() if rule in ("LOW", "FP32")},
    ),
}
# PROMOTE agrees only where native promotion is the row (_NATIVE_PROMOTE): torch's promote kernels raise on fp16 mixed
# with bf16 ("Unexpected floating ScalarType in at::autocast::prioritize"), where fp16kit meets in fp32. BANNED never
# agrees: torch's CUDA kernel always raises, fp16kit only on low-precision inputs.
#: PROMOTE ops whose own type promotion already gives the PROMOTE row's result, bit for bit (a copy of each input
#: in the widest floating dtype, float64 included): where torch has no autocast kernel for them, no kernel of ours
#: either (``cat`` is common: rotary embeddings, KV caches)
_NATIVE_PROMOTE = frozenset({"cat", "stack"})
#: callable ``__name__`` -> aten op, where they differ
_ATEN_NAME = {
    "__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow", "__ipow__": "pow_",
    "cross_entropy": "cross_entropy_loss",
}
#: marker of an op torch has a kernel for and fp16kit's table leaves absent: run it as called
AS_CALLED = (None, False, "")

_Entry = tuple[Any, bool, str]


class _State:
    """What ``cast_args`` reads from the region: its dtype (the marker's, read at call time) and no weight cache
    (torch's own C++ cache serves the LOW ops torch does; fp16kit's overrides cast with ``Tensor.to``)."""

    #: torch's C++ weight cache (``torch.clear_autocast_cache``) is the one in use, so ``cast_all`` never asks this
    #: state for a cached cast, and the region state's ``cache`` (what ``active_mode().cache`` shows) stays empty
    cache_enabled = False
    cache: ClassVar[dict[int, Any]] = {}

    @property
    def dtype(self) -> torch.dtype:
        return torch.get_autocast_dtype(MARKER)

    @property
    def enabled(self) -> bool:
        return torch.is_autocast_enabled(MARKER)


STATE = _State()


class _ReplayDepth(threading.local):
    depth = 0


#: per thread: how many :class:`Replay` blocks are open. Inside one the kernels apply the table although an autograd
#: node is running (the forward code that torch re-runs in backward: checkpoint recomputation, ``custom_bwd``).
_REPLAY = _ReplayDepth()


class Replay:
    """Re-enter a region's marker state (``enabled``, ``dtype``) inside backward, for forward code that torch re-runs
    there (the recomputation of ``torch.utils.checkpoint``) or a backward that runs under its forward's region
    (``custom_bwd``). torch restores its own autocast state for the devices itself; this restores the marker, which
    it does not know, and lets the kernels act although an autograd node is running (they leave the ops of backward
    formulas alone otherwise). Eager only (under ``torch.compile`` recomputation is part of the traced graph)."""

    __slots__ = ("_prev", "_state")

    def __init__(self, enabled: bool, dtype: torch.dtype) -> None:
        self._state = (enabled, dtype)
        self._prev: tuple[bool, torch.dtype] | None = None

    def __enter__(self) -> Replay:
        include_key()
        self._prev = (torch.is_autocast_enabled(MARKER), torch.get_autocast_dtype(MARKER))
        torch.set_autocast_enabled(MARKER, self._state[0])
        torch.set_autocast_dtype(MARKER, self._state[1])
        _REPLAY.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        _REPLAY.depth -= 1
        assert self._prev is not None
        torch.set_autocast_enabled(MARKER, self._prev[0])
        torch.set_autocast_dtype(MARKER, self._prev[1])


def replaying() -> bool:
    """True inside a :class:`Replay` block on this thread."""
    return _REPLAY.depth > 0


@functools.cache
def _aten_ops() -> dict[str, list[str]]:
    """aten base name -> its overload names (``""`` for the default), ``out=`` overloads left out."""
    out: dict[str, list[str]] = {}
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        base, _, overload = full[len("aten::"):].partition(".")
        packet = getattr(torch.ops.aten, base, None)
        if packet is None:
            continue
        try:
            schema = getattr(packet, overload or "default")._schema
        except (AttributeError, RuntimeError):
            continue
        if any(a.is_out for a in schema.arguments):
            continue
        out.setdefault(base, []).append(overload)
    return out


def _aten_bases(fn: Callable[..., Any]) -> list[str]:
    """The aten base names a torch callable reaches directly (``torch.Tensor.exp`` -> exp; ``torch.exp_`` -> exp_)."""
    name = getattr(fn, "__name__", None)
    module = getattr(fn, "__module__", None) or ""
    if not isinstance(name, str) or not (module.startswith("torch") or getattr(fn, "__self__", None) is not None
                                         or isinstance(fn, (type(torch.exp), type(torch.Tensor.exp)))):
        return []
    name = _ATEN_NAME.get(name, name)
    if fn is getattr(torch.linalg, name, None) and not name.startswith("linalg_"):
        name = "linalg_" + name
    return [name] if name in _aten_ops() else []


def composite_rows() -> dict[str, list[str]]:
    """Rows of the live table with a callable that reaches no aten op of its own name: ``{row: [callables]}``.
    This engine does not apply them (their aten constituents run under their own rules)."""
    out: dict[str, list[str]] = {}
    for fn, (_rule, _inplace, row) in policy.RESOLVED.items():
        if not _aten_bases(fn):
            out.setdefault(row, []).append(policy.display_name(fn, repr(fn)))
    return out


_SOURCE_RANK = {"torch": 0, "default": 1, "registered": 2, "override": 3}


def _rank(fn: Any, inplace: bool) -> int:
    """Which callable of a row names an aten op in messages: the Tensor method for in-place forms (``x.exp_()``),
    else the public function (``torch.nn.functional.binary_cross_entropy``, not its ``torch._C._nn`` binding)."""
    qual = policy.display_name(fn, "")
    if qual.startswith("torch.Tensor."):
        return 0 if inplace else 1
    return 2 if qual.startswith("torch._C.") else 1


def _desired() -> dict[str, tuple[_Entry, Any]]:
    """aten ``base.overload`` -> (fp16kit's entry, the callable named in its error messages)."""
    out: dict[str, tuple[_Entry, Any]] = {}
    # Several callables can reach one aten op (F.binary_cross_entropy and torch._C._nn.binary_cross_entropy); when
    # their rules differ (a registration or an override changed one of them) the later source wins, as in the table.
    source = {name: _SOURCE_RANK[info["source"]] for name, info in policy.policy_table().items()}
    ranked = sorted(policy.RESOLVED.items(), key=lambda item: source.get(policy.display_name(item[0], ""), 0))
    for fn, (rule, _inplace, row) in ranked:
        for base in _aten_bases(fn):
            inplace = base.endswith("_")
            for overload in _aten_ops()[base]:
                name = f"{base}.{overload}" if overload else base
                old = out.get(name)
                shown = fn
                if old is not None and old[0][2] == row and _rank(old[1], inplace) <= _rank(fn, inplace):
                    shown = old[1]  # the row's best-known callable names it in error messages
                out[name] = ((rule, inplace, row), shown)
    return out


#: key -> {aten base name: rule} of torch kernels that its autocast test lists leave out (read off
#: aten/src/ATen/autocast_mode.cpp's CPU ``lower_precision_fp`` list; tests/amp/test_dispatch_engine.py checks each
#: against torch's behaviour): without them an op where torch already agrees gets a Python kernel it does not need
#: (scaled_dot_product_attention: one hop per attention call)
_RULES_MISSING_FROM_TEST_LISTS: dict[str, dict[str, Rule]] = {
    "AutocastCPU": {"scaled_dot_product_attention": Rule.LOW, "linalg_vecdot": Rule.LOW, "_convolution": Rule.LOW},
    "AutocastCUDA": {"scaled_dot_product_attention": Rule.LOW},
}


@functools.cache
def _torch_rules(key: str) -> dict[str, Rule]:
    """aten base name -> the rule of torch's kernel on ``key``, from the installed torch's autocast test lists (and
    :data:`_RULES_MISSING_FROM_TEST_LISTS`)."""
    class_name, attrs = _LISTS[key]
    rules: dict[str, Rule] = dict(_RULES_MISSING_FROM_TEST_LISTS[key])
    for attr, names in _torch_lists.torch_cuda_lists(class_name).items():
        rule = attrs.get(attr)
        if rule is None:
            continue
        for name in names:
            rules.setdefault(_ATEN_NAME.get(name, name), rule)
    return rules


def _torch_has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key)


@functools.cache
def _torch_kernel_ops(key: str) -> tuple[str, ...]:
    """The aten ops (``base.overload``) with a non-fallthrough kernel of torch's own on ``key`` (taken before any
    registration of ours)."""
    ops = []
    for base, overloads in _aten_ops().items():
        for overload in overloads:
            name = f"{base}.{overload}" if overload else base
            if _torch_has_kernel(name, key):
                ops.append(name)
    return tuple(ops)


def plan(key: str) -> dict[str, tuple[_Entry, Any]]:
    """The ops whose fp16kit rule differs from torch's kernel on ``key``: ``{"softmax.int": (entry, callable)}``.

    ``entry`` is ``(rule, inplace, row)`` as in ``policy.RESOLVED``, or :data:`AS_CALLED` for an op torch casts
    and fp16kit's table leaves absent."""
    desired = _desired()
    torch_ops = set(_torch_kernel_ops(key))
    rules = _torch_rules(key)
    out: dict[str, tuple[_Entry, Any]] = {}
    for name, (entry, fn) in desired.items():
        base = name.partition(".")[0]
        agrees = (
            name in torch_ops
            and not entry[1]
            and rules.get(base) is entry[0]
        ) or (entry[0] is Rule.PROMOTE and base in _NATIVE_PROMOTE and name not in torch_ops)
        if not agrees:
            out[name] = (entry, fn)
    for name in torch_ops - desired.keys():
        out[name] = (AS_CALLED, None)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------

#: {op: (entry, callable)}: the live plan the registered kernels read (mutated in place on table changes)
_LIVE: dict[str, tuple[_Entry, Any]] = {}
_LIBS: list[torch.library.Library] = []
_REGISTERED: set[str] = set()
#: the same for the kernels on ``AutocastCUDA`` (:func:`cuda_overrides`)
_LIVE_CUDA: dict[str, tuple[_Entry, Any]] = {}
_REGISTERED_CUDA: set[str] = set()
_CAST_ARGS: list[Callable[..., Any]] = []
_FALLBACK: list[torch.library.Library] = []
#: excluded while an overridden op runs under fp16kit's rule: this engine's key and torch's autocast keys, so its
#: internals run as called (as under the mode engine)
_OWN_KEY = torch._C.DispatchKeySet(_OWN_DK)
_ALL_KEYS = _OWN_KEY | torch._C.DispatchKeySet(_DK.AutocastCPU) | torch._C.DispatchKeySet(_DK.AutocastCUDA)
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded


def _make_kernel(name: str) -> Callable[..., Any]:
    base, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, base), overload or "default")
    live = _LIVE
    call = op._op  # what OpOverload.__call__ calls, without its Python frame (this is the hot path)
    cast_args = _CAST_ARGS[0]
    guard = torch._C._ExcludeDispatchKeyGuard
    everything, own = _ALL_KEYS, _OWN_KEY
    inside_torch_kernel, cpu_key, cuda_key, cuda = _excluded, _DK.AutocastCPU, _DK.AutocastCUDA, _CUDA
    backward_node, replay = torch._C._current_autograd_node, _REPLAY

    def kernel(*args: Any, **kwargs: Any) -> Any:
        # Reached only inside an fp16kit region: the key is dispatched through only while the region's marker
        # autocast state is on (see the module docstring). Inside one of torch's autocast kernels (its key is then
        # excluded: torch's kernel cast the inputs of the op it handles and runs its internals) the op runs as
        # called, as the internals of any table op do.
        hit = live.get(name)
        if (
            hit is not None
            # the policy is not applied in backward (eager, or traced by AOT autograd), except where a forward is
            # re-run inside it under its own region (checkpoint recomputation, custom_bwd: ``Replay``)
            and (backward_node() is None or replay.depth)
            and not inside_torch_kernel(cpu_key)
            and (not cuda or not inside_torch_kernel(cuda_key))
        ):
            entry, fn = hit
            if entry is not AS_CALLED:
                args, kwargs = cast_args(STATE, entry, fn, args, kwargs)
            with guard(everything):
                return call(*args, **kwargs)
        # the op agrees with torch again (the table changed): torch's kernels below this key decide
        with guard(own):
            return call(*args, **kwargs)

    return kernel


# ----------------------------------------------------------------------------------------------------------------
# Python-level rows: the functions of torch.nn.functional the engine wraps
# ----------------------------------------------------------------------------------------------------------------

#: (owner, attribute name) -> the original function, for each function wrapped by :func:`_wrap_functional`
_WRAPPED: dict[tuple[Any, str], Callable[..., Any]] = {}
#: id(original function) -> its live row ``(rule, inplace, row)``, or :data:`AS_CALLED` for the native operators
_FUNCTIONAL_ROWS: dict[int, Any] = {}
#: Python operators of ``torch.Tensor`` that follow torch's native type promotion under autocast (as the mode engine
#: runs them) but whose body reaches a table op: ``2 / x`` is ``x.reciprocal() * 2``, and ``reciprocal`` is an FP32
#: row, so through the aten ops ``2 / x`` would come back in fp32. They are wrapped to run with nothing cast.
_NATIVE_OPERATORS = ("__rdiv__", "__rtruediv__")
_is_compiling = torch.compiler.is_compiling


def _functional_rows() -> list[Callable[..., Any]]:
    """The rows of the live table to apply at the Python level: Python functions of ``torch.nn.functional`` (what
    ``nn`` modules call, by attribute) that either reach no aten op of their own name (composites: ``F.interpolate``,
    ``F.local_response_norm``; the aten level cannot give the row's dtype and bits) or whose aten op has an override
    kernel on some key (``F.layer_norm``, ``F.softmax``: the call would cost a C++ -> Python hop there, 5-25 us in a
    model's forward, where the wrapper costs one Python call)."""
    F = torch.nn.functional
    overridden = {name.partition(".")[0] for name, (entry, _fn) in _LIVE.items() if entry is not AS_CALLED}
    out = []
    for fn in policy.RESOLVED:
        name = getattr(fn, "__name__", None)
        if not isinstance(fn, types.FunctionType) or not isinstance(name, str):
            continue
        current = getattr(F, name, None)
        if getattr(current, "__fp16kit_wrapped__", current) is not fn:
            continue
        bases = _aten_bases(fn)
        if not bases or any(base in overridden for base in bases):
            out.append(fn)
    return out


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Torch's autocast off on the engine's devices and the marker off: under ``torch.compile`` the traceable form of
    excluding the autocast keys (the engine's among them), so that a wrapped function's internals run as called there
    too."""
    with torch.autocast("cpu", enabled=False), torch.autocast(MARKER, enabled=False):
        if _CUDA:
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


def _functional_wrapper(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under its live row inside an fp16kit region: the inputs cast by ``cast_args`` (as the mode engine does
    for this callable), then ``fn`` run with torch's autocast keys excluded (eager) or its autocast off (compiled, which
    Dynamo traces), so its internals run as called and no override kernel is hopped through. Outside a region, in a
    disabled one, or inside another wrapped function's call (its internals run as called, wrapped functions among
    them, as under the mode engine), ``fn`` runs as called. The row is read from :data:`_FUNCTIONAL_ROWS` by ``id``:
    under compile Dynamo then guards one int key (the mode engine's ``_DISPATCH`` does the same, for the same
    reason).

    TorchScript: ``torch.jit.script`` compiles a function it meets from its source (``inspect`` follows
    ``__wrapped__`` to ``fn``'s) and resolves the source's free names in the function's globals and closure. So the
    wrapper is made with ``fn``'s globals, and its body reads only the closure variables below, named ``_fp16kit_*``,
    which no torch source uses: scripting then compiles ``fn`` itself, as it would without the engine."""
    _fp16kit_fn = fn
    _fp16kit_cast_args = _CAST_ARGS[0]
    _fp16kit_rows, _fp16kit_key, _fp16kit_state = _FUNCTIONAL_ROWS, id(fn), STATE
    _fp16kit_enabled, _fp16kit_marker, _fp16kit_compiling = torch.is_autocast_enabled, MARKER, _is_compiling
    _fp16kit_off, _fp16kit_guard, _fp16kit_keys = _autocast_off, torch._C._ExcludeDispatchKeyGuard, _ALL_KEYS
    _fp16kit_excluded, _fp16kit_cpu_key = torch._C._dispatch_tls_is_dispatch_key_excluded, _DK.AutocastCPU
    _fp16kit_as_called = AS_CALLED

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # an fp16kit region turns CPU autocast on with the marker; inside a wrapped call it is off (compiled) or its
        # key excluded (eager)
        if _fp16kit_enabled(_fp16kit_marker) and _fp16kit_enabled("cpu"):
            entry = _fp16kit_rows.get(_fp16kit_key)
            if entry is not None:
                if _fp16kit_compiling():
                    if entry is not _fp16kit_as_called:
                        args, kwargs = _fp16kit_cast_args(_fp16kit_state, entry, _fp16kit_fn, args, kwargs)
                    with _fp16kit_off():
                        return _fp16kit_fn(*args, **kwargs)
                if not _fp16kit_excluded(_fp16kit_cpu_key):
                    if entry is not _fp16kit_as_called:
                        args, kwargs = _fp16kit_cast_args(_fp16kit_state, entry, _fp16kit_fn, args, kwargs)
                    with _fp16kit_guard(_fp16kit_keys):
                        return _fp16kit_fn(*args, **kwargs)
        return _fp16kit_fn(*args, **kwargs)

    made = types.FunctionType(wrapper.__code__, fn.__globals__, fn.__name__, None, wrapper.__closure__)
    functools.update_wrapper(made, fn)
    made.__fp16kit_wrapped__ = fn  # type: ignore[attr-defined]
    return made


def _wrap_functional() -> None:
    """Wrap the functions :func:`_functional_rows` names and the :data:`_NATIVE_OPERATORS` (once each), and refresh
    the rows the wrappers read."""
    targets = [(torch.nn.functional, fn.__name__, fn) for fn in _functional_rows()]
    targets += [(torch.Tensor, name, getattr(torch.Tensor, name)) for name in _NATIVE_OPERATORS
                if isinstance(getattr(torch.Tensor, name, None), types.FunctionType)]
    for owner, name, fn in targets:
        if (owner, name) not in _WRAPPED:
            fn = getattr(fn, "__fp16kit_wrapped__", fn)
            _WRAPPED[owner, name] = fn
            setattr(owner, name, _functional_wrapper(fn))
    _FUNCTIONAL_ROWS.clear()
    for (owner, _name), fn in _WRAPPED.items():
        if owner is torch.Tensor:
            _FUNCTIONAL_ROWS[id(fn)] = AS_CALLED
        elif fn in policy.RESOLVED:
            _FUNCTIONAL_ROWS[id(fn)] = policy.RESOLVED[fn]


def _unwrap_functional() -> None:
    """Put the original functions back (where the attribute is still our wrapper).

    Dynamo resolves the qualified names of torch's functions once and caches which objects are torch functions
    (``get_torch_obj_rule_map`` in ``torch/_dynamo/trace_rules.py``). Built while the wrappers were installed (a
    running ``torch.utils.checkpoint`` builds it, for one), the cache no longer knows the originals put back
    here: Dynamo would trace into them as user code and never hand them to the mode engine's ``TorchFunctionMode``
    (their rows then missed under ``torch.compile`` after ``set_engine("mode")``). So the cache is cleared."""
    for (owner, name), fn in _WRAPPED.items():
        if getattr(getattr(owner, name, None), "__fp16kit_wrapped__", None) is fn:
            setattr(owner, name, fn)
    if _WRAPPED:
        clear = getattr(sys.modules.get("torch._dynamo.trace_rules"), "clear_lru_cache", None)
        if clear is not None:  # only once Dynamo was imported; a torch without it keeps its cache
            clear()
    _WRAPPED.clear()
    _FUNCTIONAL_ROWS.clear()


def wrapped_functions() -> list[str]:
    """The qualified names this engine has wrapped (``torch.nn.functional.layer_norm``, ``torch.Tensor.__rdiv__``...;
    empty before :func:`install`)."""
    return sorted(f"{_OWNER_NAMES[owner]}.{name}" for owner, name in _WRAPPED)


_OWNER_NAMES = {torch.nn.functional: "torch.nn.functional", torch.Tensor: "torch.Tensor"}


def cuda_overrides(cuda_plan: dict[str, tuple[_Entry, Any]] | None = None) -> dict[str, tuple[_Entry, Any]]:
    """The ops whose torch CUDA kernel (which runs before this engine's key on CUDA tensors) would pre-empt a row
    the user changed (``register_*_function``, ``policy_override``) to differ from it: they get a kernel on
    ``AutocastCUDA`` itself, which plain ``torch.autocast`` CUDA code then pays for (a Python call per op).
    With the default table this is empty: where the default rows differ from torch's CUDA kernels (PROMOTE ops,
    ``binary_cross_entropy``, the fp32 ops torch runs with ``dtype=``, upsampling) torch's kernel goes the same way
    (docs/autocast.md, "Where the default table differs from torch"). ``cuda_plan``: ``plan("AutocastCUDA")``,
    when the caller has it already."""
    torch_ops = set(_torch_kernel_ops("AutocastCUDA"))
    sources = {name: info["source"] for name, info in policy.policy_table().items()}
    return {
        name: hit for name, hit in (plan("AutocastCUDA") if cuda_plan is None else cuda_plan).items()
        if name in torch_ops and hit[0] is not AS_CALLED
        and sources.get(policy.display_name(hit[1], ""), "default") in ("registered", "override")
    }


def _make_cuda_kernel(name: str) -> Callable[..., Any]:
    """A kernel on ``AutocastCUDA`` for a user-changed row: fp16kit's rule inside a region, torch's kernel outside."""
    base, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, base), overload or "default")
    torch_kernel = torch.library.get_kernel(op, "AutocastCUDA")
    live, call, cast_args, guard = _LIVE_CUDA, op._op, _CAST_ARGS[0], torch._C._ExcludeDispatchKeyGuard
    enabled, everything, backward_node = torch.is_autocast_enabled, _ALL_KEYS, torch._C._current_autograd_node
    replay = _REPLAY

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        hit = live.get(name)
        if hit is not None and enabled(MARKER) and (backward_node() is None or replay.depth):
            entry, fn = hit
            args, kwargs = cast_args(STATE, entry, fn, args, kwargs)
            with guard(everything):
                return call(*args, **kwargs)
        return torch_kernel.call_boxed(keyset, *args, **kwargs)

    return kernel


def live_plan(plans: dict[str, dict[str, tuple[_Entry, Any]]] | None = None) -> dict[str, tuple[_Entry, Any]]:
    """The ops this engine overrides: those whose fp16kit rule differs from torch's kernel on CPU or on CUDA
    (:func:`plan` of each key; ``plans`` when the caller has them already), with fp16kit's entry. One kernel on
    :data:`KEY` serves both devices: on a CPU tensor it runs before torch's CPU kernel and instead of it; on a CUDA
    tensor it runs after torch's CUDA kernel, where one exists (that kernel is higher in the dispatcher's order),
    and then agrees with it or refines it."""
    out: dict[str, tuple[_Entry, Any]] = {}
    for key in KEYS:
        # an op's entry is the same in both plans: fp16kit's, or AS_CALLED where it has none
        out.update(plan(key) if plans is None else plans[key])
    return out


def _register(names: set[str], make: Callable[[str], Callable[..., Any]], key: str, registered: set[str],
              with_keyset: bool) -> None:
    """Register ``make(name)`` on ``key`` for each name not yet in ``registered`` (and record it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        for name in names - registered:
            _LIBS[0].impl(name, make(name), key, with_keyset=with_keyset)
            registered.add(name)


def _refresh() -> None:
    """Recompute the plan, register kernels for ops that gained an override, and wrap the Python-level rows that
    need it."""
    if not _CAST_ARGS:
        return
    plans = {key: plan(key) for key in KEYS}  # each once: the live plan and the CUDA overrides both read them
    new = live_plan(plans)
    cuda = cuda_overrides(plans["AutocastCUDA"])
    if not _LIBS:
        _LIBS.append(torch.library.Library("aten", "IMPL"))
    _register(set(new), _make_kernel, KEY, _REGISTERED, with_keyset=False)
    _LIVE.clear()
    _LIVE.update(new)
    _register(set(cuda), _make_cuda_kernel, "AutocastCUDA", _REGISTERED_CUDA, with_keyset=True)
    _LIVE_CUDA.clear()
    _LIVE_CUDA.update(cuda)
    _wrap_functional()


_LISTENING: list[bool] = []
_include = torch._C._dispatch_tls_set_dispatch_key_included
_included = torch._C._dispatch_tls_is_dispatch_key_included


def include_key() -> None:
    """Put :data:`KEY` in this thread's included dispatch keys (idempotent). Harmless outside regions: torch keeps
    every autocast key in the default *excluded* set, and only an enabled ``torch.autocast(MARKER)`` (a region of
    this engine) takes it out."""
    if not _included(_OWN_DK):
        _include(_OWN_DK, True)


def install(cast_args: Callable[..., Any]) -> None:
    """Register the override kernels (once; later calls do nothing). ``cast_args`` is
    ``autocast_mode.cast_args``, handed in so that this module does not import the mode engine."""
    if not _is_compiling():
        include_key()
    if _CAST_ARGS:
        return
    if torch._C._get_privateuse1_backend_name() == "ipu" or _torch_kernel_ops(KEY):
        raise RuntimeError(
            f"fp16kit's dispatcher engine drives the {KEY} dispatch key, which a backend in this process uses. "
            "Use the mode engine: FP16KIT_AUTOCAST_ENGINE=mode (or fp16kit.amp.autocast_mode.set_engine('mode'))."
        )
    if not _FALLBACK:
        # torch registers no fallback on this key (no IPU backend in core): ops without a kernel of ours fall
        # through it, as on torch's own autocast keys
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(torch.library.fallthrough_kernel, KEY)
        _FALLBACK.append(fallback)
    for key in KEYS:
        _torch_kernel_ops(key)  # read torch's kernels before ours replace any
    _CAST_ARGS.append(cast_args)
    if _LISTENING:
        _refresh()
    else:
        _LISTENING.append(True)
        policy.add_listener(_refresh)  # calls it now


def uninstall() -> None:
    """Remove every override kernel and wrapper (they only ever act inside a region of this engine). The next
    region of this engine installs them again."""
    _unwrap_functional()
    for lib in _LIBS:
        lib._destroy()
    _LIBS.clear()
    _REGISTERED.clear()
    _LIVE.clear()
    _REGISTERED_CUDA.clear()
    _LIVE_CUDA.clear()
    _CAST_ARGS.clear()


def installed_ops(key: str = "AutocastCPU") -> dict[str, tuple[_Entry, Any]]:
    """The live overrides that differ from torch's kernel on ``key`` (empty before :func:`install`)."""
    differ = plan(key) if _CAST_ARGS else {}
    return {name: hit for name, hit in _LIVE.items() if name in differ}


@contextlib.contextmanager
def region(dtype: torch.dtype, enabled: bool = True, cache_enabled: bool = True) -> Iterator[None]:
    """An fp16kit region of this engine: ``torch.autocast`` on CPU (and CUDA when available) plus the marker.
    A generator context manager of plain ``with`` blocks, so Dynamo traces it inside compiled code."""
    with (
        torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled),
        torch.autocast(MARKER, dtype=dtype, enabled=enabled),
    ):
        if _CUDA:
            with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
                yield
        else:
            yield


_DEVICES = ("cpu", "cuda", MARKER) if _CUDA else ("cpu", MARKER)


class EagerRegion:
    """:func:`region`'s state changes made directly (what ``torch.autocast.__enter__``/``__exit__`` do for each
    device, without building three context managers): ~3 us per region instead of ~8. Eager only: under
    ``torch.compile`` (or when a torch-function mode is active, e.g. ``torch.export``'s pre-dispatch tracing, to
    which ``torch.autocast`` reports itself) the caller uses :func:`region`, which Dynamo traces."""

    __slots__ = ("_prev",)

    def __init__(self, dtype: torch.dtype, enabled: bool, cache_enabled: bool) -> None:
        prev = [torch.is_autocast_cache_enabled()]
        for device in _DEVICES:
            prev.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
            torch.autocast_increment_nesting()
        torch.set_autocast_cache_enabled(cache_enabled)
        self._prev = prev

    def __exit__(self, *exc: object) -> None:
        prev = self._prev
        for device, enabled, dtype in reversed(prev[1:]):
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()  # leaving the outermost autocast region, as torch.autocast does
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(prev[0])


def region_active() -> bool:
    """True inside an enabled fp16kit region of this engine."""
    return torch.is_autocast_enabled(MARKER)
