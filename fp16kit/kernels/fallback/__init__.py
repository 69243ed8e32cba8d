"""The torch side: one module per multi-tensor operation, the torch twin of the Triton kernel of the same name.

A twin has its kernel's contract (inputs, outputs, flag, rounding: bit for bit where the kernel's rounding sequence
can be written in torch ops, within the ulp budgets of the tests where torch's fused CPU kernels are used) and runs
where Triton cannot (CPU tensors without the interpreter, platforms without Triton) and on tensors the kernels do
not take (non-contiguous, float64). ``adam.py``, ``lamb.py``, ``sgd.py``, ``adagrad.py``, ``novograd.py``,
``l2norm.py``, ``unscale.py``, ``copy.py``, ``histogram.py``: the twins of ``fp16kit/kernels/triton/`` (same file
names); ``step.py``: the skip, commit and math dtype the optimizer twins share; ``apex_step.py``: the step around
SGD's, Adagrad's and NovoGrad's rules; ``scratch.py``: the CPU fast paths' batches, scratch buffers and fp32 sums
of squares; ``lamb_native.py``: LAMB's opt-in C++ CPU kernel (``FP16KIT_CPU_NATIVE=1``). The 8-bit moments' twin
is ``fp16kit/kernels/state8/fallback.py``.

May import: torch, ``fp16kit.kernels.engine`` and each other; never the Triton side or the public ops.
"""
