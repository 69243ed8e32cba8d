"""Launch-configuration sweep for the optimizer and unscale kernels on a GPU (``benchmarks/gpu_suite.sh``).

For each (block size, warps, grid size) the whole ``FusedAdam``/``FusedLAMB`` step on the BERT-large list (fp32, and
fp16 params with fp32 masters) and ``unscale_and_check`` in place are timed with ``triton.testing.do_bench``
(median); torch's fused AdamW and ``_amp_foreach_non_finite_check_and_unscale_`` are the peers. The winner per
kernel is what ``LAUNCH`` (``num_warps``), ``_table.BLOCK`` and ``_table.num_programs`` should say. Prints markdown.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import triton.testing

from fp16kit.kernels import _table, adam_kernel, l2norm_kernel, lamb_kernel, unscale_and_check, unscale_kernel
from fp16kit.optim import FusedAdam, FusedLAMB

KERNEL_MODULES = (adam_kernel, lamb_kernel, l2norm_kernel, unscale_kernel)


def shapes() -> list[tuple[int, ...]]:
    h, ff, layers, vocab = 1024, 4096, 24, 30522
    out: list[tuple[int, ...]] = [(vocab, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        out += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return [*out, (h, h), (h,)]


def configure(block: int, warps: int, per_sm: int) -> None:
    _table.chunk_table.__defaults__ = (block,)
    _table._tables.clear()
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def programs(device: torch.device, num_chunks: int) -> int:
        return max(1, min(num_chunks, sms * per_sm))

    for mod in KERNEL_MODULES:
        mod.num_programs = programs
        for opts in mod.LAUNCH.values():
            opts["num_warps"] = warps


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_tune.md")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; configurations past it are skipped")
    args = ap.parse_args()
    import time

    t_start = time.time()
    dev = "cuda"
    sh = shapes()
    g32 = [torch.randn(s, device=dev) * 1e-3 for s in sh]
    cases = {}
    for mode in ("fp32", "master"):
        dtype = torch.float32 if mode == "fp32" else torch.float16
        for name, cls in (("FusedAdam", FusedAdam), ("FusedLAMB", FusedLAMB)):
            ps = [torch.randn(s, device=dev, dtype=dtype).requires_grad_() for s in sh]
            for p, g in zip(ps, g32):
                p.grad = g.to(dtype)
            opt = cls(ps, lr=1e-3, weight_decay=0.01, master_weights=(mode == "master"))
            cases[f"{name} {mode}"] = opt.step
    flag = torch.zeros(1, device=dev)
    inv = torch.ones(1, device=dev)
    cases["unscale fp32 in place"] = lambda: unscale_and_check(g32, inv, flag)
    peers = {}
    ref_ps = [torch.randn(s, device=dev).requires_grad_() for s in sh]
    for p, g in zip(ref_ps, g32):
        p.grad = g
    adamw = torch.optim.AdamW(ref_ps, lr=1e-3, weight_decay=0.01, fused=True)
    peers["torch AdamW(fused) fp32"] = bench(adamw.step)
    peers["torch unscale fp32 in place"] = bench(
        lambda: torch._amp_foreach_non_finite_check_and_unscale_(g32, flag, inv))
    lines = ["# Launch sweep: " + torch.cuda.get_device_name(), "", "| peer | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in peers.items()]
    lines += ["", "| block | warps | programs/SM | " + " | ".join(cases) + " |", "|---" * (3 + len(cases)) + "|"]
    best: dict[str, tuple[float, tuple]] = {}
    for block, warps, per_sm in itertools.product((2048, 4096, 8192), (4, 8, 16), (4, 8, 32)):
        if time.time() - t_start > args.budget:
            lines.append(f"(budget reached: stopped before {block}/{warps}/{per_sm})")
            break
        if block // (32 * warps) < 4:  # fewer than 4 elements per thread: no 16-byte vectors
            continue
        configure(block, warps, per_sm)
        row = []
        for name, fn in cases.items():
            try:
                ms = bench(fn)
            except Exception as e:
                row.append(f"err {type(e).__name__}")
                continue
            row.append(f"{ms:.3f}")
            if name not in best or ms < best[name][0]:
                best[name] = (ms, (block, warps, per_sm))
        lines.append(f"| {block} | {warps} | {per_sm} | " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    lines += ["", "| case | best ms | (block, warps, programs/SM) |", "|---|---|---|"]
    lines += [f"| {k} | {v[0]:.3f} | {v[1]} |" for k, v in best.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
