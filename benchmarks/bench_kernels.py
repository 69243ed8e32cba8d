"""Benchmark: fused unscale-and-check and the master copy against torch's multi-tensor ops.

Workloads: a BERT-large-like gradient list (~390 tensors, 335M elements on a GPU; scaled down on CPU)
and one large tensor. Cases:

- unscale in place, fp32 grads: fp16kit ``unscale_and_check`` vs ``torch._amp_foreach_non_finite_check_and_unscale_``
- unscale fp16 grads -> fp32 master grads: fp16kit (one pass) vs torch (``_foreach_copy_`` cast, then the unscale)
- master copy fp32 -> fp16: fp16kit ``copy_`` vs ``torch._foreach_copy_``

Reports median (p20, p80) time, achieved GB/s (bytes each must move / time) and, on a GPU, the fraction of the
measured device-to-device copy bandwidth. Run: ``python benchmarks/bench_kernels.py [--device cuda] [--out FILE]``.

``--host``: host cost per call, in microseconds per tensor, at 40, 400 and 4000 tiny (4-element) CPU tensors, so
that the work is negligible and what is left is Python and dispatch. Torch backend: fp16kit's ops against torch's
own multi-tensor ops in the same interleaved rounds (1 thread). Planning alone: a cached plan (what every
repeated call pays) against validating and planning from scratch (what every call paid before the plan cache),
for the ops' rows and an optimizer's rows; with ``TRITON_INTERPRET=1`` also the Triton path's planning plus
address-table lookup (recorded table vs. computing the table cache's key). Reports min and median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp16kit.kernels import copy_, select_backend, unscale_and_check

BERT_LARGE_LAYER = [(1024, 1024), (1024,)] * 4 + [(1024,)] * 2 + [(4096, 1024), (4096,), (1024, 4096), (1024,)]
BERT_LARGE_LAYER += [(1024,)] * 2  # 16 tensors per layer


def bert_large_shapes(scale: float) -> list[tuple[int, ...]]:
    """~390 tensors like BERT-large (24 layers + embeddings + pooler); dims scaled by ``scale``."""

    def s(shape):
        return tuple(max(1, int(d * scale)) for d in shape)

    shapes = [s((30522, 1024)), s((512, 1024)), s((2, 1024)), s((1024,)), s((1024,))]
    for _ in range(24):
        shapes += [s(sh) for sh in BERT_LARGE_LAYER]
    shapes += [s((1024, 1024)), s((1024,))]
    return shapes


@dataclass
class Result:
    case: str
    workload: str
    impl: str
    median_ms: float
    p20_ms: float
    p80_ms: float
    gbps: float
    roofline: float | None


def timeit(fn: Callable[[], None], device: torch.device, reps: int) -> tuple[float, float, float]:
    """(median, p20, p80) in ms; GPU: triton.testing.do_bench; CPU: wall clock after a warm-up."""
    if device.type == "cuda":
        import triton.testing

        q = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], rep=200)
        return q[0], q[1], q[2]
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return statistics.median(times), times[int(0.2 * (len(times) - 1))], times[int(0.8 * (len(times) - 1))]


def copy_bandwidth(device: torch.device) -> float | None:
    """Measured device-to-device copy bandwidth in GB/s (bytes read + written), GPU only."""
    if device.type != "cuda":
        return None
    n = 256 * 2**20
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    med, _, _ = timeit(lambda: dst.copy_(src), device, 0)
    return 2 * n * 4 / (med * 1e-3) / 1e9


def cases_for(shapes: list[tuple[int, ...]], device: torch.device) -> list[tuple[str, int, dict]]:
    """(case, bytes moved per element, {implementation: callable}) on fresh tensors of ``shapes``."""
    g32 = [torch.randn(s, device=device) for s in shapes]
    g16 = [g.half() for g in g32]
    masters = [torch.empty_like(g) for g in g32]
    model16 = [torch.empty_like(g, dtype=torch.float16) for g in g32]
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 2.0**-16, device=device)

    def torch_cast_then_unscale():
        torch._foreach_copy_(masters, g16)
        torch._amp_foreach_non_finite_check_and_unscale_(masters, found, inv)

    return [
        ("unscale fp32 in place", 8, {
            "fp16kit": lambda: unscale_and_check(g32, inv, found),
            "torch _amp_foreach_non_finite_check_and_unscale_": lambda: (
                torch._amp_foreach_non_finite_check_and_unscale_(g32, found, inv)),
        }),
        ("unscale fp16 -> fp32 masters", 6, {
            "fp16kit (Triton: 1 pass; fallback: copy + unscale)": lambda: (
                unscale_and_check(g16, inv, found, out=masters)),
            "torch (_foreach_copy_ + unscale)": torch_cast_then_unscale,
        }),
        ("master copy fp32 -> fp16", 6, {
            "fp16kit copy_": lambda: copy_(model16, g32),
            "torch _foreach_copy_": lambda: torch._foreach_copy_(model16, g32),
        }),
    ]


def run(device: torch.device, scale: float, big: int, reps: int) -> tuple[list[Result], float | None]:
    peak = copy_bandwidth(device)
    results: list[Result] = []
    workloads = {"BERT-large list": bert_large_shapes(scale), "one large tensor": [(big,)]}
    for wname, shapes in workloads.items():
        n = sum(torch.Size(s).numel() for s in shapes)
        label = f"{wname} ({len(shapes)} tensors, {n / 1e6:.1f}M)"
        for cname, bytes_per_elem, impls in cases_for(shapes, device):
            for iname, fn in impls.items():
                med, p20, p80 = timeit(fn, device, reps)
                gbps = bytes_per_elem * n / (med * 1e-3) / 1e9
                results.append(Result(cname, label, iname, med, p20, p80, gbps, None if peak is None else gbps / peak))
    return results, peak


def to_markdown(results: list[Result], device: torch.device, peak: float | None) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (torch fallback; 2-core machine)"
    lines = [
        f"Device: {name}; fp16kit backend: {select_backend(device).backend.value}.",
        f"Measured copy bandwidth: {peak:.0f} GB/s." if peak else "No copy-bandwidth roofline on CPU.",
        "",
        "| case | workload | implementation | median ms (p20-p80) | GB/s | vs torch | roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = next(x for x in results if x.case == r.case and x.workload == r.workload and x.impl.startswith("torch"))
        speed = base.median_ms / r.median_ms
        roof = f"{r.roofline:.0%}" if r.roofline is not None else "n/a"
        lines.append(f"| {r.case} | {r.workload} | {r.impl} | {r.median_ms:.3f} ({r.p20_ms:.3f}-{r.p80_ms:.3f}) "
                     f"| {r.gbps:.1f} | {speed:.2f}x | {roof} |")
    return "\n".join(lines)


HOST_SIZES = (40, 400, 4000)


def _host_cases(n: int) -> dict[str, dict[str, Callable[[], object]]]:
    """{case: {implementation: callable}} on ``n`` tiny CPU tensors (the first implementation is fp16kit's)."""
    from fp16kit.kernels import ops, optimizers
    from fp16kit.kernels.engine import plan as _plan
    from fp16kit.kernels.engine import table as _table

    g32 = [torch.ones(4) for _ in range(n)]
    g16 = [torch.ones(4, dtype=torch.float16) for _ in range(n)]
    masters = [torch.ones(4) for _ in range(n)]
    model16 = [torch.ones(4, dtype=torch.float16) for _ in range(n)]
    states = [[torch.zeros(4) for _ in range(n)] for _ in range(2)]
    found, one, inv = torch.zeros(1), torch.ones(()), torch.ones(1)

    def torch_cast_then_unscale():
        torch._foreach_copy_(masters, g16)
        torch._amp_foreach_non_finite_check_and_unscale_(masters, found, one)

    lamb = optimizers._spec("lamb_update", optimizers._ADAM_NAMES, (2, 3), False)
    lamb_rows = (masters, g32, *states)
    cases: dict[str, dict[str, Callable[[], object]]] = {
        "unscale fp32 in place": {
            "fp16kit unscale_and_check": lambda: unscale_and_check(g32, inv, found),
            "torch _amp_foreach_non_finite_check_and_unscale_": lambda: (
                torch._amp_foreach_non_finite_check_and_unscale_(g32, found, one)),
        },
        "unscale fp16 -> fp32 out": {
            "fp16kit unscale_and_check(out=)": lambda: unscale_and_check(g16, inv, found, out=masters),
            "torch _foreach_copy_ + unscale": torch_cast_then_unscale,
        },
        "copy_ fp32 -> fp16": {
            "fp16kit copy_": lambda: copy_(model16, g32),
            "torch _foreach_copy_": lambda: torch._foreach_copy_(model16, g32),
        },
        "planning: copy_ rows (2 lists)": {
            "cached plan": lambda: _plan.plan(ops._COPY, (model16, g32)),
            "uncached (validate + plan every call)": lambda: _plan._make(ops._COPY, (model16, g32)),
        },
        "planning: LAMB rows (4 lists)": {
            "cached plan": lambda: _plan.plan(lamb, lamb_rows),
            "uncached (validate + plan every call)": lambda: _plan._make(lamb, lamb_rows),
        },
    }
    if select_backend(torch.device("cpu")).backend.value == "triton interpreter":

        def triton_planning(cached: bool) -> None:
            made = _plan.plan(ops._UNSCALE_OUT, (g16, masters)) if cached else _plan._make(
                ops._UNSCALE_OUT, (g16, masters))
            for g in made.kernel:
                if cached:
                    with _table.playing(g.tape):
                        _table.chunk_table([g.pick(g16), g.pick(masters)])
                else:
                    _table.chunk_table([g.pick(g16), g.pick(masters)])

        cases["Triton path: planning + table lookup (unscale out=)"] = {
            "cached plan + recorded table": lambda: triton_planning(True),
            "uncached (validate + plan + table key)": lambda: triton_planning(False),
        }
    return cases


def run_host(rounds: int) -> list[tuple[str, int, str, float, float]]:
    """``(case, tensors, implementation, min, median)`` in microseconds per tensor per call."""
    from fp16kit.kernels import use_backend

    torch.set_num_threads(1)
    out = []
    interp = select_backend(torch.device("cpu")).backend.value == "triton interpreter"
    for n in HOST_SIZES:
        cases = _host_cases(n)
        inner = max(3, 20000 // n)
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):  # interleaved: every implementation once per round
            for case, impls in cases.items():
                backend = "auto" if interp and case.startswith("Triton") else "torch"
                with use_backend(backend):
                    for name, fn in impls.items():
                        fn()
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            fn()
                        samples.setdefault((case, name), []).append((time.perf_counter() - t0) / inner / n * 1e6)
        out += [(case, n, name, min(v), statistics.median(v)) for (case, name), v in samples.items()]
    return out


def host_markdown(rows: list[tuple[str, int, str, float, float]]) -> str:
    import os

    lines = [
        f"Host cost per call, CPU, 1 thread, 4-element tensors; load average {os.getloadavg()[0]:.2f}.",
        "",
        "| case | tensors | implementation | us per tensor: min | median | vs the other (median) |",
        "|---|---|---|---|---|---|",
    ]
    for case, n, name, lo, med in rows:
        other = next(r for r in rows if r[0] == case and r[1] == n and r[2] != name)
        lines.append(f"| {case} | {n} | {name} | {lo:.3f} | {med:.3f} | {med / other[4]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", action="store_true", help="host cost per call at 40/400/4000 tensors (CPU)")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds of --host")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=float, default=None, help="BERT-large dims scale (default 1 on GPU, 0.25 CPU)")
    parser.add_argument("--big", type=int, default=None, help="elements of the single large tensor")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions on CPU")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args()
    if args.host:
        md = host_markdown(run_host(args.rounds))
        print(md)
        if args.out:
            with open(args.out, "w") as f:
                f.write(md + "\n")
        return
    device = torch.device(args.device)
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else 0.25)
    big = args.big if args.big is not None else (256 * 2**20 if device.type == "cuda" else 16 * 2**20)
    results, peak = run(device, scale, big, args.reps)
    md = to_markdown(results, device, peak)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
