"""Per-op overhead of ``fp16kit.amp.autocast`` against ``torch.autocast`` (cast-policy.md, issue 3 section 6).

Two small-op-heavy models on CPU: a 20-layer MLP (Linear + ReLU, width 128, batch 32) and a small transformer
encoder block (d_model 64, 4 heads, seq 32, batch 8); for scale, also a 20-layer MLP of width 512 (eager
only). For each low-precision dtype (bf16, fp16) and each mode
(eager, torch.compile) we time one training forward (grad enabled, as in training, so both weight-cast caches
are in use) under each autocast, plus the forward + backward step. Timings are thread CPU time per call, the
minimum over ``--repeats`` interleaved rounds of ``--iters`` calls each (the ratio of medians is shown too); the
ratio is fp16kit / torch (1.00 = same speed). Targets (issue 11): eager <= 1.10, under torch.compile <= 1.02.

The dispatcher engine (``FP16KIT_AUTOCAST_ENGINE=dispatch``, fp16kit/amp/_dispatch.py: torch's C++ autocast plus
``torch.library`` kernels on the Autocast keys for the ops where fp16kit's table differs) is timed in the same
rounds ("dispatch" columns). Its kernels are removed (``_dispatch.uninstall``) before every round of the other
columns, so torch.autocast is timed pristine; the last column times torch.autocast *with* them installed: what plain
torch.autocast code pays in a process that also uses the engine (a Python hop on each overridden op).

A further column, "bare mode", times torch.autocast with an empty ``TorchFunctionMode`` pushed on top (its
``__torch_function__`` only calls the op): the floor of any design that intercepts ops with a Python mode, which
fp16kit's autocast does. Its ratio shows how much of fp16kit's overhead is the interception itself.

Under torch.compile the script also reports, per model and dtype, why the two differ (``compile_diagnosis``):
whether the traced forward graphs (AOT, aten level) are the same op for op and dtype for dtype, how many guards
Dynamo installs under each autocast, and how many ``__torch_function__`` calls the *compiled* forward still makes at
run time (the compiled code's own Python-level torch calls, which pass through any active mode).

    python benchmarks/bench_autocast.py            # writes benchmarks/results/autocast.md and prints it
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fp16kit.amp import _dispatch, autocast_mode
from fp16kit.amp import autocast as fp16kit_autocast

RESULTS = Path(__file__).resolve().parent / "results" / "autocast.md"
# CPU time of this thread: with torch.set_num_threads(1) all the work runs here, and time the scheduler gives to
# other processes on a shared machine is not counted (wall-clock medians there swung by 2x between runs).
_clock = time.thread_time


def mlp(width: int = 128, depth: int = 20) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def transformer_block(d_model: int = 64) -> nn.Module:
    return nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)


def _paired(fns: dict[str, Callable[[], object]], iters: int, repeats: int) -> dict[str, float]:
    """Seconds per call of each fn: the minimum over ``repeats`` rounds of ``iters`` calls, rounds interleaved
    (A B B A ...) so that load drift on a shared machine hits both sides alike. On a busy machine interference
    only ever adds time, so the minimum is the estimate of the intrinsic cost; the median is reported beside it.
    Before each round (untimed) the engine state its column needs is set (:func:`_setup`) and three calls warm
    the caches."""
    names = list(fns)
    for n, fn in fns.items():
        _setup(n)
        for _ in range(3):
            fn()
    rounds: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names if r % 2 == 0 else reversed(names):
            fn = fns[n]
            _setup(n)
            # untimed calls after the state switch: (un)registering the engine's ~200 kernels leaves the caches
            # cold, which the first calls of a short round would otherwise pay (measured: ~3% on the compiled MLP,
            # whose forward hits none of the kernels)
            for _ in range(3):
                fn()
            t0 = _clock()
            for _ in range(iters):
                fn()
            rounds[n].append((_clock() - t0) / iters)
    out = {n: min(v) for n, v in rounds.items()}
    out.update({f"{n} median": statistics.median(v) for n, v in rounds.items()})
    return out


class _BareMode(TorchFunctionMode):
    """A mode that intercepts every op and does nothing else: the cost of interception alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _BareModeOverAutocast:
    def __init__(self, dtype: torch.dtype) -> None:
        self.autocast, self.mode = torch.autocast("cpu", dtype=dtype), _BareMode()

    def __enter__(self) -> None:
        self.autocast.__enter__()
        self.mode.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)
        self.autocast.__exit__(*exc)


#: column -> (fp16kit engine, dispatcher kernels installed) set before its rounds
_STATE = {
    "torch.autocast": ("mode", False),
    "fp16kit.amp.autocast": ("mode", False),
    "dispatch": ("dispatch", True),
    "bare mode": ("mode", False),
    "torch.autocast, kernels installed": ("mode", True),
}


def _setup(name: str) -> None:
    engine, installed = _STATE[name]
    autocast_mode.set_engine(engine)
    if installed:
        _dispatch.install(autocast_mode.cast_args)
    else:
        _dispatch.uninstall()


def _contexts(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    return {
        "torch.autocast": lambda: torch.autocast("cpu", dtype=dtype),
        "fp16kit.amp.autocast": lambda: fp16kit_autocast(dtype=dtype),
        "dispatch": lambda: fp16kit_autocast(dtype=dtype),  # the same class; _setup selects the engine
        "bare mode": lambda: _BareModeOverAutocast(dtype),
        "torch.autocast, kernels installed": lambda: torch.autocast("cpu", dtype=dtype),
    }


def measure(model: nn.Module, x: torch.Tensor, dtype: torch.dtype, compiled: bool, backward: bool,
            iters: int, repeats: int) -> dict[str, float]:
    steps: dict[str, Callable[[], object]] = {}
    for name, ctx in _contexts(dtype).items():
        _setup(name)
        run = model
        if compiled:
            torch._dynamo.reset()
            run = torch.compile(model, fullgraph=True)

        def step(run: Callable[[torch.Tensor], torch.Tensor] = run, ctx: Callable[[], object] = ctx) -> None:
            with ctx():  # type: ignore[attr-defined]
                y = run(x)
            if backward:
                y.float().sum().backward()

        if compiled:
            step()  # compile before timing starts
        steps[name] = step
    return _paired(steps, iters, repeats)


def _aten_forward(model: nn.Module, x: torch.Tensor, ctx: Callable[[], object]) -> list[str]:
    """The forward graph AOT autograd traces under ``ctx``: one ``op[dtype]`` string per node."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _inputs: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: gm)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with ctx():  # type: ignore[attr-defined]
        compiled(x)
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    return [f"{n.target}[{getattr(n.meta.get('val'), 'dtype', None)}]" for n in nodes]


def _guard_count(model: nn.Module, x: torch.Tensor, ctx: Callable[[], object]) -> int:
    torch._dynamo.reset()
    with ctx():  # type: ignore[attr-defined]
        return len(torch._dynamo.explain(model)(x).out_guards or [])


def _runtime_interceptions(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> int:
    """``__torch_function__`` calls that fp16kit's mode receives while the already compiled forward runs."""
    from fp16kit.amp import autocast_mode

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with fp16kit_autocast(dtype=dtype):
        compiled(x)
    calls = [0]
    real = autocast_mode._AutocastMode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return real(self, func, types, args, kwargs)

    autocast_mode._AutocastMode.__torch_function__ = counting
    try:
        with fp16kit_autocast(dtype=dtype):
            compiled(x)
    finally:
        autocast_mode._AutocastMode.__torch_function__ = real
    return calls[0]


def compile_diagnosis(label: str, model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> str:
    ctxs = _contexts(dtype)
    ours, ref = ctxs["fp16kit.amp.autocast"], ctxs["torch.autocast"]
    _setup("torch.autocast")
    ref_graph = _aten_forward(model, x, ref)
    same = _aten_forward(model, x, ours) == ref_graph
    guards = (_guard_count(model, x, ref), _guard_count(model, x, ours), _guard_count(model, x, ctxs["bare mode"]))
    calls = _runtime_interceptions(model, x, dtype)
    _setup("dispatch")
    same_dispatch = _aten_forward(model, x, ctxs["dispatch"]) == ref_graph
    guards_dispatch = _guard_count(model, x, ctxs["dispatch"])
    _setup("torch.autocast")
    return (
        f"| {label} | {str(dtype).removeprefix('torch.')} | {'yes' if same else 'NO'} "
        f"| {'yes' if same_dispatch else 'NO'} | {guards[0]} | {guards[1]} | {guards_dispatch} "
        f"| {guards[2]} | {calls} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows (slow to compile)")
    ap.add_argument("--only", default="", help="comma-separated model label prefixes to run (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least noise on a shared box)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # (label, model, input, also under torch.compile)
    cases = [
        ("MLP 20x(Linear128+ReLU), batch 32", mlp(), torch.randn(32, 128), True),
        ("TransformerEncoderLayer d64 h4, 8x32 tokens", transformer_block(), torch.randn(8, 32, 64), True),
        # for scale: layers big enough that the per-op cost is small against the matmuls (eager only)
        ("MLP 20x(Linear512+ReLU), batch 64", mlp(512), torch.randn(64, 512), False),
    ]
    lines = [
        "# autocast overhead: fp16kit.amp.autocast vs torch.autocast",
        "",
        f"Machine: {platform.machine()} CPU, {os.cpu_count()} cores, torch {torch.__version__}, load average at the "
        f"start (1, 5, 15 min) {', '.join(f'{v:.2f}' for v in os.getloadavg())}, "
        f"{torch.get_num_threads()} thread, thread CPU time, {args.repeats} interleaved rounds x {args.iters} calls. "
        "Per call: minimum over interleaved rounds (the median beside it); ratio = fp16kit / torch "
        "(targets: eager <= 1.10, compile <= 1.02). fp16kit = the mode engine (default); dispatch = the dispatcher "
        "engine (FP16KIT_AUTOCAST_ENGINE=dispatch). 'bare mode' = torch.autocast plus an empty TorchFunctionMode, "
        "the floor of any Python-mode design. 'torch, kernels in' = torch.autocast with the dispatcher engine's "
        "kernels installed. Shared, noisy machine (other jobs running): compare ratios, not times.",
        "",
        "| model | dtype | mode | step | torch.autocast (ms) | fp16kit (ms) | ratio | ratio of medians "
        "| dispatch (ms) | dispatch ratio | dispatch ratio of medians | bare mode ratio | torch, kernels in ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if args.only:
        cases = [c for c in cases if any(c[0].startswith(p) for p in args.only.split(","))]
    for label, model, x, compile_too in cases:
        modes = [False, True] if compile_too and not args.no_compile else [False]
        for dtype in (torch.bfloat16, torch.float16):
            for compiled in modes:
                for backward in (False, True):
                    t = measure(model, x, dtype, compiled, backward, args.iters, args.repeats)
                    ref, ours = t["torch.autocast"], t["fp16kit.amp.autocast"]
                    med = t["fp16kit.amp.autocast median"] / t["torch.autocast median"]
                    bare = t["bare mode"] / ref
                    disp = t["dispatch"]
                    disp_med = t["dispatch median"] / t["torch.autocast median"]
                    kernels_in = t["torch.autocast, kernels installed"] / ref
                    row = (f"| {label} | {str(dtype).removeprefix('torch.')} | {'compile' if compiled else 'eager'} "
                           f"| {'fwd+bwd' if backward else 'fwd'} | {ref * 1e3:.3f} | {ours * 1e3:.3f} "
                           f"| {ours / ref:.2f} | {med:.2f} | {disp * 1e3:.3f} | {disp / ref:.2f} | {disp_med:.2f} "
                           f"| {bare:.2f} | {kernels_in:.2f} |")
                    print(row, flush=True)
                    lines.append(row)
    if not args.no_compile:
        lines += [
            "",
            "Under torch.compile (diagnosis, same models): are the forward graphs AOT autograd traces the same (op by "
            "op, dtype by dtype)? Guards Dynamo installs; `__torch_function__` calls fp16kit's mode still gets while "
            "the compiled forward runs (the bare mode receives the same ones).",
            "",
            "| model | dtype | same aten forward graph | same, dispatch engine | guards torch.autocast "
            "| guards fp16kit | guards dispatch | guards bare mode | mode calls per compiled forward |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for label, model, x, compile_too in cases:
            if compile_too:
                for dtype in (torch.bfloat16, torch.float16):
                    row = compile_diagnosis(label, model, x, dtype)
                    print(row, flush=True)
                    lines.append(row)
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print()
    print(text)


if __name__ == "__main__":
    main()
