"""Issue 20: "a trace on fake CUDA tensors (FakeTensorMode) must show no CPU->CUDA copy and no .item() in the step".

What runs here, on a CPU-only torch: the optimizer's tensors are ``FakeTensor``s on device ``cuda`` (a
``FakeTensorMode`` makes them without a GPU), and ``torch.compile(opt.step, fullgraph=True)`` traces the step with
Dynamo and AOTAutograd; a ``fw_compiler`` receives the aten graph of the whole step (fp16kit's passes appear as the
``fp16kit::`` dispatcher ops, fp16kit/kernels/library.py, whose fake implementations run on fake tensors). The graph
is checked node by node: no tensor moved from the CPU to CUDA (``_to_copy``/``copy_``/``copy`` from a CPU value, a
host constant lifted into the graph), no value read back (``_local_scalar_dense``, ``item``), every op on CUDA
values. Running the compiled graph needs a GPU, so only the trace is checked.

What cannot run this way, and why: the *eager* device step (``FusedOptimizer._step_on_device``) launches Triton
kernels over address tables built from ``data_ptr()``. A ``FakeTensor`` has no storage (its ``data_ptr()`` is 0
for every tensor, so the planner's overlap check refuses the rows, and there are no addresses to pack), and Triton
cannot launch without a GPU driver. Its torch ops are checked on CPU tensors instead (the same code runs for CUDA
tensors except the ``"warn"`` report): ``test_step_creates_no_host_value_and_reads_nothing_back`` in
test_device_step.py and test_device_step_apex.py (no ``_to_copy``, ``copy_``, ``lift_fresh``, ``full``,
``_local_scalar_dense``), and on a GPU by ``test_eager_step_copies_nothing_to_the_device`` (the profiler's HtoD
count). Also, with a CPU-only torch: the params do not require grad (AOTAutograd would build autograd metadata for
them, which needs the CUDA device guard) and the state and step counter are made before tracing (the first step
creates them; "after the first" is what is checked); a tensor ``lr`` is left out (its device check uses
``bitwise_not``, whose fake kernel needs the CUDA device guard too).
"""

from __future__ import annotations

import pytest
import torch

from fp16kit.optim import FusedAdam, FusedLAMB

MAKERS = {
    "adam": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
    "adamw-bf16-masters": lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01, master_weights=True),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, max_grad_norm=1.0),
}
DTYPES = {"adamw-bf16-masters": torch.bfloat16}
READS = ("aten._local_scalar_dense", "aten.item", "aten.tolist")
COPIES = ("_to_copy", "copy_", "aten.copy.", "lift_fresh", "_copy_from")


def _device_of(value):
    return getattr(value, "device", None)


def _trace(kind: str, with_scaler: bool):
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    dtype = DTYPES.get(kind, torch.float32)
    with fake:
        ps = [torch.empty(n, device="cuda", dtype=dtype) for n in (64, 33, 7)]
        for p in ps:
            p.grad = torch.empty_like(p)
        opt = MAKERS[kind](ps)
        for p in ps:
            opt._state_for(p)  # the first step's state: made before the traced step
        step = opt.param_groups[0]["step"] = torch.zeros(1, device="cuda")
        opt._known_steps[0] = step
        if with_scaler:  # a GradScaler's hand-over
            opt.grad_scale = torch.full((1,), 1024.0, device="cuda")
            opt.found_inf = torch.zeros(1, device="cuda")
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(opt.step, backend=aot_autograd(fw_compiler=capture), fullgraph=True)
        with fake:
            compiled()
    except RuntimeError as e:  # running the graph needs a CUDA build; the trace is what is checked
        if not graphs or "cuda" not in str(e).lower():
            raise
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, "one graph, no break"
    return graphs[0].graph


@pytest.mark.parametrize("with_scaler", [False, True])
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_compiled_step_on_fake_cuda_tensors_copies_nothing_and_reads_nothing(kind, with_scaler):
    graph = _trace(kind, with_scaler)
    ops = [n for n in graph.nodes if n.op == "call_function"]
    names = [str(n.target) for n in ops]
    # the passes are in the graph: fp16kit ops (AOTAutograd wraps the mutating ones in auto_functionalized)
    passes = [str(n.args[0]) if "auto_functionalized" in str(n.target) else str(n.target) for n in ops]
    assert any(name.startswith("fp16kit.") for name in passes), names
    assert not [name for name in names if name.startswith(READS)], names
    bad = []
    for n in ops:
        out = n.meta.get("val")
        inputs = [a.meta.get("val") for a in n.args if isinstance(a, torch.fx.Node)]
        devices = {str(_device_of(v)) for v in inputs if _device_of(v) is not None}
        if any(c in str(n.target) for c in COPIES) and "cpu" in devices:
            bad.append(f"{n.target}: {devices} -> {_device_of(out)}")
        elif _device_of(out) is not None and _device_of(out).type != "cuda":
            bad.append(f"{n.target} makes a {_device_of(out)} value")
    assert not bad, bad
