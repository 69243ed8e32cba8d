"""8-bit optimizer state (``state_bits=8``), in one place: its rule, its Triton device functions, its torch twin.

``rule.py``: the block-wise quantization rule (code books, ``quantize``/``dequantize``, the state layout, the
``SMALL_NUMEL`` threshold below which moments stay fp32); ``triton.py``: the same rule as Triton device functions,
which the Adam and LAMB kernels (``fp16kit/kernels/triton/adam.py``, ``fp16kit/kernels/triton/lamb.py``) call under
their ``QSTATE`` flag; ``fallback.py``: the torch twin of 8-bit Adam and LAMB (the CPU path, and every row the
kernels do not take). The float64 reference is ``fp16kit/numerics/reference/state8.py``; sharded (DTensor) 8-bit
state is ``fp16kit/optim/_state8_dtensor.py``. The rule's two sizes are re-exported here
(``fp16kit.kernels.state8.SMALL_NUMEL``, ``QBLOCK``); the functions users call are ``fp16kit.kernels``'.

May import: torch, triton, numpy, ``fp16kit.kernels.engine`` and ``fp16kit.kernels.fallback`` (the twin builds on
the fp32 twins); never the Triton side's operation modules or the public ops.
"""

from .rule import QBLOCK, SMALL_NUMEL

__all__ = ["QBLOCK", "SMALL_NUMEL"]
