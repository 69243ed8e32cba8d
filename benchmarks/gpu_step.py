"""The optimizer step on a GPU: launches and copies per step, host time, CUDA-graph capture, compiled steps, and
bandwidth on BERT-shaped lists, with torch's fused AdamW measured in the same run.

Needs CUDA (``benchmarks/gpu_suite.sh`` runs it). Prints markdown and writes it to ``--out``.

* **launches / copies**: ``torch.profiler`` over one step (200 params of 64 elements, grads kept between steps,
  with and without a GradScaler): CUDA kernels, host-to-device and device-to-host copies.
* **host time**: wall time per step over 200 and 1000 params of 64 elements (the GPU work is tiny, so this is
  the step's host cost), median of rounds; the peer's in the same rounds.
* **graphs**: torch's documented pattern (3 warm-up steps on a side stream, ``torch.cuda.graph``), replays
  compared bit for bit with eager steps on a copy, and a change of a tensor ``lr`` between replays.
* **compile**: ``torch.compile(opt.step)`` gives the eager bits over 3 steps.
* **bandwidth**: BERT-large gradient list (fp32 params and grads; master mode: fp16 params, fp32 masters), time by
  ``triton.testing.do_bench`` (median), GB/s of the minimal traffic, against a device-to-device copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "optim"))
from test_device_step import replay_against_eager  # the GPU test's capture recipe: one definition

from fp16kit.amp import GradScaler
from fp16kit.optim import FusedAdam, FusedLAMB, FusedSGD

DEV = "cuda"
MAKERS = {
    "FusedAdam": lambda ps, **k: FusedAdam(ps, lr=1e-3, weight_decay=0.01, **k),
    "FusedLAMB": lambda ps, **k: FusedLAMB(ps, lr=1e-3, weight_decay=0.01, **k),
    "torch AdamW(fused)": lambda ps, **k: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True, **k),
}
GRAPH_ONLY = {"FusedSGD": lambda ps, **k: FusedSGD(ps, lr=1e-3, momentum=0.9, weight_decay=0.01, **k)}


def small_params(n: int, numel: int = 64) -> list[torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(n)
    ps = [torch.randn(numel, device=DEV, generator=g).requires_grad_() for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(numel, device=DEV, generator=g) * 1e-2
    return ps


def profile_step(name: str, scaler: bool) -> tuple[int, int, int]:
    ps = small_params(200)
    opt = MAKERS[name](ps)
    sc = GradScaler("cuda") if scaler else None

    def one() -> None:
        if sc is None:
            opt.step()
        else:
            sc.scale(torch.ones((), device=DEV))
            sc.step(opt)
            sc.update()

    for _ in range(3):
        one()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one()
        torch.cuda.synchronize()
    kernels, htod, dtoh = [], 0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n = e.name.lower()
            if "memcpy htod" in n:
                htod += 1
            elif "memcpy dtoh" in n:
                dtoh += 1
            elif "memset" not in n and "memcpy" not in n:
                kernels.append(e.name[:40])
    print(name, scaler, kernels, flush=True)
    return len(kernels), htod, dtoh


#: Host-time variants of fp16kit's device step: (label, optimizer, replay steady steps, bound launches): the
#: steady-state replay (fp16kit/optim/_base.py) and Triton's C launcher called with arguments bound once
#: (fp16kit/kernels/engine/launch.py, FP16KIT_BOUND_LAUNCH=1) against the full path every step took before them.
HOST_VARIANTS = [
    ("FusedAdam, full path", "FusedAdam", False, False),
    ("FusedAdam, replay", "FusedAdam", True, False),
    ("FusedAdam, replay + bound launches", "FusedAdam", True, True),
    ("FusedLAMB, full path", "FusedLAMB", False, False),
    ("FusedLAMB, replay", "FusedLAMB", True, False),
    ("FusedLAMB, replay + bound launches", "FusedLAMB", True, True),
]


def host_time_variants(n: int, rounds: int = 9, steps: int = 50) -> dict[str, float]:
    """Median ms per step of each :data:`HOST_VARIANTS` entry and torch's fused AdamW, rounds interleaved."""
    import os

    opts = {label: MAKERS[name](small_params(n)) for label, name, _, _ in HOST_VARIANTS}
    opts["torch AdamW(fused)"] = MAKERS["torch AdamW(fused)"](small_params(n))
    flags = {label: (replay, bound) for label, _, replay, bound in HOST_VARIANTS}
    times: dict[str, list[float]] = {k: [] for k in opts}
    try:
        for r in range(rounds + 1):
            for label, o in opts.items():
                replay, bound = flags.get(label, (True, False))
                if label in flags:
                    o.device_replay = replay
                os.environ["FP16KIT_BOUND_LAUNCH"] = "1" if bound else "0"
                for _ in range(3 if r == 0 else 0):
                    o.step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(steps):
                    o.step()
                torch.cuda.synchronize()
                if r:
                    times[label].append((time.perf_counter() - t0) / steps * 1e3)
    finally:
        os.environ.pop("FP16KIT_BOUND_LAUNCH", None)
    return {k: statistics.median(v) for k, v in times.items()}


def host_time(n: int, rounds: int = 7, steps: int = 50) -> dict[str, float]:
    opts = {name: make(small_params(n)) for name, make in MAKERS.items()}
    for o in opts.values():
        for _ in range(3):
            o.step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(rounds):
        for name, o in opts.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                o.step()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def host_profile(name: str, n: int = 200, steps: int = 100) -> str:
    """cProfile of ``steps`` steps at ``n`` small params: where the host time goes (top functions by own time)."""
    import cProfile
    import io
    import pstats

    opt = MAKERS[name](small_params(n))
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        opt.step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def graph_check(name: str) -> str:
    """Capture ``opt.step()`` as torch documents it; replays == eager steps on a copy; a tensor lr change."""
    ps = small_params(50, 1000)
    kwargs = {"capturable": True} if name in ("FusedAdam", "torch AdamW(fused)") else {}
    lr = torch.tensor(1e-3, device=DEV)
    make = MAKERS.get(name) or GRAPH_ONLY[name]
    opt = make(ps, **kwargs)
    for grp in opt.param_groups:
        grp["lr"] = lr
    ref_ps = [p.detach().clone().requires_grad_() for p in ps]
    for r, p in zip(ref_ps, ps):
        r.grad = p.grad.clone()
    ref = make(ref_ps, **kwargs)
    for grp in ref.param_groups:
        grp["lr"] = lr.clone()
    replay_against_eager(opt, ref, lr, 5e-3)
    same = all(torch.equal(a, b) for a, b in zip(ps, ref_ps))
    moved = not all(torch.equal(a, b) for a, b in zip(ps, small_params(50, 1000)))
    return f"captured; 4 replays (lr changed before the 3rd) {'==' if same else '!='} eager bit for bit; moved={moved}"


def compile_check(name: str) -> str:
    ps = small_params(30, 257)
    ref_ps = [p.detach().clone().requires_grad_() for p in ps]
    for r, p in zip(ref_ps, ps):
        r.grad = p.grad.clone()
    opt, ref = MAKERS[name](ps), MAKERS[name](ref_ps)
    step = torch.compile(opt.step)
    for _ in range(3):
        step()
        ref.step()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(ps, ref_ps))
    return f"compiled; 3 steps {'==' if same else '!='} eager bit for bit"


def agreement(name: str, master: bool) -> str:
    """Fraction of elements of params after 5 steps that a CUDA step and the CPU torch fallback give bit for bit."""
    from fp16kit.kernels import use_backend

    dtype = torch.float16 if master else torch.float32
    g = torch.Generator().manual_seed(5)
    shapes = [(1000,), (64, 33), (4097,), (7,)]
    init = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 1e-2).to(dtype) for s in shapes] for _ in range(5)]
    results = []
    for device, backend in (("cuda", "auto"), ("cpu", "torch")):
        ps = [t.clone().to(device).requires_grad_() for t in init]
        with use_backend(backend):
            opt = MAKERS[name](ps, master_weights=True) if master else MAKERS[name](ps)
            for step_grads in grads:
                for p, gr in zip(ps, step_grads):
                    p.grad = gr.to(device)
                opt.step()
        results.append(torch.cat([p.detach().float().cpu().reshape(-1) for p in ps]))
    same = (results[0] == results[1]).float().mean().item()
    return f"{100 * same:.2f}% of elements equal (max |diff| {(results[0] - results[1]).abs().max().item():.3g})"


def bert_large_shapes() -> list[tuple[int, ...]]:
    h, ff, layers, vocab = 1024, 4096, 24, 30522
    shapes: list[tuple[int, ...]] = [(vocab, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return [*shapes, (h, h), (h,)]


def bandwidth(master: bool) -> dict[str, tuple[float, float]]:
    import triton.testing

    shapes = bert_large_shapes()
    numel = sum(torch.Size(s).numel() for s in shapes)
    out = {}
    for name, make in MAKERS.items():
        if master and name.startswith("torch"):
            continue
        dtype = torch.float16 if master else torch.float32
        ps = [torch.randn(s, device=DEV, dtype=dtype).requires_grad_() for s in shapes]
        for p in ps:
            p.grad = torch.randn_like(p) * 1e-3
        opt = make(ps, master_weights=True) if master else make(ps)
        ms = triton.testing.do_bench(opt.step, warmup=50, rep=300, return_mode="median")
        # bytes per param: p r/w, g r, m r/w, v r/w (+ LAMB's second pass reads p, m, v and writes p; master mode
        # adds the fp16 model copy write and reads fp16 grads)
        base = 28 if not master else 4 * 2 + 2 + 4 * 4 + 2
        lamb_extra = 16 if name == "FusedLAMB" else 0
        gb = numel * (base + lamb_extra) / ms / 1e6
        out[name] = (ms, gb)
        del opt, ps
        torch.cuda.empty_cache()
    x = torch.empty(numel, device=DEV)
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    out["copy (read+write)"] = (copy_ms, numel * 8 / copy_ms / 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_step.md")
    args = ap.parse_args()
    lines = [f"# GPU step: {torch.cuda.get_device_name()}, torch {torch.__version__}", ""]

    def section(title: str, fn) -> None:
        lines.append(f"## {title}\n")
        try:
            fn()
        except Exception:
            lines.append("```\n" + traceback.format_exc()[-3000:] + "```")
        lines.append("")
        print("\n".join(lines[-20:]), flush=True)

    def launches() -> None:
        lines.append("| optimizer | scaler | CUDA kernels | HtoD copies | DtoH copies |\n|---|---|---|---|---|")
        for name in MAKERS:
            for sc in (False, True):
                k, h, d = profile_step(name, sc)
                lines.append(f"| {name} | {'GradScaler' if sc else '-'} | {k} | {h} | {d} |")

    def host() -> None:
        lines.append("| params | " + " | ".join(MAKERS) + " | FusedAdam / torch | FusedLAMB / torch |")
        lines.append("|---" * (len(MAKERS) + 3) + "|")
        for n in (200, 1000):
            t = host_time(n)
            peer = t["torch AdamW(fused)"]
            lines.append(f"| {n} | " + " | ".join(f"{t[k]:.3f} ms" for k in MAKERS)
                         + f" | {t['FusedAdam'] / peer:.2f} | {t['FusedLAMB'] / peer:.2f} |")

    def host_variants() -> None:
        lines.append("| params | variant | ms / step | / torch AdamW(fused) |\n|---|---|---|---|")
        for n in (200, 1000):
            t = host_time_variants(n)
            peer = t["torch AdamW(fused)"]
            for k, v in t.items():
                lines.append(f"| {n} | {k} | {v:.3f} | {v / peer:.2f} |")

    def profiles() -> None:
        for name in ("FusedAdam", "torch AdamW(fused)"):
            lines.append(f"**{name}**\n\n```\n{host_profile(name)[-3500:]}\n```")

    def checks(names, check) -> None:
        """One line per optimizer: what ``check(name)`` found, or how it failed (the other lines still run)."""
        for name in names:
            try:
                lines.append(f"- {name}: {check(name)}")
            except Exception as e:
                lines.append(f"- {name}: FAILED {type(e).__name__}: {str(e)[:300]}")

    def graphs() -> None:
        checks([*MAKERS, "FusedSGD"], graph_check)

    def compiled() -> None:
        checks(("FusedAdam", "FusedLAMB"), compile_check)

    def agree() -> None:
        for name in ("FusedAdam", "FusedLAMB"):
            for master in (False, True):
                lines.append(f"- {name}, {'fp16 params + fp32 masters' if master else 'fp32'}: "
                             f"{agreement(name, master)}")

    def bw() -> None:
        for master in (False, True):
            res = bandwidth(master)
            copy_gb = res["copy (read+write)"][1]
            lines.append(f"**{'master mode (fp16 params)' if master else 'fp32'}**\n")
            lines.append("| implementation | ms (median) | GB/s | % of copy |\n|---|---|---|---|")
            for k, (ms, gb) in res.items():
                lines.append(f"| {k} | {ms:.3f} | {gb:.0f} | {100 * gb / copy_gb:.0f}% |")
            lines.append("")

    section("Launches and copies per step (200 params x 64)", launches)
    section("Host time per step (params of 64 elements)", host)
    section("Host time per step: full path, replay, bound launches (params of 64 elements)", host_variants)
    section("Host profile, 100 steps at 200 params", profiles)
    section("CUDA graphs (torch's pattern)", graphs)
    section("torch.compile(opt.step)", compiled)
    section("CUDA step vs CPU torch fallback, same inputs, 5 steps", agree)
    section("Bandwidth, BERT-large list (335M params)", bw)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
