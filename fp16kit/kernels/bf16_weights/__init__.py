"""bf16 weights without an fp32 master (``master_weights="split"`` / ``"stochastic"``), in one place.

``modes.py`` holds both write modes whole: the rule (split ``16+16`` halves, stochastic rounding keyed by Philox),
the Triton device functions the Adam and LAMB kernels call under their ``WEIGHTS`` constexpr
(``fp16kit/kernels/triton/adam.py``, ``fp16kit/kernels/triton/lamb.py``), and the torch twin that wraps the torch
Adam/LAMB steps (``fp16kit/kernels/fallback/adam.py``, ``fp16kit/kernels/fallback/lamb.py``). The float64
reference is ``fp16kit/numerics/reference/bf16_weights.py``.

May import: torch, triton, ``fp16kit.kernels.engine`` and ``fp16kit.kernels.fallback``; never the Triton side's
operation modules or the public ops.
"""
