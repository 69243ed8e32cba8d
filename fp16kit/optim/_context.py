"""Where a step runs: inside a ``torch.compile``'d call, or while a CUDA graph captures the current stream; and
whether anything watches the step (torch's step hooks, the profiler).

The first two decide what a step may do on the host: a compiled step reads nothing back and keeps no host caches
Dynamo would have to see; a captured step adds no host work to what the graph replays. The third decides whether the
step runs inside torch's ``Optimizer.profile_hook_step`` wrapper (``FusedOptimizer.step``).
"""

from __future__ import annotations

import torch

# torch's registries of global step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``_post_hook``)
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

__all__ = ["capturing", "step_watched", "under_torch_compile"]

try:  # Dynamo's frame callback: set inside a torch.compile'd call (while tracing, and in frames it runs eagerly)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # pragma: no cover - a torch without Dynamo's C frame hook: the trace-time check alone
    _dynamo_callback = None

_profiler_enabled = torch._C._autograd._profiler_enabled


def under_torch_compile() -> bool:
    """Is this code running inside a ``torch.compile``'d call: traced by Dynamo, or run eagerly after Dynamo fell
    back on a frame (an exception raised while tracing makes it run that frame eagerly)?"""
    if torch.compiler.is_compiling():
        return True
    return _dynamo_callback is not None and _dynamo_callback() not in (None, False)


def capturing() -> bool:
    """Is the current CUDA stream being captured into a graph? (Nothing may wait on the device then.) No capture
    runs before CUDA is initialised, so that cheap test comes first (``is_available`` costs ~0.5 us a call)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def step_watched(optimizer: torch.optim.Optimizer) -> bool:
    """Does anything watch ``optimizer.step`` beyond its effects: a step pre or post hook (the optimizer's own or a
    global one), an active profiler (``torch.profiler``, ``emit_nvtx``, ``emit_itt``), or Dynamo tracing it? Then the
    step runs inside torch's own hook-and-profile wrapper (``torch.optim.Optimizer.profile_hook_step``); otherwise
    that wrapper would only open a profiler range no profiler records and loop over empty hook registries."""
    return bool(
        torch.compiler.is_compiling()  # (first: Dynamo then reads nothing else here)
        or optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _global_optimizer_pre_hooks
        or _global_optimizer_post_hooks
        or _profiler_enabled()
    )
