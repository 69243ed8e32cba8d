"""Decorators and registrations that put user code under the cast policy (apex ``amp.half_function``,
``amp.register_half_function`` & co, torch ``custom_fwd``).

* ``register_half_function`` / ``register_float_function`` / ``register_promote_function``: a row of the table for
  ``module.name`` (``policy.register_row``); a plain Python function is wrapped so the row applies to it.

* :func:`half_function` / :func:`float_function` / :func:`promote_function`: a user function gets a fixed
  rule (LOW / FP32 / PROMOTE). Inside an enabled :class:`~fp16kit.amp.autocast` region its eligible inputs are
  cast before it runs; the ops inside it are still seen by the policy (as with apex). Outside, it runs as called.
* :func:`custom_fwd` / :func:`custom_bwd`: for ``torch.autograd.Function``. ``custom_fwd`` records the caller's
  autocast state on ``ctx``; with ``cast_inputs=dtype`` the forward's floating inputs are cast to ``dtype`` and the
  forward runs with casting disabled (like ``torch.amp.custom_fwd``). ``custom_bwd`` runs the backward under the
  state recorded by the forward, so the backward sees the forward's policy, whatever thread or region it runs in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from . import policy
from .autocast_mode import (
    active_mode,
    autocast,
    call_eagerly,
    cast_all,
    disable_casts,
    region_state,
    replay,
    rule_wrapper,
    table_wrapper,
    traced_inside_a_region,
)
from .policy import Rule

__all__ = [
    "custom_bwd",
    "custom_fwd",
    "float_function",
    "half_function",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
]

_T = TypeVar("_T", bound=Callable[..., Any])


def half_function(fn: _T) -> _T:
    """Decorator: under autocast, cast ``fn``'s eligible tensor inputs to the region's fp16/bf16 dtype (LOW)."""
    return rule_wrapper(fn, Rule.LOW)


def float_function(fn: _T) -> _T:
    """Decorator: under autocast, cast ``fn``'s eligible tensor inputs to float32 (FP32)."""
    return rule_wrapper(fn, Rule.FP32)


def promote_function(fn: _T) -> _T:
    """Decorator: under autocast, if ``fn``'s eligible inputs mix dtypes, cast them all to the widest (PROMOTE)."""
    return rule_wrapper(fn, Rule.PROMOTE)


# ----------------------------------------------------------------------------------------------------------------
# registration (apex amp.register_*_function)
# ----------------------------------------------------------------------------------------------------------------


def _register(module: Any, name: str, rule: Rule) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    fn = getattr(module, name)
    fn = getattr(fn, "__fp16kit_wrapped__", fn)  # registering twice re-targets the original, never the wrapper
    if fn not in policy.overridable() and getattr(getattr(module, name), "__fp16kit_wrapped__", None) is None:
        # A plain Python function never reaches __torch_function__: route it through a wrapper that reads the
        # table at call time (so overrides apply), as apex patches the module attribute.
        setattr(module, name, table_wrapper(fn))
    policy.register_row(policy.registration_row(module, name), fn, rule)


def register_half_function(module: Any, name: str) -> None:
    """Make ``module.name`` a LOW op: its eligible inputs are cast to the region's fp16/bf16 dtype.

    Works for torch callables (``register_half_function(torch, "tanh")``) and for user functions (the module
    attribute is replaced by a wrapper, as apex does: call it before importing ``name`` with ``from m import``).
    Raises ``ValueError("No function named {name} in module {module}.")`` when the attribute does not exist.
    """
    _register(module, name, Rule.LOW)


def register_float_function(module: Any, name: str) -> None:
    """Make ``module.name`` an FP32 op (eligible inputs cast to float32). See :func:`register_half_function`."""
    _register(module, name, Rule.FP32)


def register_promote_function(module: Any, name: str) -> None:
    """Make ``module.name`` a PROMOTE op (mixed eligible inputs cast to the widest).

    See :func:`register_half_function`.
    """
    _register(module, name, Rule.PROMOTE)


# ----------------------------------------------------------------------------------------------------------------
# custom autograd functions
# ----------------------------------------------------------------------------------------------------------------


@overload
def custom_fwd(fwd: _T, *, device_type: str | None = None, cast_inputs: torch.dtype | None = None) -> _T: ...
@overload
def custom_fwd(
    fwd: None = None, *, device_type: str | None = None, cast_inputs: torch.dtype | None = None
) -> Callable[[_T], _T]: ...


def _check_device_type(where: str, device_type: str | None) -> None:
    if device_type is not None and not isinstance(device_type, str):
        raise ValueError(f"{where}(device_type={device_type!r}): expected a str such as 'cuda' or 'cpu', or None.")


def custom_fwd(fwd: Any = None, *, device_type: str | None = None, cast_inputs: torch.dtype | None = None) -> Any:
    """Decorator for the ``forward`` staticmethod of a ``torch.autograd.Function``.

    ``device_type`` is accepted so that ``torch.amp.custom_fwd(device_type=...)`` can be swapped for this one
    unchanged; fp16kit's regions apply to tensors of every device, so it selects nothing. Unlike torch's, which
    records and re-enters torch's autocast state for that device only, this pair records the fp16kit region.

    Records the caller's autocast state (enabled, dtype) on ``ctx`` for :func:`custom_bwd`. With
    ``cast_inputs=dtype`` and an enabled region, floating (non-float64) tensor inputs, positional or keyword
    (``Fn.apply(a, b=t)``; also inside lists/tuples), are cast to ``dtype`` and
    the forward runs inside :func:`~fp16kit.amp.disable_casts` (so it computes exactly in ``dtype``); the backward
    then also runs with casting disabled. Outside a region it runs as called.
    """
    if cast_inputs is not None and not (isinstance(cast_inputs, torch.dtype) and cast_inputs.is_floating_point):
        raise ValueError(f"custom_fwd(cast_inputs={cast_inputs!r}): expected a floating torch.dtype or None.")
    _check_device_type("custom_fwd", device_type)
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if torch.compiler.is_compiling() and traced_inside_a_region():
            # the backward must run under the region, which a traced backward cannot: run the Function eagerly
            return call_eagerly(run, args, kwargs)
        ctx, args = args[0], args[1:]
        mode = active_mode()
        enabled = mode is not None and mode.enabled
        ctx._fp16kit_state = (enabled and cast_inputs is None, mode.dtype if mode is not None else torch.float16)
        if not enabled or cast_inputs is None:
            return fwd(ctx, *args, **kwargs)
        args = cast_all(args, cast_inputs, mode)
        kwargs = {k: cast_all((v,), cast_inputs, mode)[0] for k, v in kwargs.items()}
        with disable_casts():
            return fwd(ctx, *args, **kwargs)

    return _with_positional_signature_of(fwd, run)


def _with_positional_signature_of(fwd: Any, run: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Any:
    """A function with ``fwd``'s positional parameters (names and defaults) that calls ``run(args, kwargs)``.

    Why not a plain ``(ctx, *args, **kwargs)`` wrapper: ``torch.autograd.Function.apply`` (C++) binds keyword
    arguments to the positional parameter names it reads from ``forward.__code__`` and calls ``forward`` with
    positional arguments only. Behind a ``*args`` wrapper, ``Fn.apply(a, b=t)`` raised "forward() got an
    unexpected keyword argument 'b'", though it works on an undecorated forward. With the same names, such a
    keyword tensor arrives positionally and is cast like every other input. The function is generated from
    the parameter names (``exec`` of a two-line ``def``, as ``dataclasses`` does), since only a real function's
    ``__code__`` carries them; ``*args``/``**kwargs`` of a direct call are passed through.
    """
    code = getattr(fwd, "__code__", None)
    if code is None:  # a callable object: no names to bind to, so keyword calls cannot reach it through apply

        @functools.wraps(fwd)
        def plain(*args: Any, **kwargs: Any) -> Any:
            return run(args, kwargs)

        return plain
    names = code.co_varnames[: code.co_argcount]
    if not all(n.isidentifier() and not n.startswith("_fp16kit_") for n in names):
        raise TypeError(f"custom_fwd: cannot wrap {fwd!r}: unexpected parameter names {names}.")
    head = "".join(f"{n}, " for n in names)
    source = (
        f"def forward({head}*_fp16kit_args, **_fp16kit_kwargs):\n"
        f"    return _fp16kit_run(({head}) + _fp16kit_args, _fp16kit_kwargs)\n"
    )
    namespace: dict[str, Any] = {"_fp16kit_run": run}
    exec(source, namespace)
    forward = namespace["forward"]
    forward.__defaults__ = fwd.__defaults__
    return functools.update_wrapper(forward, fwd)


@overload
def custom_bwd(bwd: _T, *, device_type: str | None = None) -> _T: ...
@overload
def custom_bwd(bwd: None = None, *, device_type: str | None = None) -> Callable[[_T], _T]: ...


def custom_bwd(bwd: Any = None, *, device_type: str | None = None) -> Any:
    """Decorator for the ``backward`` staticmethod: runs it under the autocast state its forward recorded
    (:func:`custom_fwd` must decorate the forward; without it, raises a ``RuntimeError`` saying so). The table's
    rows apply to the ops of the backward as in the forward's region, under both engines. ``device_type``: as for
    :func:`custom_fwd`."""
    _check_device_type("custom_bwd", device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)

    @functools.wraps(bwd)
    def backward(ctx: Any, *grads: Any) -> Any:
        state = getattr(ctx, "_fp16kit_state", None)
        if state is None:
            raise RuntimeError(
                f"{getattr(bwd, '__qualname__', bwd)}: custom_bwd needs the forward decorated with "
                f"fp16kit.amp.custom_fwd (it records the autocast state the backward must run under)."
            )
        enabled, dtype = state
        # replay: the region's rows apply although an autograd node is running (backward formulas are left alone)
        with autocast(dtype=dtype, enabled=enabled), replay(region_state()):
            return bwd(ctx, *grads)

    return backward  # type: ignore[return-value]
