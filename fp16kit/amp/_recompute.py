"""Activation checkpointing under fp16kit's autocast: the recomputation runs under the forward's region.

``torch.utils.checkpoint`` saves torch's autocast state at a checkpointed forward (``_get_autocast_kwargs``: the
enabled flag and dtype of the inputs' device type and of ``"cpu"``) and re-enters it with ``torch.autocast`` when
backward recomputes the block. fp16kit's part of the state (the dispatcher engine's marker, the mode engine's
``TorchFunctionMode``) is not in it, so without this module the recomputation ran under torch's tables: other
dtypes than the forward (torch's ``CheckpointError`` with ``use_reentrant=False``; silently different gradients,
or a dtype error on bf16 models, with ``use_reentrant=True``).

:func:`install` hooks the two places torch records a block to recompute, both in ``torch/utils/checkpoint.py``:

* reentrant: ``CheckpointFunction.forward`` keeps ``ctx.run_function`` for its backward; after the forward, it is
  replaced by the same function run under the recorded region state;
* non-reentrant (``checkpoint(use_reentrant=False)``, ``checkpoint_sequential``, torch.distributed's
  ``checkpoint_wrapper`` / composable ``checkpoint``, selective checkpointing): ``_CheckpointFrame`` is built at the
  forward with the ``recompute_fn`` that backward calls; the checkpointed function it calls gets the same wrapper.

In both, torch re-enters its own autocast state first and fp16kit's region inside it, right around the function,
so a ``torch.autocast`` entered inside the function meets the region as it did in the forward.

The state is captured when the block's forward starts (what torch does for its own) and re-entered by
``autocast_mode.replay``; both are handed in by ``autocast_mode`` (this module imports nothing of the engines).
Under ``torch.compile`` torch traces a checkpointed block as a higher-order op and recomputes inside the graph:
neither hook runs, and the traced casts are the forward's. Everything else torch saves (RNG, device context) is
untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["install", "installed"]

_HOOKS: list[tuple[Callable[[], Any], Callable[[Any], Any]]] = []


def _replaying(fn: Callable[..., Any], state: Any) -> Callable[..., Any]:
    replay = _HOOKS[0][1]

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with replay(state):
            return fn(*args, **kwargs)

    return run


def _replaying_inside(recompute_fn: Callable[..., Any], state: Any) -> Callable[..., Any]:
    """``recompute_fn`` with the checkpointed function it calls run under ``state``.

    torch's ``recompute_fn`` (a closure of ``_checkpoint_without_reentrant_generator``) enters ``torch.autocast``
    with the saved kwargs and then calls the checkpointed ``fn``, a cell of its closure. The region is re-entered
    around ``fn`` itself (the cell now holds the wrapper), so torch restores its own state first and fp16kit's
    second, in the order of the reentrant path; a ``torch.autocast`` that ``fn`` enters is then seen inside the
    region, as in the forward. A ``recompute_fn`` without that cell is wrapped whole."""
    code = getattr(recompute_fn, "__code__", None)
    closure = getattr(recompute_fn, "__closure__", None)
    if code is not None and closure and "fn" in code.co_freevars:
        cell = closure[code.co_freevars.index("fn")]
        cell.cell_contents = _replaying(cell.cell_contents, state)
        return recompute_fn
    return _replaying(recompute_fn, state)


def install(capture: Callable[[], Any], replay: Callable[[Any], Any]) -> None:
    """Hook ``torch.utils.checkpoint`` (once). ``capture()`` returns this thread's region state; ``replay(state)`` is
    a context manager re-entering it. Raises when torch's checkpoint module does not have the shape hooked here (a
    torch outside fp16kit's tested range), naming the fix, rather than recompute silently under other dtypes."""
    if _HOOKS:
        return
    from torch.utils import checkpoint as cp

    function = getattr(cp, "CheckpointFunction", None)
    frame = getattr(cp, "_CheckpointFrame", None)
    if function is None or frame is None or "forward" not in vars(function) or "__init__" not in vars(frame):
        raise RuntimeError(
            f"fp16kit.amp: torch {torch.__version__}'s torch/utils/checkpoint.py has no CheckpointFunction.forward "
            "or _CheckpointFrame.__init__, where fp16kit re-enters its autocast region for recomputation. Use a torch "
            "in fp16kit's tested range (docs/compat.md), or FP16KIT_AUTOCAST_ENGINE=mode without checkpointing."
        )
    _HOOKS.append((capture, replay))
    forward = function.forward  # a staticmethod: the plain function

    @functools.wraps(forward)
    def checkpoint_forward(ctx: Any, run_function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        state = capture()
        out = forward(ctx, run_function, preserve_rng_state, *args)
        ctx.run_function = _replaying(run_function, state)  # what CheckpointFunction.backward recomputes
        return out

    checkpoint_forward.__fp16kit_wrapped__ = forward  # type: ignore[attr-defined]
    function.forward = staticmethod(checkpoint_forward)

    init = frame.__init__

    @functools.wraps(init)
    def frame_init(self: Any, recompute_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        init(self, _replaying_inside(recompute_fn, capture()), *args, **kwargs)

    frame_init.__fp16kit_wrapped__ = init  # type: ignore[attr-defined]
    frame.__init__ = frame_init


def installed() -> bool:
    """True once :func:`install` hooked ``torch.utils.checkpoint``."""
    return bool(_HOOKS)
