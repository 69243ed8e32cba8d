"""``torch.amp.custom_fwd`` / ``custom_bwd`` inside fp16kit regions: the backward re-enters the forward's region.

torch's pair records torch's autocast state for one device type on the Function's ``ctx`` in the forward
(``custom_fwd`` sets ``ctx._dtype`` and then ``ctx._fwd_used_autocast``) and re-enters it around the backward
(``custom_bwd``: ``torch.autocast(device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype)``), both in
``torch/amp/autocast_mode.py``. fp16kit's part of the region (the dispatcher engine's marker, the mode engine's
``TorchFunctionMode``) is not in that state, so the backward of such a Function ran under torch's table (dispatcher
engine) or with nothing cast (mode engine) where its forward ran under fp16kit's rows.

:func:`install` makes ``_fwd_used_autocast`` a property of ``torch.autograd.function.FunctionCtx``, a base of
``BackwardCFunction``, the class of every custom Function's ``ctx``. Setting it (torch's ``custom_fwd``, in the
forward) also stores ``capture()`` on the ctx, when an fp16kit region is active. Reading it while that ctx is the
autograd node running on this thread (torch's ``custom_bwd``, in the backward, right before it enters
``torch.autocast``) marks the ctx as pending; :func:`backward_state` hands the recorded state to the
``torch.autocast`` hook (``_nesting`` -> ``autocast_mode.torch_region_enter``), which re-enters it around the
backward: the backward's ops see the rows, dtype and cache setting of the forward's region, as with
``fp16kit.amp.custom_bwd``. Any other code path (a Function without torch's decorators, a forward outside every
region, the attribute read elsewhere) is left as it was; the value read and written is the value torch set.

Under ``torch.compile`` Dynamo traces the forward with a symbolic ctx (a ``FunctionCtx``) and bakes torch's
autocast state into the compiled backward, where fp16kit's part of the region would be lost. So the property sits
on ``FunctionCtx``, the class Dynamo traces the ctx as, and is a ``property`` of module functions because Dynamo
inlines those (not an arbitrary descriptor object): traced outside every fp16kit region, the setter only stores the
value (torch's decorators compile as without fp16kit, ``fullgraph=True`` included); traced inside a region, it
calls itself through :func:`call_eagerly`, which Dynamo may not trace, so the Function runs eagerly and its
backward re-enters the region as above: the compiled code gives the eager bits
(``tests/amp/test_checkpointing.py::test_compiled_torch_amp_custom_fwd_bwd_equal_eager``). With ``fullgraph=True``
that graph break is an error whose message says why and what to do; ``fp16kit.amp.custom_fwd`` takes the same exit.
torch 2.11's Dynamo stores the traced ctx's attribute without calling the setter
(``fp16kit._versions.dynamo_calls_ctx_property_setters``): there the Function still traces whole (docs/autocast.md).
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["backward_state", "call_eagerly", "install", "installed", "recorded"]

_NAME = "_fwd_used_autocast"  # what torch's custom_fwd sets on ctx and custom_bwd reads
_STATE = "_fp16kit_region_state"
_HOOKS: list[Callable[[], Any]] = []  # [capture, traced_region]
_RECORDED: list[bool] = []  # one entry once a ctx recorded a region: until then the torch.autocast hook skips this
_WARNED: list[bool] = []  # the cast_inputs warning, once per process
_tls = threading.local()


def _get(ctx: Any) -> Any:
    """``ctx._fwd_used_autocast`` (see the module docstring): marks the ctx pending when torch's ``custom_bwd`` reads
    it in the backward of a Function whose forward recorded a region."""
    d = ctx.__dict__
    if torch.compiler.is_compiling():  # a traced backward: the value only (a ctx traced in a region ran eagerly)
        return d[_NAME]
    try:
        value = d[_NAME]
    except KeyError:
        raise AttributeError(f"{type(ctx).__name__!r} object has no attribute {_NAME!r}") from None
    if _STATE in d and torch._C._current_autograd_node() is ctx:
        _tls.pending = ctx  # torch's custom_bwd: it enters torch.autocast next
    return value


def _set(ctx: Any, value: Any) -> None:
    """``ctx._fwd_used_autocast = value`` (torch's ``custom_fwd``): also records the region, inside one."""
    if torch.compiler.is_compiling():
        if _HOOKS[1]():  # inside a region: leave the trace, record it eagerly
            call_eagerly(_set, ctx, value)
        else:
            ctx.__dict__[_NAME] = value
        return
    d = ctx.__dict__
    d[_NAME] = value
    state = _HOOKS[0]()
    if state is None:
        d.pop(_STATE, None)
        return
    d[_STATE] = state
    if not _RECORDED:
        _RECORDED.append(True)
    if state[0] == "mode" and not value and not _WARNED:
        _warn_if_cast_inputs(sys._getframe(1))


def _delete(ctx: Any) -> None:
    ctx.__dict__.pop(_NAME, None)
    ctx.__dict__.pop(_STATE, None)


@torch._dynamo.disable(
    reason="fp16kit: an autograd.Function decorated with torch.amp.custom_fwd or fp16kit.amp.custom_fwd, called inside "
    "an fp16kit.amp.autocast region, runs eagerly: its backward must run under the region, which a traced backward "
    "cannot (it would run under torch's autocast table alone). Compile without fullgraph=True (the rest of the "
    "code still compiles), or call the Function outside the compiled code."
)
def call_eagerly(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` outside Dynamo's trace: a graph break whose reason says why (see the module docstring)."""
    return fn(*args)


def _warn_if_cast_inputs(frame: Any) -> None:
    """Under the mode engine, torch's ``custom_fwd(cast_inputs=...)`` reads torch's own autocast flag, which the mode
    engine keeps off inside its regions: it neither casts the inputs nor turns casting off. Say so once."""
    if frame.f_code.co_name != "decorate_fwd" or frame.f_locals.get("cast_inputs") is None:
        return
    _WARNED.append(True)
    warnings.warn(
        "torch.amp.custom_fwd(cast_inputs=...) inside an fp16kit.amp.autocast region of the mode engine "
        "(FP16KIT_AUTOCAST_ENGINE=mode): torch's decorator tests torch's own autocast flag, which that engine keeps "
        "off, so it neither casts the inputs nor disables casting in the forward (the region's rows apply there and "
        "in the backward). Use fp16kit.amp.custom_fwd(cast_inputs=...) and fp16kit.amp.custom_bwd (same arguments), "
        "or the default dispatcher engine.",
        UserWarning,
        stacklevel=3,
    )


def _torch_sets_the_attribute() -> bool:
    """True when torch's ``custom_fwd``/``custom_bwd`` still record their state under ``_fwd_used_autocast``."""
    from torch.amp import autocast_mode as torch_autocast_mode

    def names(code: Any) -> set[str]:
        out = set(code.co_names)
        for const in code.co_consts:
            if hasattr(const, "co_names"):
                out |= names(const)
        return out

    return all(
        _NAME in names(getattr(fn, "__code__", None) or compile("", "", "exec"))
        for fn in (torch_autocast_mode.custom_fwd, torch_autocast_mode.custom_bwd)
    )


def install(capture: Callable[[], Any], traced_region: Callable[[], bool]) -> bool:
    """Install the property (once); ``capture()`` returns this thread's region state, or None outside every
    region; ``traced_region()``, which Dynamo must be able to trace, is True inside a region. Returns False,
    installing nothing, when torch's decorators no longer use ``_fwd_used_autocast`` (a torch outside fp16kit's tested
    range: their backward then runs under torch's state alone, as documented)."""
    if _HOOKS:
        return True
    classes = (torch.autograd.function.FunctionCtx, torch.autograd.function.BackwardCFunction)
    if any(_NAME in vars(cls) for cls in classes) or not _torch_sets_the_attribute():
        return False
    _HOOKS.extend((capture, traced_region))
    accessor = property(_get, _set, _delete, "fp16kit/amp/_torch_custom_fn.py")
    setattr(torch.autograd.function.FunctionCtx, _NAME, accessor)
    return True


def installed() -> bool:
    """True once :func:`install` put the property on ``FunctionCtx``."""
    return bool(_HOOKS)


def recorded() -> bool:
    """True once some ctx recorded a region (a cheap test for the ``torch.autocast`` hook)."""
    return bool(_RECORDED)


def backward_state(enabled: bool, dtype: torch.dtype) -> Any:
    """The region state to re-enter around a ``torch.autocast(enabled, dtype)`` being entered on this thread, or
    None: not None only when torch's ``custom_bwd`` of a ctx that recorded a region enters it (the ctx is the running
    autograd node, its ``_fwd_used_autocast`` was just read, and the region's arguments are the ones it recorded)."""
    ctx = getattr(_tls, "pending", None)
    if ctx is None:
        return None
    _tls.pending = None
    d = ctx.__dict__
    if torch._C._current_autograd_node() is not ctx or d.get(_NAME) != enabled or d.get("_dtype") != dtype:
        return None
    return d.get(_STATE)
