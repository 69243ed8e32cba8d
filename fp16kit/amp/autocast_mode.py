"""``fp16kit.amp.autocast``: the one module that applies the cast policy table (docs/specs/cast-policy.md).

The table itself is data in :mod:`fp16kit.amp.policy`; this module subscribes to it (``policy.add_listener``)
and is the only place that casts. Its sibling modules reach the mechanism through the public names below
(:func:`active_mode`, :func:`cast_all`, :func:`cast_args`, :func:`rule_wrapper`, :func:`table_wrapper`).

Two engines apply the table (docs/autocast.md, "Two engines, one table"): the dispatcher engine of
:mod:`fp16kit.amp._dispatch` (``"dispatch"``, the default: torch's C++ autocast plus ``torch.library`` kernels on a
dispatch key of fp16kit's own for the ops where the table differs from torch) and this module's
``TorchFunctionMode`` (``"mode"``), chosen by ``FP16KIT_AUTOCAST_ENGINE`` or :func:`set_engine`. Both share
:func:`cast_args`, so each rule and its error messages are written once.

Mechanism of the mode engine: one :class:`torch.overrides.TorchFunctionMode` per thread, pushed by the outermost
active region. Every torch function, Tensor method and operator reaches its ``__torch_function__``; the op's row is
found with one dict lookup (``_DISPATCH``, built from ``policy.RESOLVED``) and the eligible inputs are cast with
``Tensor.to`` (a differentiable op, so gradients come back in each input's own dtype). The op itself then runs
with the mode popped, exactly as if the user had cast the inputs by hand and called it with casting disabled,
which is what makes the result bit-identical to that manual cast. Nested regions do not stack modes: they
change the one mode's state (dtype, enabled, cache) and restore it on exit, so the innermost region wins.

Eligibility (docs/specs/cast-policy.md): floating tensors only (integer/bool/complex pass through); float64 never
cast; lists/tuples are searched (``torch.cat([a, b])``); ``dtype=``/``out=`` means "run as called"; in-place ops
cast their other arguments to ``self``'s dtype, and an FP32 in-place op on an fp16/bf16 tensor raises.

Python-level composite torch functions that are *absent* from the table but whose body can reach a table op
(``F.multi_head_attention_forward``, ``F.embedding``...) are run through a copy whose ``has_torch_function*``
globals answer False, with the mode still pushed, so the ops inside them are seen by the policy (torch's
autocast works at the aten level, which has the same effect). Composites that cannot reach one (``F.relu``,
``F.dropout``) are simply called; the set is recomputed whenever the table changes. Ops in the table are never
entered: an FP32 ``F.cross_entropy`` casts its inputs once and its internals run as called. The copies are made
by :mod:`fp16kit.amp._bytecode`, which checks the torch version first (on an unchecked torch it warns and makes
none: absent composites then run as called).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from .. import _versions
from . import _bytecode, _dispatch, _nesting, _recompute, _threads, _torch_custom_fn, policy
from .policy import Rule

__all__ = [
    "AutocastDisabledWarning",
    "CompiledCheckpointWarning",
    "DataParallelRegionWarning",
    "autocast",
    "call_eagerly",
    "disable_casts",
    "engine",
    "is_autocast_enabled",
    "region_state",
    "replay",
    "set_engine",
    "torch_region_enter",
    "torch_region_exit",
    "traced_inside_a_region",
    "use_engine",
]

_T = TypeVar("_T", bound=Callable[..., Any])

_F64 = torch.float64
_F32 = torch.float32
_LOW_DTYPES = frozenset({torch.float16, torch.bfloat16})
#: eligible for a cast: floating point, not float64 (fp8 formats included, as in torch.autocast). The hot path tests
#: ``dt.is_floating_point and dt is not _F64``, the same set: a dtype property Dynamo folds with no guard, where a
#: set membership test is one ``SET_CONTAINS`` guard per test, evaluated on every compiled call.
_CASTABLE = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64
)
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_LOW, _FP32, _PROMOTE, _BANNED = Rule.LOW, Rule.FP32, Rule.PROMOTE, Rule.BANNED
_Tensor = torch.Tensor
_tls = threading.local()
_NO_KWARGS: dict[str, Any] = {}  # shared, never mutated

#: the engines that can apply the table: "dispatch" (the default: override kernels on a dispatch key of fp16kit's
#: own, ``_dispatch``) or "mode" (a TorchFunctionMode, this module). Chosen by FP16KIT_AUTOCAST_ENGINE, or by
#: :func:`set_engine`.
ENGINES = ("mode", "dispatch")
_engine = [os.environ.get("FP16KIT_AUTOCAST_ENGINE", "dispatch").strip().lower() or "dispatch"]
if _engine[0] not in ENGINES:
    raise ValueError(f"FP16KIT_AUTOCAST_ENGINE={_engine[0]!r}: use one of {ENGINES}.")


def engine() -> str:
    """The engine new regions use: ``"mode"`` or ``"dispatch"`` (see docs/autocast.md, "The dispatcher engine")."""
    return _engine[0]


def set_engine(name: str) -> None:
    """Select the engine of regions entered from now on (``"mode"`` or ``"dispatch"``); not inside a region.
    Leaving the dispatcher engine uninstalls it (its kernels and ``torch.nn.functional`` wrappers), so that the mode
    engine does not meet them."""
    if name not in ENGINES:
        raise ValueError(f"set_engine({name!r}): use one of {ENGINES}.")
    if getattr(_tls, "depth", 0) or getattr(_tls, "mode", None) is not None:
        raise RuntimeError("set_engine: cannot switch engines inside an autocast region; leave it first.")
    if name != "dispatch":
        _dispatch.uninstall()
    _engine[0] = name


@contextlib.contextmanager
def use_engine(name: str) -> Iterator[None]:
    """:func:`set_engine` for a ``with`` block, the previous engine selected again on exit (not inside a region)."""
    before = _engine[0]
    set_engine(name)
    try:
        yield
    finally:
        set_engine(before)


# ----------------------------------------------------------------------------------------------------------------
# Pass-through copies of Python composite torch functions (see module docstring; the bytecode work is _bytecode's)
# ----------------------------------------------------------------------------------------------------------------

_PASSTHROUGH = _bytecode.passthrough_copies(policy.overridable())
# Composite -> what its body can reach. A composite only needs the (slower) pass-through when its body can reach
# an op of the table, by name or through an operator; F.relu or F.dropout cannot, and are simply run.
_REACH = {fn: _bytecode.reach(fn) for fn in _PASSTHROUGH}
# e.g. Tensor.unflatten -> torch.unflatten (see _bytecode.super_redirects)
_REDIRECTS = _bytecode.super_redirects()
_is_compiling = torch.compiler.is_compiling

#: id(callable) -> (rule, inplace, row) for table ops, or a pass-through copy for absent composites. The hot path
#: is one ``get`` on this dict; rebuilt (in place) whenever the table changes. Keyed by id, not by the callable:
#: under torch.compile Dynamo then guards the one int key it reads, instead of every key of a dict of functions
#: (measured: ~900 guard lines and ~16 us per compiled call). The callables stay alive in policy.RESOLVED and
#: _PASSTHROUGH, so their ids are stable.
_DISPATCH: dict[int, Any] = {}
#: The same entries keyed by the callables: read only while Dynamo traces on a torch whose Dynamo cannot trace
#: ``id()`` of a torch function (``_versions.dynamo_traces_any_id``; torch < 2.13). Dynamo guards
#: its keys there (slower compiled calls, the same casts).
_DISPATCH_BY_FN: dict[Any, Any] = {}
#: ``__name__`` -> (rule, inplace, row) for the names that identify their rule: every overridable callable with that
#: name has the same (rule, inplace) and none is an absent composite. Used under torch.compile only, where Dynamo
#: hands Tensor methods called on intermediates and Python operators (``h.exp()``, ``x @ y``) to the mode as
#: *sourceless* variables whose ``id()`` it cannot know (a fake id that misses ``_DISPATCH``), but whose
#: ``__name__`` it folds to a constant.
_BY_NAME: dict[str, Any] = {}


def _rebuild_by_name() -> None:
    seen: dict[str, Any] = {}
    ambiguous: set[str] = set()
    for fn in set(policy.overridable()) | set(policy.RESOLVED):
        name = getattr(fn, "__name__", None)
        if not isinstance(name, str):
            continue
        entry = _DISPATCH.get(id(fn))
        key = entry[:2] if entry.__class__ is tuple else entry  # absent (None) or a pass-through copy
        if name in seen and seen[name][0] != key:
            ambiguous.add(name)
        seen.setdefault(name, (key, entry))
    _BY_NAME.clear()
    _BY_NAME.update(
        (name, entry) for name, (key, entry) in seen.items() if name not in ambiguous and key.__class__ is tuple
    )


def _rebuild_dispatch() -> None:
    interest = {getattr(fn, "__name__", None) for fn in policy.RESOLVED}
    merged: dict[int, Any] = {
        id(fn): copy
        for fn, copy in _PASSTHROUGH.items()
        if _REACH[fn][1] or not _REACH[fn][0].isdisjoint(interest)
    }
    merged.update((id(fn), entry) for fn, entry in policy.RESOLVED.items())  # a table row wins
    _DISPATCH.clear()
    _DISPATCH.update(merged)
    by_fn = {fn: copy for fn, copy in _PASSTHROUGH.items() if id(fn) in merged}
    by_fn.update(policy.RESOLVED)
    _DISPATCH_BY_FN.clear()
    _DISPATCH_BY_FN.update(by_fn)
    _rebuild_by_name()


policy.add_listener(_rebuild_dispatch)  # calls it once now, then after every change of the table


def _if_tree(var: str, items: list[tuple[Any, str]], depth: int) -> list[str]:
    """Source lines returning the expression of the item whose key equals ``var`` (items sorted by key): a
    balanced tree of comparisons, so Dynamo traces ~log2(n) of them per lookup."""
    pad = "    " * depth
    if len(items) <= 3:
        return [f"{pad}if {var} == {key!r}: return {expr}" for key, expr in items]
    mid = len(items) // 2
    lower, upper = _if_tree(var, items[:mid], depth + 1), _if_tree(var, items[mid:], depth)
    return [f"{pad}if {var} < {items[mid][0]!r}:", *lower, *upper]


def _build_compiled_lookups() -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``(row, redirect)``: ``row(name)`` is ``_BY_NAME.get(name)`` and ``redirect(name)`` is ``_REDIRECTS.get(name)``,
    as generated code.

    Used while Dynamo traces (``_AutocastMode._compiled``). Reading the dicts themselves there makes Dynamo guard
    them key by key, all guards evaluated on every call of the compiled function (measured on a
    TransformerEncoderLayer: 370 guards against torch.autocast's 190, among them ``DICT_KEYS_MATCH`` on the
    137-key ``_BY_NAME``; 317 with these functions). Their keys and rows are constants in the code, which Dynamo
    does not guard. They are rebuilt on every change of the table, so the new function objects fail the guards on
    the globals and the next call recompiles.
    """
    ns: dict[str, Any] = {f"_{r.name}": r for r in Rule}
    rows = sorted((name, f"(_{rule.name}, {inplace!r}, {row!r})") for name, (rule, inplace, row) in _BY_NAME.items())
    redirects = []
    for i, (name, target) in enumerate(sorted(_REDIRECTS.items())):
        ns[f"_TARGET{i}"] = target
        redirects.append((name, f"_TARGET{i}"))
    src = [
        "def row(name):",
        "    if not isinstance(name, str): return None",
        *_if_tree("name", rows, 1),
        "    return None",
        "def redirect(name):",
        "    if not isinstance(name, str): return None",
        *_if_tree("name", redirects, 1),
        "    return None",
    ]
    exec(compile("\n".join(src), "<fp16kit.amp.autocast_mode compiled lookups>", "exec"), ns)
    return ns["row"], ns["redirect"]


_compiled_row, _compiled_redirect = _build_compiled_lookups()


def _rebuild_compiled_lookups() -> None:
    global _compiled_row, _compiled_redirect
    _compiled_row, _compiled_redirect = _build_compiled_lookups()


policy.add_listener(_rebuild_compiled_lookups)


# ----------------------------------------------------------------------------------------------------------------
# Casting
# ----------------------------------------------------------------------------------------------------------------


def _cast(a: Any, to: torch.dtype, mode: _AutocastMode) -> Any:
    """``a`` with every eligible tensor cast to ``to`` (containers rebuilt only when something changed)."""
    return cast_all((a,), to, mode)[0]


def cast_all(args: Any, to: torch.dtype, mode: _AutocastMode) -> Any:
    """Every eligible tensor of ``args`` (and of lists/tuples inside it) cast to ``to``.

    Returns ``args`` itself, with no allocation, when nothing needs a cast (the common case on the hot path).
    An fp32 leaf that requires grad (a parameter) cast to low precision goes through the region's cache.
    """
    out = _cast_seq_or_none(args, to, mode)
    return args if out is None else out


def _cast_seq_or_none(args: Any, to: torch.dtype, mode: _AutocastMode) -> Any:
    """:func:`cast_all`, but ``None`` when nothing needs a cast. (Callers test ``is None``, never ``c is a`` on
    containers: Dynamo cannot trace ``is`` between tuples, which would be a graph break under torch.compile.)"""
    out = None
    for i, a in enumerate(args):
        if isinstance(a, _Tensor):
            dt = a.dtype
            if dt is to or not dt.is_floating_point or dt is _F64:  # not castable (see _CASTABLE)
                continue
            if dt is _F32 and mode.cache_enabled and a.requires_grad and a.is_leaf:
                c = mode._cached_cast(a, to)
            else:
                c = a.to(to)
        elif isinstance(a, (list, tuple)):
            c = _cast_seq_or_none(a, to, mode)
            if c is None:
                continue
            if not isinstance(a, list) and type(a) is not tuple:
                c = type(a)(*c)  # a namedtuple
        else:
            continue
        if out is None:
            out = list(args)
        out[i] = c
    if out is None:
        return None
    return out if isinstance(args, list) else tuple(out)


def _mixed(args: Any) -> bool:
    """True when the eligible tensors of ``args`` (containers included) do not all have one dtype."""
    first = None
    for a in args:
        if isinstance(a, _Tensor):
            dt = a.dtype
            if dt.is_floating_point and dt is not _F64:  # castable (see _CASTABLE)
                if first is None:
                    first = dt
                elif dt is not first:
                    return True
        elif isinstance(a, (list, tuple)):
            seen: set[torch.dtype] = set()
            _eligible_dtypes(args, seen)
            return len(seen) > 1
    return False


def _eligible_dtypes(a: Any, acc: set[torch.dtype]) -> None:
    if isinstance(a, _Tensor):
        dt = a.dtype
        if dt is not _F64 and dt.is_floating_point:
            acc.add(dt)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _eligible_dtypes(x, acc)


def _banned_error(name: str, qual: str, dtype: torch.dtype) -> RuntimeError:
    return RuntimeError(
        f"{qual} with {dtype} inputs is unsafe under autocast: its log(x) and log(1 - x) lose all precision near "
        f"0 and 1 in low precision, and the probabilities usually come from a sigmoid that already rounded. "
        f"Use torch.nn.functional.binary_cross_entropy_with_logits (or torch.nn.BCEWithLogitsLoss) on the "
        f"logits instead: it fuses the sigmoid and runs in fp32 under the policy. If you really want "
        f"{name} here, register it as an FP32 op: "
        f"fp16kit.amp.register_float_function(torch.nn.functional, '{name}') "
        f"(or, scoped: with fp16kit.amp.policy_override({{'{name}': 'fp32'}}): ...)."
    )


def cast_args(
    mode: _AutocastMode, entry: tuple[Rule, bool, str], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``func`` runs with under ``entry``'s rule (the same objects when nothing is cast)."""
    if kwargs and (kwargs.get("out") is not None or kwargs.get("dtype") is not None):
        return args, kwargs  # explicit user intent wins
    rule, inplace, name = entry
    if inplace:
        self_t = args[0] if args else None
        if not isinstance(self_t, _Tensor):
            return args, kwargs
        to = self_t.dtype
        if to is _F64 or not to.is_floating_point:
            return args, kwargs
        if to in _LOW_DTYPES and (rule is _FP32 or rule is _BANNED):
            qual = policy.display_name(func, name)
            if rule is _BANNED:
                raise _banned_error(name, qual, to)
            example = f" (y = torch.{name}(x))" if name.isidentifier() and hasattr(torch, name) else ""
            raise RuntimeError(
                f"Cannot call in-place {qual} on {_SHORT[to]} tensors under autocast: the policy runs '{name}' in "
                f"fp32 (Rule.FP32) and an in-place op cannot change the tensor's dtype. Use the out-of-place "
                f"form{example}, or cast the tensor to float32 first."
            )
        rest = _cast_seq_or_none(args[1:], to, mode)
        new_kwargs = {k: _cast(v, to, mode) for k, v in kwargs.items()} if kwargs else kwargs
        return (args if rest is None else (self_t, *rest)), new_kwargs
    if rule is _LOW:
        to = mode.dtype
    elif rule is _FP32:
        to = _F32
    else:
        seen: set[torch.dtype] = set()
        _eligible_dtypes(args, seen)
        if kwargs:
            _eligible_dtypes(tuple(kwargs.values()), seen)
        if rule is _BANNED:
            low = seen & _LOW_DTYPES
            if low:
                raise _banned_error(name, policy.display_name(func, name), next(iter(low)))
            return args, kwargs
        if len(seen) < 2:
            return args, kwargs  # dtypes agree: PROMOTE leaves them alone
        to = _F32  # fp32 beats fp16/bf16, and fp16 + bf16 meet in fp32 (as torch's type promotion does)
    new_args = cast_all(args, to, mode)
    new_kwargs = {k: _cast(v, to, mode) for k, v in kwargs.items()} if kwargs else kwargs
    return new_args, new_kwargs


class _AutocastMode(TorchFunctionMode):
    """The per-thread mode. State is mutated by nested regions (innermost wins), never stacked."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled = True
        self.dtype: torch.dtype = torch.float16
        self.cache_enabled = True
        # id(source) -> (source, source._version, dtype, cast). Keyed by id: Tensor.__hash__ is a Python method
        # (slow on this path); the entry holds the source, so its id cannot be reused while the entry lives.
        self.cache: dict[int, tuple[torch.Tensor, int, torch.dtype, torch.Tensor]] = {}

    def _cached_cast(self, a: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        # Under torch.compile the graph's own CSE does this; a dict keyed by tensors would only add guards.
        if _is_compiling():
            return a.to(to)
        hit = self.cache.get(id(a))
        if hit is not None and hit[2] is to and hit[1] == a._version:
            return hit[3]
        out = a.to(to)
        # Never grow under no_grad (pytorch#48049): a grad-less copy must not be handed to a later grad-enabled
        # use, and inference loops must not accumulate entries. Existing (grad-tracking) entries are still used.
        if torch.is_grad_enabled():
            self.cache[id(a)] = (a, a._version, to, out)
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        # Hot path: every torch call in the region lands here. One dict lookup; no allocation when nothing is cast.
        entry = _DISPATCH.get(id(func))
        if entry is None:
            if not _is_compiling():
                return func(*args, **kwargs) if kwargs else func(*args)  # an absent op, eager: the commonest case
            return self._compiled_miss(func, args, kwargs)
        if not self.enabled:
            if _is_compiling():
                return self._compiled_miss(func, args, kwargs, disabled=True)
            return func(*args, **kwargs) if kwargs else func(*args)
        if entry.__class__ is tuple:
            if not kwargs:
                if not entry[1]:  # the common cases, inlined
                    rule = entry[0]
                    if rule is _LOW:
                        return func(*cast_all(args, self.dtype, self))
                    if rule is _FP32:
                        return func(*cast_all(args, _F32, self))
                    if rule is _PROMOTE:
                        return func(*cast_all(args, _F32, self)) if _mixed(args) else func(*args)
            elif kwargs.get("out") is not None:
                # run as called (cast_args' first rule), without its call: compiled code calls Inductor's
                # extern_kernels (addmm, mm, bmm with out=) through any active mode, at every compiled call
                return func(*args, **kwargs)
            args, kwargs = cast_args(self, entry, func, args, kwargs or _NO_KWARGS)
            return func(*args, **kwargs)
        # an absent composite: run its body with the mode pushed again so the ops inside it are seen
        with self:
            return entry(*args, **(kwargs or {}))

    def _torch_function_by_fn(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        """The hook on a torch whose Dynamo cannot trace ``id()`` of a torch function (torch 2.11: "id() with
        unsupported args"): eager runs :meth:`__torch_function__` as it is; while Dynamo traces, the row is read
        from ``_DISPATCH_BY_FN`` (keyed by the callables) instead of ``_DISPATCH``."""
        if not _is_compiling():
            return _AutocastMode.__torch_function__(self, func, types, args, kwargs)
        entry = _DISPATCH_BY_FN.get(func)
        if entry is None or not self.enabled:
            return self._compiled_miss(func, args, kwargs, disabled=not self.enabled)
        if isinstance(entry, tuple):
            args, kwargs = cast_args(self, entry, func, args, kwargs or _NO_KWARGS)
            return func(*args, **kwargs)
        with self:  # an absent composite, as in __torch_function__
            return entry(*args, **(kwargs or {}))

    def _compiled_miss(self, func: Any, args: tuple[Any, ...], kwargs: Any, *, disabled: bool = False) -> Any:
        """While Dynamo traces: ``func`` missed ``_DISPATCH`` (or casting is off). Dynamo hands Tensor methods called
        on intermediates and Python operators (``h.exp()``, ``x @ y``) to the mode as sourceless variables whose
        ``id()`` is a fake one (see _BY_NAME): their row is found by name, through ``_compiled_row`` (no dict
        guards). A Tensor method Dynamo cannot trace through a mode (zero-argument ``super()``) is replaced by the
        in-graph torch function it forwards to (eager keeps the Python method, which also handles named dims)."""
        name = getattr(func, "__name__", None)
        if name == "tag_activation_checkpoint":
            return self._checkpoint_outside_the_graph(func, args, kwargs)
        entry = None if disabled else _compiled_row(name)
        if entry is None:
            redirect = _compiled_redirect(name)
            if redirect is not None:
                return redirect(*args, **(kwargs or {}))
            return func(*args, **kwargs) if kwargs else func(*args)
        args, kwargs = cast_args(self, entry, func, args, kwargs or _NO_KWARGS)  # the general form of the hot path
        return func(*args, **kwargs)


    def _checkpoint_outside_the_graph(self, func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """While Dynamo traces ``torch.utils.checkpoint.checkpoint`` (its higher-order op, dispatched to this mode):
        a graph break, so the checkpointed call runs eagerly, under this mode, as without ``torch.compile``.

        Why: Dynamo calls a mode's ``__torch_function__`` with the mode popped, as torch does, and then traces the
        checkpoint's body with the mode stack as it is; pushing the mode again inside the body is a mutation Dynamo
        refuses in a higher-order op ("HOP: Unsafe side effect"). Traced without the mode, the body's ops would run
        as called (other dtypes than eager, silently). Eager checkpointing re-enters the region for the
        recomputation (``_recompute``), so the gradients are eager's, bit for bit; the rest of the function stays
        compiled. One :class:`CompiledCheckpointWarning` per process says so and names the fix (the dispatcher
        engine traces checkpointed blocks into the graph); with ``fullgraph=True`` the graph break is Dynamo's
        error, carrying the same message."""
        from torch._dynamo.comptime import comptime

        comptime(lambda ctx: _warn_compiled_checkpoint())  # runs while tracing; Dynamo skips warnings.warn itself
        torch._dynamo.graph_break(msg=_COMPILED_CHECKPOINT)
        # not reached while tracing (the graph break raises there); run eagerly if Dynamo resumes here
        with self:
            return func(*args, **kwargs) if kwargs else func(*args)


class _AutocastModeByFn(_AutocastMode):
    """:class:`_AutocastMode` for a torch whose Dynamo cannot trace ``id()`` of a torch function."""

    __torch_function__ = _AutocastMode._torch_function_by_fn


#: The mode class autocast pushes (a branch on the torch version: fp16kit/_versions.py).
_MODE_CLASS: type[_AutocastMode] = (
    _AutocastMode if _versions.dynamo_traces_any_id() else _AutocastModeByFn
)


def active_mode() -> Any:
    """This thread's region state (``enabled``, ``dtype``; under the mode engine its :class:`_AutocastMode`), or
    None outside every region."""
    if _engine[0] == "dispatch":
        return _dispatch.STATE if getattr(_tls, "depth", 0) else None
    return getattr(_tls, "mode", None)


def rule_wrapper(fn: _T, rule: Rule) -> _T:
    """``fn`` under a fixed ``rule``: in an enabled region its eligible inputs are cast first; else run as called."""
    entry = (rule, False, getattr(fn, "__name__", repr(fn)))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mode = active_mode()
        if mode is None or not mode.enabled:
            return fn(*args, **kwargs)
        args, kwargs = cast_args(mode, entry, fn, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__fp16kit_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def table_wrapper(fn: _T) -> _T:
    """``fn`` (a function that does not dispatch ``__torch_function__``) under its row of the live table, read at
    call time, so :func:`~fp16kit.amp.policy_override` applies; installed by ``register_*_function``."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mode = active_mode()
        entry = policy.RESOLVED.get(fn)
        if mode is None or not mode.enabled or entry is None:
            return fn(*args, **kwargs)
        args, kwargs = cast_args(mode, entry, fn, args, kwargs)
        return fn(*args, **kwargs)

    wrapper.__fp16kit_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def is_autocast_enabled() -> bool:
    """True inside an enabled :class:`autocast` region on this thread (and not inside :func:`disable_casts`)."""
    if _engine[0] == "dispatch":
        return _dispatch.region_active()
    mode = active_mode()
    return mode is not None and mode.enabled


def _dispatch_region(dtype: torch.dtype, enabled: bool, cache_enabled: bool) -> Any:
    """Enter a region of the dispatcher engine; returns what to ``__exit__``."""
    if _is_compiling():  # Dynamo traces the torch.autocast blocks (and never calls the hook on them)
        region = _dispatch.region(dtype, enabled, cache_enabled)
        region.__enter__()
        return region
    if torch._C._is_torch_function_mode_enabled():
        return _OwnRegion(_dispatch.region(dtype, enabled, cache_enabled))
    return _dispatch.EagerRegion(dtype, enabled, cache_enabled)


class _OwnRegion:
    """:func:`_dispatch.region` (``torch.autocast`` blocks), entered and exited as fp16kit's own: the
    ``torch.autocast`` hook (:func:`torch_region_enter`) leaves these blocks alone."""

    __slots__ = ("_region",)

    def __init__(self, region: Any) -> None:
        self._region = region
        _tls.own = getattr(_tls, "own", 0) + 1
        try:
            region.__enter__()
        finally:
            _tls.own -= 1

    def __exit__(self, *exc: object) -> None:
        _tls.own = getattr(_tls, "own", 0) + 1
        try:
            self._region.__exit__(*exc)
        finally:
            _tls.own -= 1


def _state_inside_a_region() -> tuple[Any, ...] | None:
    """:func:`region_state` inside a region on this thread, None outside every region."""
    return None if active_mode() is None else region_state()


call_eagerly = _torch_custom_fn.call_eagerly  # fn(*args) outside Dynamo's trace, with the reason


def traced_inside_a_region() -> bool:
    """True inside a region on this thread, in a form Dynamo traces (it guards on torch's autocast state): the
    dispatcher engine's marker is on in every enabled region; the mode engine's mode is thread state."""
    if _engine[0] == "dispatch":
        return torch.is_autocast_enabled(_dispatch.MARKER)
    return getattr(_tls, "mode", None) is not None


def torch_region_enter(device: str, enabled: bool, dtype: torch.dtype) -> tuple[Any, ...] | None:
    """Called (by :mod:`fp16kit.amp._nesting`) when a ``torch.autocast(device, dtype, enabled)`` is entered on this
    thread; returns ``(takes_over, cache_off)`` for :func:`torch_region_exit`, or None when it changes nothing here.

    Inside an enabled fp16kit region, a ``torch.autocast`` that disables autocast or asks for another dtype takes
    over: until it exits, the ops run under torch's autocast alone (torch's table for that device, in its dtype, or
    nothing cast), the same under both engines (docs/autocast.md, "Nesting"). One that enables the region's own dtype
    changes nothing. ``cache_off``: the torch region must not use torch's weight-cast cache, which may hold casts to
    another dtype (it is keyed by tensor).

    The ``torch.autocast`` that ``torch.amp.custom_bwd`` enters around the backward of a Function whose forward ran in
    a region (``_torch_custom_fn.backward_state``) re-enters that region, like :func:`custom_bwd
    <fp16kit.amp.custom_bwd>`: ``(False, False, replay)``."""
    if _torch_custom_fn.recorded():  # False until torch.amp.custom_fwd ran in a region once
        state = _torch_custom_fn.backward_state(enabled, dtype)
        if state is not None:
            region = replay(state)
            region.__enter__()
            return (False, False, region)
    dispatch = _engine[0] == "dispatch"
    if not (getattr(_tls, "depth", 0) if dispatch else getattr(_tls, "mode", None)):
        _threads.check_worker()  # a DataParallel replica's thread while a region is open elsewhere: say so
        return None  # outside every fp16kit region (plain torch.autocast code): the common case, first
    if device == _dispatch.MARKER or getattr(_tls, "own", 0) or _is_compiling():
        return None
    if dispatch:
        marker = _dispatch.MARKER
        cache_off = bool(enabled) and _cache_may_hold_other(dtype)
        on = torch.is_autocast_enabled(marker)
        takes_over = on and not (enabled and dtype is torch.get_autocast_dtype(marker))
        if takes_over:
            torch.set_autocast_enabled(marker, False)
        return (takes_over, cache_off) if takes_over or cache_off else None
    mode = getattr(_tls, "mode", None)
    if mode is None or not mode.enabled or (enabled and dtype is mode.dtype):
        return None
    mode.enabled = False
    return (True, False)


def torch_region_exit(token: tuple[Any, ...]) -> None:
    """Undo :func:`torch_region_enter` when that ``torch.autocast`` exits."""
    if len(token) > 2:  # the region re-entered around torch.amp.custom_bwd's backward
        token[2].__exit__(None, None, None)
        return
    if not token[0]:
        return
    if _engine[0] == "dispatch":
        torch.set_autocast_enabled(_dispatch.MARKER, True)
        return
    mode = getattr(_tls, "mode", None)
    if mode is not None:
        mode.enabled = True


#: one entry once the hooks on torch (``_recompute``, ``_nesting``) are installed: the first eager region does it
_HOOKED: list[bool] = []
#: the device types whose ``torch.autocast`` state a region reads or sets (besides the dispatcher engine's marker)
_TORCH_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _inside_vmap() -> bool:
    """True while a ``torch.func.vmap`` transform is active on this thread."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def _cached_dtypes() -> list[torch.dtype]:
    """This thread's stack of the dtypes of the enclosing enabled regions of the dispatcher engine."""
    stack = getattr(_tls, "cached", None)
    if stack is None:
        stack = _tls.cached = []
    return stack


def _cache_may_hold_other(dtype: torch.dtype) -> bool:
    """True when torch's weight-cast cache may hold casts to another dtype than ``dtype``: an enclosing region,
    fp16kit's or torch's, is enabled in another dtype."""
    stack = getattr(_tls, "cached", None)
    if stack:
        if any(d is not dtype for d in stack):
            return True
    elif not torch._C._is_any_autocast_enabled():
        return False  # the outermost region (the common case): one call
    return any(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d) is not dtype for d in _TORCH_DEVICES)


def _torch_autocast_off() -> tuple[str, ...]:
    """Turn off torch's autocast on the devices where it is on (the mode engine's region inside a ``torch.autocast``:
    torch's kernels would cast again what the mode cast); the devices it turned off, for
    :func:`_torch_autocast_restore`."""
    off = tuple(d for d in _TORCH_DEVICES if torch.is_autocast_enabled(d))
    for d in off:
        torch.set_autocast_enabled(d, False)
    return off


def _torch_autocast_restore(off: tuple[str, ...]) -> None:
    for d in off:
        torch.set_autocast_enabled(d, True)


class AutocastDisabledWarning(UserWarning):
    """``autocast(device_type, ...)`` disabled itself where ``torch.autocast`` with the same arguments does."""


DataParallelRegionWarning = _threads.DataParallelRegionWarning  # a DataParallel replica runs outside the region


class CompiledCheckpointWarning(UserWarning):
    """Under the mode engine, ``torch.compile`` runs each checkpointed block eagerly (a graph break)."""


_COMPILED_CHECKPOINT = (
    "fp16kit.amp.autocast with the mode engine (FP16KIT_AUTOCAST_ENGINE=mode): torch.compile traces "
    "torch.utils.checkpoint's body without torch-function modes, so the cast policy could not apply inside it. "
    "fp16kit breaks the graph before each checkpoint call instead: the checkpointed block runs eagerly, under the "
    "region, and its results and gradients are eager's, bit for bit; with fullgraph=True that graph break is an "
    "error. Fix: use the default dispatcher engine (unset FP16KIT_AUTOCAST_ENGINE, or call "
    "fp16kit.amp.autocast_mode.set_engine('dispatch') outside every region), which compiles checkpointed blocks "
    "into the graph with the same bits."
)
_COMPILED_CHECKPOINT_WARNED: list[bool] = []


def _warn_compiled_checkpoint() -> None:
    if not _COMPILED_CHECKPOINT_WARNED:
        _COMPILED_CHECKPOINT_WARNED.append(True)
        warnings.warn(_COMPILED_CHECKPOINT, CompiledCheckpointWarning, stacklevel=2)


def _torch_signature(device_type: Any, dtype: torch.dtype | None, enabled: bool) -> tuple[torch.dtype, bool]:
    """``(dtype, enabled)`` of ``autocast(device_type, dtype, enabled)``, as ``torch.autocast`` resolves them: the
    device type's autocast dtype when ``dtype`` is None, and disabled (with a warning) where torch disables it."""
    if not isinstance(device_type, str):
        raise ValueError(f"autocast(device_type={device_type!r}): expected a str such as 'cuda' or 'cpu'.")
    try:
        available = torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type torch knows at all ("tpu")
        available = False
    if not available:
        raise RuntimeError(
            f"autocast({device_type!r}): torch has no autocast for device type {device_type!r}. Write "
            f"autocast('cuda', ...) or autocast('cpu', ...) (an fp16kit region applies to tensors of every device), "
            f"or autocast(dtype=torch.bfloat16) without a device type."
        )
    dtype = torch.get_autocast_dtype(device_type) if dtype is None else dtype
    if not enabled:
        return dtype, False
    if device_type == "cuda" and not torch.cuda.is_available():
        warnings.warn(
            "fp16kit.amp.autocast('cuda'): CUDA is not available, so this region casts nothing, as "
            "torch.autocast('cuda') does. For mixed precision on CPU tensors write "
            "amp.autocast('cpu', dtype=torch.bfloat16) or amp.autocast(dtype=torch.bfloat16) (no device type: "
            "every device).",
            AutocastDisabledWarning,
            stacklevel=3,
        )
        return dtype, False
    if dtype not in _LOW_DTYPES:
        warnings.warn(
            f"fp16kit.amp.autocast({device_type!r}, dtype={dtype}): autocast only supports torch.float16 and "
            f"torch.bfloat16, so this region casts nothing, as torch.autocast does. Pass dtype=torch.float16 or "
            f"dtype=torch.bfloat16.",
            AutocastDisabledWarning,
            stacklevel=3,
        )
        return dtype, False
    return dtype, True


class autocast:
    """Run the ops of a region under the cast policy table, in ``dtype`` (``torch.float16`` or ``torch.bfloat16``).

    Use as a context manager or a decorator::

        with fp16kit.amp.autocast(dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)

        @fp16kit.amp.autocast()
        def forward(x): ...

    Contract: each op of the table gets the inputs that casting by hand would give and runs as called, so the
    output equals ``op(*manually_cast_inputs)`` bit for bit. Device-agnostic (CPU and CUDA tensors alike).

    Signatures: fp16kit's, ``autocast(dtype=torch.float16, enabled=True, cache_enabled=True)`` (``dtype`` may be
    the first positional argument), and ``torch.autocast``'s, ``autocast(device_type, dtype=None, enabled=True,
    cache_enabled=None)``, resolved as torch resolves it: ``dtype=None`` is ``torch.get_autocast_dtype(device_type)``
    (bf16 for ``"cpu"``, fp16 for ``"cuda"``), ``cache_enabled=None`` is ``torch.is_autocast_cache_enabled()``, an
    unknown device type raises, and where torch disables its region (``"cuda"`` without CUDA, a dtype other than
    fp16/bf16) this one is disabled too, with an :class:`AutocastDisabledWarning` saying what to write. The region
    still applies to tensors of every device: ``device_type`` picks the defaults, not the tensors.
    ``enabled=False`` turns casting off inside (nested regions: the innermost wins, the outer state is restored
    on exit). ``cache_enabled``: an fp32 leaf tensor that requires grad (a parameter) is cast to low precision
    once per region and the copy reused (re-cast if the parameter is modified in place); the cache is freed when
    the outermost region exits and never grows under ``torch.no_grad()``.
    """

    def __init__(
        self,
        device_type: str | torch.dtype | None = None,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        if isinstance(device_type, torch.dtype):  # fp16kit's own positional form, autocast(torch.bfloat16)
            if dtype is not None:
                raise TypeError(
                    f"autocast({device_type}, dtype={dtype}): the dtype is given twice. Write "
                    f"autocast(dtype={dtype}) or, torch's signature, autocast('cuda', dtype={dtype})."
                )
            device_type, dtype = None, device_type
        self.device_type = device_type
        if device_type is None:
            dtype = torch.float16 if dtype is None else dtype
            if dtype not in _LOW_DTYPES:
                raise ValueError(
                    f"autocast(dtype={dtype}): the low-precision dtype must be torch.float16 or torch.bfloat16."
                )
        else:
            dtype, enabled = _torch_signature(device_type, dtype, enabled)
        self.dtype = dtype
        self.enabled = bool(enabled)
        if cache_enabled is None:  # torch's signature: torch's default; fp16kit's: True, as it always was
            cache_enabled = torch.is_autocast_cache_enabled() if device_type is not None else True
        self.cache_enabled = bool(cache_enabled)
        self._saved: list[Any] = []

    def __enter__(self) -> autocast:
        if not _HOOKED and not _is_compiling():
            _recompute.install(region_state, replay)  # checkpoint recomputation re-enters the forward's region
            _nesting.install(torch_region_enter, torch_region_exit)  # torch.autocast inside a region
            # torch.amp.custom_bwd re-enters the forward's region (eagerly, also under torch.compile)
            _torch_custom_fn.install(_state_inside_a_region, traced_inside_a_region)
            _HOOKED.append(True)
        if _engine[0] == "dispatch":
            if self.enabled and torch._C._are_functorch_transforms_active() and _inside_vmap():
                raise RuntimeError(
                    "fp16kit.amp.autocast inside torch.func.vmap with the dispatcher engine (the default): vmap "
                    "decomposes some ops (nn.Linear with a bias, Tensor.softmax) before torch's autocast sees them, so "
                    "they would run in their input dtype, as under torch.autocast. Select the mode engine for vmapped "
                    "code: FP16KIT_AUTOCAST_ENGINE=mode, or fp16kit.amp.autocast_mode.set_engine('mode') outside every "
                    "region (docs/autocast.md, 'torch.func')."
                )
            _dispatch.install(cast_args)
            # torch's weight-cast cache is keyed by tensor, not dtype: a region nested in one of another dtype casts
            # afresh (a cached fp16 weight handed to a bf16 matmul is torch's "mat1 and mat2" error)
            cache = self.cache_enabled and not (self.enabled and _cache_may_hold_other(self.dtype))
            region = _dispatch_region(self.dtype, self.enabled, cache)
            counted = self.enabled or getattr(_tls, "depth", 0) > 0  # a disabled outermost region opens none
            if counted and not getattr(_tls, "depth", 0):
                _threads.opened()
            _tls.depth = getattr(_tls, "depth", 0) + counted
            if self.enabled:
                _cached_dtypes().append(self.dtype)
            self._saved.append((region, counted))
            return self
        torch_state = _torch_autocast_off()  # the region wins over an enclosing torch.autocast (its kernels off)
        mode = active_mode()
        if mode is None:
            if not self.enabled:
                self._saved.append((None, False, self.dtype, self.cache_enabled, torch_state))
                return self
            mode = _MODE_CLASS()
            mode.__enter__()
            _tls.mode = mode
            _threads.opened()
            self._saved.append((mode, True, mode.dtype, mode.cache_enabled, torch_state))
        else:
            self._saved.append((None, mode.enabled, mode.dtype, mode.cache_enabled, torch_state))
        mode.enabled, mode.dtype, mode.cache_enabled = self.enabled, self.dtype, self.cache_enabled
        return self

    def __exit__(self, *exc: object) -> None:
        saved = self._saved.pop()
        if len(saved) == 2:  # the dispatch engine's (region, counted)
            _tls.depth -= saved[1]
            if saved[1] and not _tls.depth:
                _threads.closed()
            if self.enabled:
                _cached_dtypes().pop()
            saved[0].__exit__(*exc)
            return
        pushed, enabled, dtype, cache_enabled, torch_state = saved
        mode = active_mode()
        if pushed is not None:
            pushed.cache.clear()
            _tls.mode = None
            _threads.closed()
            pushed.__exit__(*exc)
        elif mode is not None:
            mode.enabled, mode.dtype, mode.cache_enabled = enabled, dtype, cache_enabled
        _torch_autocast_restore(torch_state)

    def __call__(self, fn: _T) -> _T:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache_enabled):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def region_state() -> tuple[Any, ...]:
    """This thread's fp16kit region state, as :func:`replay` re-enters it: what ``torch.utils.checkpoint`` saves of
    torch's own autocast state (``_get_autocast_kwargs``) at a checkpointed forward, for fp16kit's region.

    ``("dispatch", enabled, dtype, depth)`` (the marker's state and the region depth) or ``("mode", None)`` (no
    region) / ``("mode", (enabled, dtype, cache_enabled))`` (the thread's mode)."""
    if _engine[0] == "dispatch":
        marker = _dispatch.MARKER
        depth = getattr(_tls, "depth", 0)
        return ("dispatch", torch.is_autocast_enabled(marker), torch.get_autocast_dtype(marker), depth)
    mode = getattr(_tls, "mode", None)
    return ("mode", None if mode is None else (mode.enabled, mode.dtype, mode.cache_enabled))


class replay:
    """Re-enter a :func:`region_state` where torch re-runs forward code inside backward (the recomputation of
    ``torch.utils.checkpoint``, reentrant or not) or runs a backward under its forward's state (:func:`custom_bwd
    <fp16kit.amp.custom_bwd>`): the ops then get the rows, dtype and cache setting they had in the forward, so the
    recomputed values are the forward's, bit for bit. torch restores its own per-device autocast state itself; this
    restores fp16kit's part of it (the dispatcher engine's marker, or the mode engine's ``TorchFunctionMode``).

    A state of the other engine (the engine was switched between forward and backward) cannot be re-entered: that
    raises, naming the fix."""

    def __init__(self, state: tuple[Any, ...]) -> None:
        self._state = state
        self._saved: list[Any] = []

    def __enter__(self) -> replay:
        state = self._state
        if state[0] != _engine[0]:
            raise RuntimeError(
                f"fp16kit.amp: this backward re-runs forward code recorded under the {state[0]!r} autocast engine, "
                f"but the {_engine[0]!r} engine is selected now. Switch engines (fp16kit.amp.autocast_mode.set_engine) "
                f"only between training steps, after backward."
            )
        if state[0] == "dispatch":
            _, enabled, dtype, depth = state
            block = _dispatch.Replay(enabled, dtype)
            block.__enter__()
            self._saved.append((block, getattr(_tls, "depth", 0)))
            _tls.depth = depth
            return self
        recorded, mode = state[1], getattr(_tls, "mode", None)
        if recorded is None:  # the forward ran outside every region
            self._saved.append((None, mode, None if mode is None else mode.enabled))
            if mode is not None:
                mode.enabled = False
            return self
        if mode is None:
            mode = _MODE_CLASS()
            mode.__enter__()
            _tls.mode = mode
            _threads.opened()
            self._saved.append((mode, mode, None))
        else:
            # backward called inside a region: the autograd engine runs the node with an empty torch-function mode
            # stack, so the thread's mode is pushed again for the replay (popped on exit)
            repush = mode not in torch.overrides._get_current_function_mode_stack()
            if repush:
                mode.__enter__()
            self._saved.append((None, mode, (mode.enabled, mode.dtype, mode.cache_enabled), repush))
        mode.enabled, mode.dtype, mode.cache_enabled = recorded
        return self

    def __exit__(self, *exc: object) -> None:
        saved = self._saved.pop()
        if len(saved) == 2:
            block, depth = saved
            _tls.depth = depth
            block.__exit__(*exc)
            return
        pushed, mode, previous = saved[:3]
        if pushed is not None:
            pushed.cache.clear()
            _tls.mode = None
            _threads.closed()
            pushed.__exit__(*exc)
        elif mode is not None and previous is not None:
            if isinstance(previous, tuple):
                mode.enabled, mode.dtype, mode.cache_enabled = previous
                if saved[3]:
                    mode.__exit__(*exc)
            else:
                mode.enabled = previous


class disable_casts:
    """Context manager (and decorator) inside which nothing is cast, even in an active :class:`autocast` region.

    The apex-style frontend runs ``optimizer.step()`` inside it. A nested ``autocast`` re-enables casting.
    """

    def __init__(self) -> None:
        self._saved: list[Any] = []

    def __enter__(self) -> disable_casts:
        if _engine[0] == "dispatch":
            region = _dispatch_region(torch.get_autocast_dtype(_dispatch.MARKER), False, True)
            self._saved.append(region)
            return self
        mode = active_mode()
        self._saved.append(None if mode is None else mode.enabled)
        if mode is not None:
            mode.enabled = False
        return self

    def __exit__(self, *exc: object) -> None:
        enabled = self._saved.pop()
        if enabled is not None and enabled.__class__ is not bool:  # the dispatch engine's region
            enabled.__exit__(*exc)
            return
        mode = active_mode()
        if mode is not None and enabled is not None:
            mode.enabled = enabled

    def __call__(self, fn: _T) -> _T:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with disable_casts():
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]
