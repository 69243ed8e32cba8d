"""8-bit moments (``state_bits=8``): bytes per parameter, step time and memory traffic against fp32 moments, and the
tiny-BERT final loss of each mode (the table in docs/optim.md, "8-bit moments").

* Bytes per parameter (weights + optimizer state) of a large tensor, measured from the tensors' storages: fp32
  params; bf16 params with fp32 masters (``master_weights=True``); each with fp32 or 8-bit moments.
* Step time, CPU (always; the torch implementation, interleaved rounds, p20/p50/p80) and GPU (when CUDA is
  available; the Triton kernels, ``triton.testing.do_bench``), FusedAdam and FusedLAMB over a list of 8 tensors of
  ``--numel`` elements each, with the minimal memory traffic per param per step of each mode (every tensor read once
  and written once per pass: :data:`TRAFFIC`).
* Tiny BERT: the final loss of ``tests/optim/test_state8_bert.py``'s run, fp32 vs 8-bit moments.

Usage: ``python benchmarks/bench_state8.py [--quick] [--threads N] [--out benchmarks/results/state8.md]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from fp16kit.optim import FusedAdam, FusedLAMB

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "optim"))
from test_state8_bert import train  # the test's run: one definition

#: 8-bit moments per element: 1 byte of code + 4 bytes of absmax per 256-element block.
M8 = 1 + 4 / 256
#: Minimal bytes moved per param per step with fp32 params and grads (check pass + update passes).
TRAFFIC = {
    # check pass reads g; one pass reads g, p, m, v and writes p, m, v
    ("FusedAdam", 32): 4 + 16 + 12,
    ("FusedAdam", 8): 4 + (8 + 2 * M8) + (4 + 2 * M8),
    # global-norm pass reads g; stage 1 reads g, p, m, v, writes m, v; stage 2 reads p, m, v, writes p
    ("FusedLAMB", 32): 4 + 16 + 8 + 12 + 4,
    ("FusedLAMB", 8): 4 + (8 + 2 * M8) + 2 * M8 + (4 + 2 * M8) + 4,
}
OPTS = {"FusedAdam": FusedAdam, "FusedLAMB": FusedLAMB}


def bytes_per_param(master: bool, state_bits: int, numel: int = 1 << 20) -> float:
    """Weights + optimizer state per parameter of one ``numel``-element param after a step (storages counted)."""
    p = torch.randn(numel, dtype=torch.bfloat16 if master else torch.float32, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = FusedAdam([p], master_weights=master, state_bits=state_bits)
    opt.step()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in opt.state[p].values()}
    return (p.untyped_storage().nbytes() + sum(storages.values())) / numel


def _params(n: int, numel: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(numel, generator=g).to(device).requires_grad_() for _ in range(n)]
    for p in ps:
        p.grad = (torch.randn(numel, generator=g) * 1e-2).to(device)
    return ps


def cpu_times(numel: int, rounds: int) -> dict[tuple[str, int], list[float]]:
    """ms per step of every (optimizer, state_bits), interleaved round-robin so load hits all alike."""
    opts = {(name, bits): OPTS[name](_params(8, numel, "cpu"), lr=1e-3, weight_decay=0.01, state_bits=bits)
            for name in OPTS for bits in (32, 8)}
    for opt in opts.values():
        opt.step()
    times: dict[tuple[str, int], list[float]] = {k: [] for k in opts}
    for _ in range(rounds):
        for key, opt in opts.items():
            t = time.perf_counter()
            opt.step()
            times[key].append((time.perf_counter() - t) * 1e3)
    return times


def gpu_times(numel: int) -> dict[tuple[str, int], float]:
    """ms per step on the GPU (``triton.testing.do_bench``), when CUDA is available."""
    from triton.testing import do_bench

    out = {}
    for name in OPTS:
        for bits in (32, 8):
            opt = OPTS[name](_params(8, numel, "cuda"), lr=1e-3, weight_decay=0.01, state_bits=bits)
            opt.step()
            out[(name, bits)] = do_bench(opt.step)
    return out


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--numel", type=int, default=1 << 18)
    ap.add_argument("--out", default="benchmarks/results/state8.md")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = ["# 8-bit moments (state_bits=8)", "", "## Bytes per parameter (weights + state), one 2^20-element param",
             "", "| weights | moments | B/param |", "| --- | --- | --- |"]
    for master in (False, True):
        for bits in (32, 8):
            weights = "bf16 + fp32 master" if master else "fp32"
            lines.append(f"| {weights} | {'8-bit' if bits == 8 else 'fp32'} | {bytes_per_param(master, bits):.3f} |")
    numel = 1 << 14 if args.quick else args.numel
    times = cpu_times(numel, 5 if args.quick else 15)
    lines += ["", f"## Step time, CPU (torch implementation, {torch.get_num_threads()} threads), 8 fp32 tensors x "
              f"{numel} elements",
              "", "| optimizer | moments | p20 ms | p50 ms | p80 ms | traffic B/param/step |",
              "| --- | --- | --- | --- | --- | --- |"]
    for (name, bits), ts in times.items():
        lines.append(f"| {name} | {'8-bit' if bits == 8 else 'fp32'} | {_pct(ts, 20):.2f} | "
                     f"{statistics.median(ts):.2f} | {_pct(ts, 80):.2f} | {TRAFFIC[(name, bits)]:.2f} |")
    if torch.cuda.is_available():
        lines += ["", f"## Step time, GPU ({torch.cuda.get_device_name()}), 8 tensors x {1 << 22} elements", "",
                  "| optimizer | moments | ms | traffic B/param/step | GB/s |", "| --- | --- | --- | --- | --- |"]
        for (name, bits), ms in gpu_times(1 << 22).items():
            gbs = TRAFFIC[(name, bits)] * 8 * (1 << 22) / ms / 1e6
            lines.append(f"| {name} | {'8-bit' if bits == 8 else 'fp32'} | {ms:.3f} | "
                         f"{TRAFFIC[(name, bits)]:.2f} | {gbs:.0f} |")
    else:
        lines += ["", "GPU: not available in this run."]
    lines += ["", "## Tiny BERT (tests/optim/test_state8_bert.py): final loss after 30 steps", "",
              "| optimizer | weights | fp32 moments | 8-bit moments | relative difference |",
              "| --- | --- | --- | --- | --- |"]
    for name in ("FusedAdam", "FusedLAMB"):
        for master in (False, True):
            l32, _ = train(name, 32, master=master)
            l8, _ = train(name, 8, master=master)
            weights = "bf16 + fp32 master" if master else "fp32"
            lines.append(f"| {name} | {weights} | {l32:.4f} | {l8:.4f} | {abs(l8 - l32) / l32:.2%} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
