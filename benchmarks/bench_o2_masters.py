"""amp O2 step with FusedAdam / FusedLAMB: the stash path (before) against the optimizer's own masters (after).

What is timed, per step: ``amp.scale_loss`` entry and exit (the stash path: the unscale pass into fp32 master
grads; the fused path: the read-only overflow check) and ``optimizer.step()`` (the stash path: the step over
the masters plus the masters -> model copy pass; the fused path: one step that reads the fp16 grads and writes
the model copy itself). Forward and backward are left out (the same in both): inside ``scale_loss`` the
gradients are set to fixed fp16 tensors instead (scaled values of a fixed random draw), so every round does
the same work. The model is a stack of bias-free fp16 Linear layers (no fp32 params, so no gradient is
changed in place and every round starts from the same grads).

"before" is today's stash path, forced for the same optimizer class by making
``fp16kit.amp._frontend.masters.keeps_own_masters`` answer False while ``amp.initialize`` runs. Rounds are
interleaved (one step of each per round) so that load from other processes hits both alike; min and median.

Usage: ``python benchmarks/bench_o2_masters.py [--params 1048576] [--rounds 40] [--threads 1]
[--optimizer adam|lamb] [--device cuda --backend auto]`` (default: CPU, torch backend).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from fp16kit import amp
from fp16kit.amp._frontend import masters
from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdam, FusedLAMB

# bytes moved per mastered fp16 param per O2 step on the kernel path (each tensor read/written once per pass;
# fp16 grads 2 B, fp32 master/master grad/moments 4 B); docs/optim.md explains each pass
BYTES = {
    ("adam", "before"): 6 + 4 + 28 + 6,  # unscale (r2 w4), check (r4), update (r16 w12), copy (r4 w2)
    ("adam", "after"): 2 + 28,  # exit check (r2; its flag is final: no check pass in the step), update (r14 w12 + w2)
    ("lamb", "before"): 6 + 4 + 24 + 16 + 6,  # unscale, check, stage 1 (r16 w8), stage 2 (r12 w4), copy
    ("lamb", "after"): 2 + 2 + 22 + 18,  # exit check, check, stage 1 (r14 w8), stage 2 (r12 w4 + model w2)
}


def build(kind: str, n_params: int, stash_path: bool, device: str) -> tuple[nn.Module, torch.optim.Optimizer, list]:
    width = 1024
    layers = max(1, n_params // (width * width))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(device)
    cls = FusedAdam if kind == "adam" else FusedLAMB
    opt = cls(model.parameters(), lr=1e-3, weight_decay=0.01)
    real = masters.keeps_own_masters
    if stash_path:
        masters.keeps_own_masters = lambda optimizer: False
    try:
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    finally:
        masters.keeps_own_masters = real
    g = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=g) * 1e-3 * 2.0**16).half().to(device) for p in model.parameters()]
    return model, opt, grads


def one_step(model: nn.Module, opt: torch.optim.Optimizer, grads: list) -> None:
    loss = torch.zeros((), requires_grad=True, device=grads[0].device)
    with amp.scale_loss(loss, opt):
        for p, grad in zip(model.parameters(), grads):
            p.grad = grad  # what the backward would leave: the scaled fp16 gradient
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--optimizer", choices=("adam", "lamb"), default="adam")
    ap.add_argument("--backend", default="torch", help="torch (fallback), or auto (Triton where it runs)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with use_backend(args.backend):
        runs = {name: build(args.optimizer, args.params, name == "before", args.device) for name in ("before", "after")}
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        n = sum(p.numel() for p in runs["after"][0].parameters())
        times: dict[str, list[float]] = {name: [] for name in runs}
        for run in runs.values():  # warm-up (state, caches)
            for _ in range(2):
                one_step(*run)
        for _ in range(args.rounds):
            for name, run in runs.items():
                sync()
                t0 = time.perf_counter()
                one_step(*run)
                sync()
                times[name].append(time.perf_counter() - t0)
    load = os.getloadavg()[0]
    name = "FusedLAMB" if args.optimizer == "lamb" else "FusedAdam"
    print(f"O2 + {name}, {n / 1e6:.2f}M fp16 params, {args.device}, backend={args.backend}, "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds, load {load:.2f}")
    print("| path | bytes/param (kernel path) | min ms | median ms |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {BYTES[(args.optimizer, name)]} | {min(ts) * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} |")
    ratio = min(times["after"]) / min(times["before"])
    print(f"after / before (min): {ratio:.3f}")


if __name__ == "__main__":
    main()
