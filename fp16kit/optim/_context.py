"""Where a step runs: inside a ``torch.compile``'d call, or while a CUDA graph captures the current stream.

Both decide what a step may do on the host: a compiled step reads nothing back and keeps no host caches Dynamo would
have to see; a captured step adds no host work to what the graph replays.
"""

from __future__ import annotations

import torch

__all__ = ["capturing", "under_torch_compile"]

try:  # Dynamo's frame callback: set inside a torch.compile'd call (while tracing, and in frames it runs eagerly)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # pragma: no cover - a torch without Dynamo's C frame hook: the trace-time check alone
    _dynamo_callback = None


def under_torch_compile() -> bool:
    """Is this code running inside a ``torch.compile``'d call: traced by Dynamo, or run eagerly after Dynamo fell
    back on a frame (an exception raised while tracing makes it run that frame eagerly)?"""
    if torch.compiler.is_compiling():
        return True
    return _dynamo_callback is not None and _dynamo_callback() not in (None, False)


def capturing() -> bool:
    """Is the current CUDA stream being captured into a graph? (Nothing may wait on the device then.)"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
