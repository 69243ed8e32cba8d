"""``fp16kit.amp.autocast``: the one module that applies the cast policy table (docs/specs/cast-policy.md).

The table itself is data in :mod:`fp16kit.amp.policy`; this module subscribes to it (``policy.add_listener``)
and is the only place that casts. Its sibling modules reach the mechanism through the public names below
(:func:`active_mode`, :func:`cast_all`, :func:`cast_args`, :func:`rule_wrapper`, :func:`table_wrapper`).

Two engines apply the table (docs/autocast.md): this module's ``TorchFunctionMode`` (``"mode"``, the default) and
the dispatcher engine of :mod:`fp16kit.amp._dispatch` (``"dispatch"``: torch's C++ autocast plus ``torch.library``
kernels on the Autocast keys for the ops where the table differs from torch), chosen by ``FP16KIT_AUTOCAST_ENGINE``
or :func:`set_engine`. Both share :func:`cast_args`, so each rule and its error messages are written once.

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

import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from .. import _versions
from . import _bytecode, _dispatch, policy
from .policy import Rule

__all__ = ["autocast", "disable_casts", "engine", "is_autocast_enabled", "set_engine"]

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

#: the engines that can apply the table: "mode" (a TorchFunctionMode, this module) or "dispatch" (override kernels
#: on torch's Autocast dispatch keys, ``_dispatch``). Chosen by FP16KIT_AUTOCAST_ENGINE, or by :func:`set_engine`.
ENGINES = ("mode", "dispatch")
_engine = [os.environ.get("FP16KIT_AUTOCAST_ENGINE", "dispatch").strip().lower() or "dispatch"]
if _engine[0] not in ENGINES:
    raise ValueError(f"FP16KIT_AUTOCAST_ENGINE={_engine[0]!r}: use one of {ENGINES}.")


def engine() -> str:
    """The engine new regions use: ``"mode"`` or ``"dispatch"`` (see docs/autocast.md, "The dispatcher engine")."""
    return _engine[0]


def set_engine(name: str) -> None:
    """Select the engine of regions entered from now on (``"mode"`` or ``"dispatch"``); not inside a region.
    Leaving the dispatcher engine uninstalls it (its kernels and ``torch.nn.functional`` wrappers), so that neither
    plain ``torch.autocast`` code nor the mode engine meets them."""
    if name not in ENGINES:
        raise ValueError(f"set_engine({name!r}): use one of {ENGINES}.")
    if getattr(_tls, "depth", 0) or getattr(_tls, "mode", None) is not None:
        raise RuntimeError("set_engine: cannot switch engines inside an autocast region; leave it first.")
    if name != "dispatch":
        _dispatch.uninstall()
    _engine[0] = name


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
        entry = None if disabled else _compiled_row(name)
        if entry is None:
            redirect = _compiled_redirect(name)
            if redirect is not None:
                return redirect(*args, **(kwargs or {}))
            return func(*args, **kwargs) if kwargs else func(*args)
        args, kwargs = cast_args(self, entry, func, args, kwargs or _NO_KWARGS)  # the general form of the hot path
        return func(*args, **kwargs)


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
    if _is_compiling() or torch._C._is_torch_function_mode_enabled():
        region = _dispatch.region(dtype, enabled, cache_enabled)
        region.__enter__()
        return region
    return _dispatch.EagerRegion(dtype, enabled, cache_enabled)


class autocast:
    """Run the ops of a region under the cast policy table, in ``dtype`` (``torch.float16`` or ``torch.bfloat16``).

    Use as a context manager or a decorator::

        with fp16kit.amp.autocast(dtype=torch.bfloat16):
            loss = loss_fn(model(x), y)

        @fp16kit.amp.autocast()
        def forward(x): ...

    Contract: each op of the table gets the inputs that casting by hand would give and runs as called, so the
    output equals ``op(*manually_cast_inputs)`` bit for bit. Device-agnostic (CPU and CUDA tensors alike).
    ``enabled=False`` turns casting off inside (nested regions: the innermost wins, the outer state is restored
    on exit). ``cache_enabled``: an fp32 leaf tensor that requires grad (a parameter) is cast to low precision
    once per region and the copy reused (re-cast if the parameter is modified in place); the cache is freed when
    the outermost region exits and never grows under ``torch.no_grad()``.
    """

    def __init__(self, dtype: torch.dtype = torch.float16, enabled: bool = True, cache_enabled: bool = True) -> None:
        if dtype not in _LOW_DTYPES:
            raise ValueError(
                f"autocast(dtype={dtype}): the low-precision dtype must be torch.float16 or torch.bfloat16."
            )
        self.dtype = dtype
        self.enabled = bool(enabled)
        self.cache_enabled = bool(cache_enabled)
        self._saved: list[Any] = []

    def __enter__(self) -> autocast:
        if _engine[0] == "dispatch":
            _dispatch.install(cast_args)
            region = _dispatch_region(self.dtype, self.enabled, self.cache_enabled)
            counted = self.enabled or getattr(_tls, "depth", 0) > 0  # a disabled outermost region opens none
            _tls.depth = getattr(_tls, "depth", 0) + counted
            self._saved.append((region, counted))
            return self
        mode = active_mode()
        if mode is None:
            if not self.enabled:
                self._saved.append((None, False, self.dtype, self.cache_enabled))
                return self
            mode = _MODE_CLASS()
            mode.__enter__()
            _tls.mode = mode
            self._saved.append((mode, True, mode.dtype, mode.cache_enabled))
        else:
            self._saved.append((None, mode.enabled, mode.dtype, mode.cache_enabled))
        mode.enabled, mode.dtype, mode.cache_enabled = self.enabled, self.dtype, self.cache_enabled
        return self

    def __exit__(self, *exc: object) -> None:
        saved = self._saved.pop()
        if len(saved) == 2:  # the dispatch engine's (region, counted)
            _tls.depth -= saved[1]
            saved[0].__exit__(*exc)
            return
        pushed, enabled, dtype, cache_enabled = saved
        mode = active_mode()
        if pushed is not None:
            pushed.cache.clear()
            _tls.mode = None
            pushed.__exit__(*exc)
        elif mode is not None:
            mode.enabled, mode.dtype, mode.cache_enabled = enabled, dtype, cache_enabled

    def __call__(self, fn: _T) -> _T:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.dtype, self.enabled, self.cache_enabled):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


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
