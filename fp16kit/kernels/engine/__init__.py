"""The machinery every multi-tensor operation shares, on both sides (Triton kernels and torch twins).

What is here: the argument checks (``checks.py``: every failure names the problem and the fix), the one planner
(``plan.py``: validate once, group by dtype, cache the verdict) and its address tables (``table.py``: device tables,
chunk sizes, launch geometry, CUDA-graph holds), the recorded launches a device step replays (``launch.py``), the
row bundles the optimizer ops hand to both sides (``rows.py``), the Triton device functions the kernels are built
from (``chunks.py``: chunk spans and vector loads/stores; ``rounding.py``: exact widening and round-to-nearest-even
narrowing; ``skeleton.py``: the optimizer step's shared loop and loads; ``step_scalars.py``: the device-resident
step counter and hyper-parameters; ``results.py``: the SGD/Adagrad/NovoGrad result check and launch rows), and the
exponent histogram's column layout (``histogram_bins.py``).

May import: torch, triton, numpy, ``fp16kit._versions`` and ``fp16kit.kernels.backend``; nothing else of
``fp16kit.kernels`` (the sides and the public ops import the engine, never the other way round).
"""
