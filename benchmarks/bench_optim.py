"""Optimizer step time: fp16kit FusedLAMB / FusedAdam against the optimizers people use today.

CPU section (always): BERT-base- and BERT-large-*shaped* parameter lists scaled down to a few million
parameters (same tensor structure: embeddings, 4 attention projections + 2 FFN matrices + biases +
LayerNorms per layer, pooler; two param groups, weight decay 0.01 on matrices, 0 on biases/LayerNorms),
fp32 and master-weights (bf16 model params) modes. GPU section: full-size BERT-base/-large when CUDA is
available (``triton.testing.do_bench``), skipped otherwise.

Timing: every optimizer gets its own copy of the same params and grads; steps are interleaved round-robin
(one step of each per round) so that load from other processes hits all of them alike; median and
p20/p80 over the rounds. GB/s = the algorithm's minimal memory traffic (bytes/param below: every tensor read
once and written once per pass) / time, compared with the measured copy bandwidth (read + write).

Usage: ``python benchmarks/bench_optim.py [--quick] [--native] [--out benchmarks/results/optim.md]``.
Writes markdown to stdout and to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fp16kit.optim import FusedAdam, FusedLAMB

# Minimal bytes per parameter per step (see specs/lamb.md "Memory traffic").
BYTES = {
    # global-norm pass reads g; stage 1 reads g, p, m, v and writes m, v; stage 2 reads p, m, v, writes p
    "lamb_fp32": 4 + 16 + 8 + 12 + 4,
    # bf16 grads and model copy, fp32 master/m/v: 2 + (2+4+4+4 + 8) + (12 + 4 + 2)
    "lamb_master": 2 + 22 + 18,
    # check pass reads g; one pass reads g, p, m, v and writes p, m, v
    "adam_fp32": 4 + 16 + 12,
    "adam_master": 2 + 14 + 14,
    # torch.optim.AdamW: one pass (no check pass)
    "adamw": 16 + 12,
    # under torch's GradScaler: its inf check reads and writes g (x 1/scale), the kernel writes g back unscaled
    "adamw_scaler": 8 + 16 + 16,
    # fp16kit's optimizers under torch's GradScaler: its check pass, then their own step
    "adam_scaler": 8 + 4 + 16 + 12,
    "lamb_scaler": 8 + 4 + 16 + 8 + 12 + 4,
}


def bert_shapes(hidden: int, layers: int, ffn: int, vocab: int, positions: int = 512) -> list[tuple[tuple, bool]]:
    """(shape, decay?) for a BERT encoder + pooler: decay on matrices, none on biases and LayerNorms."""
    out: list[tuple[tuple, bool]] = [((vocab, hidden), True), ((positions, hidden), True), ((2, hidden), True)]
    out += [((hidden,), False), ((hidden,), False)]  # embedding LayerNorm
    for _ in range(layers):
        for _ in range(4):  # q, k, v, attention output
            out += [((hidden, hidden), True), ((hidden,), False)]
        out += [((hidden,), False), ((hidden,), False)]
        out += [((ffn, hidden), True), ((ffn,), False), ((hidden, ffn), True), ((hidden,), False)]
        out += [((hidden,), False), ((hidden,), False)]
    out += [((hidden, hidden), True), ((hidden,), False)]
    return out


def make_groups(shapes, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[list, list]:
    """Two param groups (decay / no decay) of fresh leaf tensors with random grads."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    decay, no_decay = [], []
    for shape, wd in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device=device, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        (decay if wd else no_decay).append(p)
    return decay, no_decay


def groups_for(decay, no_decay):
    return [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]


# A source checkout of pytorch-optimizer (kozistr/pytorch_optimizer) to import its Lamb from, when the
# package is not installed: ``--pytorch-optimizer DIR`` or ``FP16KIT_BENCH_PYTORCH_OPTIMIZER=DIR``.
PYOPT_ENV = "FP16KIT_BENCH_PYTORCH_OPTIMIZER"


def _pytorch_optimizer_lamb() -> type:
    """pytorch-optimizer's ``Lamb``: the installed package, else the checkout named by ``PYOPT_ENV``."""
    root = os.environ.get(PYOPT_ENV)
    if root and root not in sys.path:
        sys.path.insert(0, root)
    from pytorch_optimizer import Lamb

    return Lamb


def peers() -> dict[str, tuple[Callable, str]]:
    """name -> (factory(groups) -> optimizer, bytes key), for the optimizers that are installed."""
    out: dict[str, tuple[Callable, str]] = {
        "torch AdamW (foreach)": (lambda g: torch.optim.AdamW(g, lr=1e-3, foreach=True), "adamw"),
        "torch AdamW (fused)": (lambda g: torch.optim.AdamW(g, lr=1e-3, fused=True), "adamw"),
    }
    try:
        Lamb = _pytorch_optimizer_lamb()
        out["pytorch-optimizer Lamb"] = (lambda g: Lamb(g, lr=1e-3), "lamb_fp32")
    except ImportError:
        pass
    try:
        import torch_optimizer

        out["torch-optimizer Lamb"] = (lambda g: torch_optimizer.Lamb(g, lr=1e-3), "lamb_fp32")
    except ImportError:
        pass
    try:
        from apex.optimizers import FusedLAMB as ApexLAMB

        out["apex FusedLAMB"] = (lambda g: ApexLAMB(g, lr=1e-3), "lamb_fp32")
    except ImportError:
        pass
    return out


def interleaved(steps: dict[str, Callable[[], object]], rounds: int, sync: Callable[[], None]) -> dict[str, list]:
    for fn in steps.values():  # warm-up: state allocation, table caches, compilation
        fn()
        fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


def copy_bandwidth(device: str) -> float:
    """Measured device copy bandwidth in GB/s (bytes read + written)."""
    src = torch.randn(16 * 1024 * 1024, device=device)
    dst = torch.empty_like(src)
    if device == "cuda":
        from triton.testing import do_bench

        ms = do_bench(lambda: dst.copy_(src))
        return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
    ts = []
    for _ in range(15):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(ts) / 1e9


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _foreach(step: Callable[[], object]) -> None:
    from fp16kit.kernels.fallback.step import foreach_only

    with foreach_only():
        step()


def table(title: str, n_params: int, times: dict[str, list], keys: dict[str, str], copy_gbs: float) -> list[str]:
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"#### {title} — {n_params / 1e6:.1f}M params", ""]
    lines += ["| optimizer | ms/step (median) | min | p20–p80 | B/param | GB/s | % of copy BW | vs AdamW fused |"]
    lines += ["|---|---:|---:|---:|---:|---:|---:|---:|"]
    ref = med.get("torch AdamW (fused)")
    for name, t in sorted(med.items(), key=lambda kv: kv[1]):
        b = BYTES[keys[name]]
        gbs = b * n_params / t / 1e9
        rel = f"{t / ref:.2f}x" if ref else "-"
        lines.append(
            f"| {name} | {t * 1e3:.2f} | {min(times[name]) * 1e3:.2f} "
            f"| {pct(times[name], 0.2) * 1e3:.2f}–{pct(times[name], 0.8) * 1e3:.2f} "
            f"| {b} | {gbs:.1f} | {100 * gbs / copy_gbs:.0f}% | {rel} |"
        )
    lines.append("")
    return lines


LAMB, ADAM = "fp16kit FusedLAMB", "fp16kit FusedAdam"
FOREACH = " (foreach path, before)"


def _ratio_line(name: str, ours: float, peer_name: str, peer: float, limit: float, faster: bool = False) -> str:
    if faster:
        ratio = peer / ours
        verdict = "met" if ratio >= limit else "NOT met"
        return f"- {name} vs {peer_name}: {ratio:.2f}x faster (target >= {limit}x: {verdict})"
    ratio = ours / peer
    verdict = "met" if ratio <= limit else "NOT met"
    return f"- {name} vs {peer_name}: {ratio:.2f}x its time (target <= {limit}x: {verdict})"


def targets(fast: dict[str, float], master: dict[str, float] | None = None) -> list[str]:
    """Issue 10 item 5's CPU targets on the given statistic (per optimizer) of the default (fast) path."""
    out = []
    fused = fast.get("torch AdamW (fused)")
    if LAMB in fast and "pytorch-optimizer Lamb" in fast:
        out.append(_ratio_line(LAMB, fast[LAMB], "pytorch-optimizer Lamb", fast["pytorch-optimizer Lamb"], 2, True))
    if LAMB in fast and fused:
        out.append(_ratio_line(LAMB, fast[LAMB], "torch AdamW (fused)", fused, 1.8))
    if ADAM in fast and fused:
        out.append(_ratio_line(ADAM, fast[ADAM], "torch AdamW (fused)", fused, 1.2))
    scaled = fast.get(ADAMW_FUSED + SCALER)
    if scaled:
        for name, limit in ((LAMB, 1.8), (ADAM, 1.2)):
            if name + SCALER in fast:
                out.append(_ratio_line(name + SCALER, fast[name + SCALER], ADAMW_FUSED + SCALER, scaled, limit))
    for name in (LAMB, ADAM):
        if master and name in fast and name + MASTER in master:
            out.append(_ratio_line(name + MASTER, master[name + MASTER], f"{name} (fp32 params)", fast[name], 2))
    return out


MASTER = " (master, bf16 model)"
ADAMW_FUSED = "torch AdamW (fused)"
SCALER = " + GradScaler"


class WithScaler:
    """``step()`` = ``scaler.step(opt); scaler.update()`` with ``torch.amp.GradScaler("cpu", init_scale=1)``: the
    GradScaler hand-over (torch's inf check pass over the grads, then ``grad_scale``/``found_inf`` given to the
    optimizer), as in an amp training loop, for torch's fused AdamW and fp16kit's optimizers alike."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        self.scaler.scale(torch.ones(()))  # initializes the scale; the grads are taken as already scaled by 1

    def step(self) -> None:
        self.scaler.step(self.opt)
        self.scaler.update()


def cpu_section(rounds: int, quick: bool, native: bool) -> list[str]:
    from fp16kit.kernels import use_backend

    lines = ["## CPU", ""]
    native_ok = False
    if native:
        from fp16kit.kernels.fallback import lamb_native as _cpu_native

        t0 = time.perf_counter()
        native_ok = _cpu_native.enable()
        status = "built/loaded" if native_ok else "unavailable"
        lines.append(
            f"Native CPU LAMB kernel (opt-in, `FP16KIT_CPU_NATIVE=1`): {status} in {time.perf_counter() - t0:.1f} s."
        )
    copy_gbs = copy_bandwidth("cpu")
    lines += [f"Measured copy bandwidth: {copy_gbs:.1f} GB/s (read + write), {torch.get_num_threads()} threads.", ""]
    configs = [("BERT-base-shaped (hidden 256, 12 layers, FFN 1024, vocab 4096)", bert_shapes(256, 12, 1024, 4096))]
    if not quick:
        configs.append(
            ("BERT-large-shaped (hidden 256, 24 layers, FFN 1024, vocab 4096)", bert_shapes(256, 24, 1024, 4096))
        )
    for title, shapes in configs:
        n = sum(torch.Size(s).numel() for s, _ in shapes)
        for mode in ("fp32", "master"):
            dtype = torch.float32 if mode == "fp32" else torch.bfloat16
            steps, keys, keep = {}, {}, []

            def add(name, factory, key, dtype=dtype, shapes=shapes, steps=steps, keys=keys, keep=keep):
                groups = make_groups(shapes, dtype, "cpu")
                opt = factory(groups_for(*groups))
                keep.append((groups, opt))
                steps[name], keys[name] = opt.step, key

            master = mode == "master"
            add(
                LAMB + (MASTER if master else ""),
                lambda g, m=master: FusedLAMB(g, lr=1e-3, master_weights=m),
                "lamb_master" if master else "lamb_fp32",
            )
            add(
                ADAM + (MASTER if master else ""),
                lambda g, m=master: FusedAdam(g, lr=1e-3, master_weights=m),
                "adam_master" if master else "adam_fp32",
            )
            for name, (factory, key) in peers().items():
                add(name, factory, key, dtype=torch.float32)
            if not master:  # like with like: torch's GradScaler hands each optimizer its scale and inf flag
                add(ADAMW_FUSED + SCALER, lambda g: WithScaler(torch.optim.AdamW(g, fused=True)), "adamw_scaler")
                add(ADAM + SCALER, lambda g: WithScaler(FusedAdam(g, lr=1e-3)), "adam_scaler")
                add(LAMB + SCALER, lambda g: WithScaler(FusedLAMB(g, lr=1e-3)), "lamb_scaler")
            if not master:  # the default path before torch's fused Adam kernel was used (same code, toggled)
                for name, cls, key in ((LAMB, FusedLAMB, "lamb_fp32"), (ADAM, FusedAdam, "adam_fp32")):
                    add(name + FOREACH, lambda g, c=cls: c(g, lr=1e-3), key)
                    step = steps[name + FOREACH]
                    steps[name + FOREACH] = lambda step=step: _foreach(step)
            with use_backend("torch"):
                times = interleaved(steps, rounds, lambda: None)
                if native_ok and not master:
                    from fp16kit.kernels.fallback import lamb_native as _cpu_native

                    _cpu_native.enable(False)
                    times["fp16kit FusedLAMB (torch path, native off)"] = interleaved(
                        {"x": steps["fp16kit FusedLAMB"]}, max(3, rounds // 3), lambda: None
                    )["x"]
                    keys["fp16kit FusedLAMB (torch path, native off)"] = "lamb_fp32"
                    _cpu_native.enable(True)
            label = "fp32 params" if mode == "fp32" else "master weights: bf16 model params (peers: fp32 params)"
            lines += table(f"{title}, {label}", n, times, keys, copy_gbs)
            if mode == "fp32":
                fp32_times = times
            else:
                for stat, fn in (("median", statistics.median), ("min", min)):
                    lines += [f"Targets on the per-optimizer {stat} (interleaved rounds):", ""]
                    lines += targets({k: fn(v) for k, v in fp32_times.items()}, {k: fn(v) for k, v in times.items()})
                    lines.append("")
            del keep, steps
            gc.collect()
    return lines


def gpu_section(quick: bool) -> list[str]:
    if not torch.cuda.is_available():
        return ["## GPU", "", "Skipped: no CUDA device on this machine.", ""]
    from triton.testing import do_bench

    lines = ["## GPU", "", f"Device: {torch.cuda.get_device_name()}"]
    copy_gbs = copy_bandwidth("cuda")
    lines += [f"Measured copy bandwidth: {copy_gbs:.0f} GB/s (read + write).", ""]
    configs = [("BERT-base (hidden 768, 12 layers)", bert_shapes(768, 12, 3072, 30522))]
    if not quick:
        configs.append(("BERT-large (hidden 1024, 24 layers)", bert_shapes(1024, 24, 4096, 30522)))
    for title, shapes in configs:
        n = sum(torch.Size(s).numel() for s, _ in shapes)
        for mode in ("fp32", "master"):
            dtype = torch.float32 if mode == "fp32" else torch.float16
            master = mode == "master"
            entries = [
                ("fp16kit FusedLAMB", lambda g, m=master: FusedLAMB(g, lr=1e-3, master_weights=m), "lamb"),
                ("fp16kit FusedAdam", lambda g, m=master: FusedAdam(g, lr=1e-3, master_weights=m), "adam"),
            ]
            if not master:
                entries += [(name, f, key) for name, (f, key) in peers().items()]
            times, keys = {}, {}
            for name, factory, key in entries:
                groups = make_groups(shapes, dtype, "cuda")
                opt = factory(groups_for(*groups))
                opt.step()
                ms = do_bench(opt.step, quantiles=[0.5, 0.2, 0.8])
                times[name] = [m * 1e-3 for m in ms]
                keys[name] = key if key in ("adamw", "lamb_fp32") else f"{key}_{'master' if master else 'fp32'}"
                del opt, groups
                torch.cuda.empty_cache()
            lines += table(f"{title}, {'fp16 model + fp32 masters' if master else 'fp32'}", n, times, keys, copy_gbs)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="BERT-base-shaped only, fewer rounds")
    ap.add_argument("--native", action="store_true", help="also build and measure the native CPU LAMB kernel")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "optim.md"))
    args = ap.parse_args()
    rounds = args.rounds or (5 if args.quick else 15)
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = [
        "# Optimizer step benchmark (fp16kit.optim)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads; command: `python benchmarks/bench_optim.py"
        f"{' --quick' if args.quick else ''}{' --native' if args.native else ''}"
        f"{f' --threads {args.threads}' if args.threads else ''}`.",
        "apex FusedLAMB is measured only where apex imports (it needs a CUDA build; not on CPU-only machines).",
        "",
    ]
    lines += cpu_section(rounds, args.quick, args.native)
    lines += gpu_section(args.quick)
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
