"""Benchmark: fused unscale-and-check and the master copy against torch's multi-tensor ops.

Workloads: a BERT-large-like gradient list (~390 tensors, 335M elements on a GPU; scaled down on CPU)
and one large tensor. Cases:

- unscale in place, fp32 grads: fp16kit ``unscale_and_check`` vs ``torch._amp_foreach_non_finite_check_and_unscale_``
- unscale fp16 grads -> fp32 master grads: fp16kit (one pass) vs torch (``_foreach_copy_`` cast, then the unscale)
- master copy fp32 -> fp16: fp16kit ``copy_`` vs ``torch._foreach_copy_``

Reports median (p20, p80) time, achieved GB/s (bytes each must move / time) and, on a GPU, the fraction of the
measured device-to-device copy bandwidth. Run: ``python benchmarks/bench_kernels.py [--device cuda] [--out FILE]``.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--scale", type=float, default=None, help="BERT-large dims scale (default 1 on GPU, 0.25 CPU)")
    parser.add_argument("--big", type=int, default=None, help="elements of the single large tensor")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions on CPU")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    args = parser.parse_args()
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
