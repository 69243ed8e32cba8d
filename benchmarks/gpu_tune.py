"""Launch-configuration sweep for the optimizer and unscale kernels on a GPU (``benchmarks/gpu_suite.sh``).

For each (block size, warps, grid size) the whole ``FusedAdam``/``FusedLAMB`` step on the BERT-large list (fp32, and
fp16 params with fp32 masters) and ``unscale_and_check`` in place are timed with ``triton.testing.do_bench``
(median); torch's fused AdamW and ``_amp_foreach_non_finite_check_and_unscale_`` are the peers. The winner per
kernel is what ``LAUNCH`` (``num_warps``), ``_table.BLOCK`` and ``_table.num_programs`` should say. Prints markdown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton.testing

from fp16kit.kernels import unscale_and_check
from fp16kit.kernels.engine import table as _table
from fp16kit.kernels.triton import (
    adam as adam_kernel,
)
from fp16kit.kernels.triton import (
    l2norm as l2norm_kernel,
)
from fp16kit.kernels.triton import (
    lamb as lamb_kernel,
)
from fp16kit.kernels.triton import (
    unscale as unscale_kernel,
)
from fp16kit.optim import FusedAdam, FusedLAMB

KERNEL_MODULES = (adam_kernel, lamb_kernel, l2norm_kernel, unscale_kernel)


def shapes() -> list[tuple[int, ...]]:
    """The BERT-large parameter list (``gpu_step.bert_large_shapes``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_step import bert_large_shapes

    return bert_large_shapes()


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


#: the shipped configuration first (the baseline), then the candidates
CONFIGS = ((4096, 16, 8), (4096, 8, 16), (8192, 16, 8), (4096, 16, 16), (2048, 8, 16), (4096, 8, 8), (2048, 4, 4))


def run_config(block: int, warps: int, per_sm: int) -> str:
    """One configuration in this process: a markdown row of medians (ms), each case and the LAMB step on the
    host-vector path (the kernels fed a float32 vector) to tell a device-step fault from a kernel one."""
    dev = "cuda"
    sh = shapes()
    g32 = [torch.randn(s, device=dev) * 1e-3 for s in sh]
    configure(block, warps, per_sm)
    row = []
    cases = (("fp32", FusedAdam, True), ("fp32", FusedLAMB, True), ("fp32", FusedLAMB, False),
             ("master", FusedAdam, True), ("master", FusedLAMB, True))
    for mode, cls, on_device in cases:
        dtype = torch.float32 if mode == "fp32" else torch.float16
        ps = [torch.randn(s, device=dev, dtype=dtype).requires_grad_() for s in sh]
        for p, g in zip(ps, g32):
            p.grad = g.to(dtype)
        opt = cls(ps, lr=1e-3, weight_decay=0.01, master_weights=(mode == "master"))
        if not on_device:
            opt._on_device = lambda device: False
        ms = bench(opt.step)
        torch.cuda.synchronize()
        row.append(f"{ms:.3f}")
        del opt, ps
        torch.cuda.empty_cache()
    flag = torch.zeros(1, device=dev)
    inv = torch.ones(1, device=dev)
    row.append(f"{bench(lambda: unscale_and_check(g32, inv, flag)):.3f}")
    return f"| {block} | {warps} | {per_sm} | " + " | ".join(row) + " |"


def main() -> None:
    import subprocess
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_tune.md")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; configurations past it are skipped")
    ap.add_argument("--config", default=None, help="B,W,P: run one configuration here and print its row")
    args = ap.parse_args()
    if args.config:
        print(run_config(*map(int, args.config.split(","))), flush=True)
        return
    t_start = time.time()
    dev = "cuda"
    sh = shapes()
    g32 = [torch.randn(s, device=dev) * 1e-3 for s in sh]
    flag = torch.zeros(1, device=dev)
    inv = torch.ones(1, device=dev)
    ref_ps = [torch.randn(s, device=dev).requires_grad_() for s in sh]
    for p, g in zip(ref_ps, g32):
        p.grad = g
    adamw = torch.optim.AdamW(ref_ps, lr=1e-3, weight_decay=0.01, fused=True)
    lines = ["# Launch sweep: " + torch.cuda.get_device_name(), "",
             f"peers: torch AdamW(fused) fp32 {bench(adamw.step):.3f} ms; torch unscale fp32 in place "
             f"{bench(lambda: torch._amp_foreach_non_finite_check_and_unscale_(g32, flag, inv)):.3f} ms", "",
             "Each configuration in its own process (a fault cannot poison the next). Medians in ms.", "",
             "| block | warps | programs/SM | FusedAdam fp32 | FusedLAMB fp32 | FusedLAMB fp32, host vector | "
             "FusedAdam master | FusedLAMB master | unscale fp32 in place |", "|---" * 9 + "|"]
    del adamw, ref_ps
    g32.clear()  # free the peers' memory before the configurations run
    torch.cuda.empty_cache()
    for block, warps, per_sm in CONFIGS:
        left = args.budget - (time.time() - t_start)
        if left < 15:
            lines.append(f"(budget reached before {block}/{warps}/{per_sm})")
            break
        try:
            res = subprocess.run([sys.executable, __file__, "--config", f"{block},{warps},{per_sm}"],
                                 capture_output=True, text=True, timeout=left)
            out = [ln for ln in res.stdout.splitlines() if ln.startswith("|")]
            lines.append(out[-1] if res.returncode == 0 and out else
                         f"| {block} | {warps} | {per_sm} | FAILED rc={res.returncode}: "
                         + " ".join(res.stderr.strip().splitlines()[-3:])[:400] + " |")
        except subprocess.TimeoutExpired:
            lines.append(f"| {block} | {warps} | {per_sm} | timed out |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
