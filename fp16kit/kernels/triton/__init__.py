"""The Triton side: one module per multi-tensor operation, each a kernel (``@triton.jit``) and its launcher.

``adam.py``, ``lamb.py`` (two stages), ``sgd.py``, ``adagrad.py``, ``novograd.py``: the optimizer steps;
``l2norm.py``: sums of squares (``l2norm``, the optimizers' check-and-norm pass); ``unscale.py``:
``unscale_and_check``; ``copy.py``: the cast copy ``copy_``; ``histogram.py``: ``exponent_histogram``. Each has a
torch twin of the same name in ``fp16kit/kernels/fallback/`` with the same contract, and both are checked against
one float64 reference in ``fp16kit/numerics/reference/``. Each module's ``LAUNCH`` pins its kernels' launch options
(``num_warps``, no FMA contraction). The 8-bit moments' and the bf16 weight modes' device functions are in
``fp16kit/kernels/state8/`` and ``fp16kit/kernels/bf16_weights/``.

May import: triton, torch, ``fp16kit.kernels.engine``, ``fp16kit.kernels.state8``, ``fp16kit.kernels.bf16_weights``
and each other (LAMB and NovoGrad reuse ``l2norm.py``'s segment sums); never the torch side or the public ops.
"""
