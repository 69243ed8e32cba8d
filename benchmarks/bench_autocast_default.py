"""The default autocast engine against ``torch.autocast``, forward + backward, on overhead-bound models (issue 23).

Models (CPU, 1 thread): a 20-layer MLP (Linear 128 + ReLU, batch 32), the same with GELU, a
``TransformerEncoderLayer`` (d_model 64, 4 heads, batch 8 x 32) and a tiny Hugging Face ``BertForMaskedLM`` (hidden
32, 2 layers, batch 8 x 12, the loss built inside ``forward``). Each step is forward + ``backward`` of the loss.

Columns, timed in interleaved rounds of the same process (thread CPU time per step; minimum over rounds, the median
beside it; ratios to the first column):

* ``torch.autocast``: plain torch, fp16kit's engine uninstalled (``_dispatch.uninstall``: torch as shipped);
* ``torch.autocast, fp16kit installed``: the same plain torch code in a process where fp16kit's default engine has
  run a region (what a library's own ``torch.autocast`` region pays for fp16kit being there: issue 23 item 2);
* ``fp16kit default``: ``fp16kit.amp.autocast`` with the default engine (the dispatcher engine);
* ``fp16kit mode``: the ``TorchFunctionMode`` engine (``FP16KIT_AUTOCAST_ENGINE=mode``).

With ``--compile`` the first and third columns are also timed under ``torch.compile`` (``aot_eager`` is not used:
the default Inductor backend, as users run it). With ``--device cuda`` (``benchmarks/gpu_suite.sh``) the models run on
the GPU, timed by wall clock between synchronizations, and ``--bert-base`` adds BERT-base (``BertForMaskedLM``,
12 layers, hidden 768, batch 32 x 128, random weights: no download).

    python benchmarks/bench_autocast_default.py [--compile] [--dtype bf16|fp16] [--device cuda --bert-base]
        # writes benchmarks/results/autocast_default_<dtype>[_compiled][_cuda].md and prints it
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from fp16kit.amp import _dispatch, autocast_mode
from fp16kit.amp import autocast as fp16kit_autocast

RESULTS = Path(__file__).resolve().parent / "results" / "autocast_default.md"
_clock = time.thread_time


def mlp(act: type[nn.Module], width: int = 128, depth: int = 20) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), act()]
    return nn.Sequential(*layers)


class _Loss(nn.Module):
    """A model and the loss of its output (sum), so every model's step is ``step(batch).backward()``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).float().sum()


class _HF(nn.Module):
    def __init__(self, base: bool = False) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM

        torch.manual_seed(0)
        config = BertConfig() if base else BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.model = BertForMaskedLM(config)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def _mlm_batch(batch: int, seq: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, vocab, (batch, seq))
    labels = torch.where(torch.rand(batch, seq) < 0.15, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def models(bert_base: bool = False) -> dict[str, tuple[nn.Module, object]]:
    torch.manual_seed(0)
    out: dict[str, tuple[nn.Module, object]] = {
        "MLP 20x(Linear128+ReLU)": (_Loss(mlp(nn.ReLU)), torch.randn(32, 128)),
        "MLP 20x(Linear128+GELU)": (_Loss(mlp(nn.GELU)), torch.randn(32, 128)),
        "TransformerEncoderLayer d64": (
            _Loss(nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)), torch.randn(8, 32, 64)),
    }
    with contextlib.suppress(ImportError):  # transformers is in the `testing` extra
        out["tiny BertForMaskedLM"] = (_HF(), _mlm_batch(8, 12, 100))
        if bert_base:
            out["BERT-base BertForMaskedLM, 32 x 128"] = (_HF(base=True), _mlm_batch(32, 128, 30522))
    return out


#: column -> (engine, installed, compiled)
COLUMNS = {
    "torch.autocast": ("dispatch", False, False),
    "torch.autocast, fp16kit installed": ("dispatch", True, False),
    "fp16kit default": ("dispatch", True, False),
    "fp16kit mode": ("mode", False, False),
}
COMPILED = {
    "torch.autocast compiled": ("dispatch", False, True),
    "fp16kit default compiled": ("dispatch", True, True),
}


def _setup(engine: str, installed: bool) -> None:
    autocast_mode.set_engine(engine)
    if installed:
        with fp16kit_autocast():
            pass  # the first region installs the engine
    else:
        _dispatch.uninstall()


def _context(column: str, dtype: torch.dtype, device: str) -> Callable[[], object]:
    if column.startswith("torch.autocast"):
        return lambda: torch.autocast(device, dtype=dtype)
    return lambda: fp16kit_autocast(dtype=dtype)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model: nn.Module, batch: object, dtype: torch.dtype, columns: dict, iters: int,
            repeats: int, device: str = "cpu") -> dict[str, float]:
    clock = time.perf_counter if device == "cuda" else _clock
    steps: dict[str, Callable[[], None]] = {}
    for name, (engine, installed, compiled) in columns.items():
        _setup(engine, installed)
        run = model
        if compiled:
            torch._dynamo.reset()
            run = torch.compile(model)
        ctx = _context(name, dtype, device)

        def step(run: Callable = run, ctx: Callable = ctx) -> None:
            with ctx():  # type: ignore[attr-defined]
                loss = run(batch)
            loss.backward()

        step()  # compile (or warm) before timing
        steps[name] = step
    rounds: dict[str, list[float]] = {n: [] for n in steps}
    names = list(steps)
    for r in range(repeats):
        for n in names if r % 2 == 0 else reversed(names):
            _setup(*columns[n][:2])
            for _ in range(3):
                steps[n]()
            _sync(device)
            t0 = clock()
            for _ in range(iters):
                steps[n]()
            _sync(device)
            rounds[n].append((clock() - t0) / iters)
    return {n: min(v) for n, v in rounds.items()} | {f"{n} median": statistics.median(v) for n, v in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bert-base", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    columns = COLUMNS | (COMPILED if args.compile else {})
    lines = [
        f"# default autocast engine vs torch.autocast, forward + backward ({args.dtype})", "",
        f"torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else (platform.processor() or platform.machine())}, "
        f"{'wall clock' if args.device == 'cuda' else '1 thread, thread CPU time'}, "
        f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M %Z')}; "
        f"min / median of {args.repeats} interleaved rounds of {args.iters} steps; ratio to torch.autocast", "",
        "| model | torch.autocast (ms) | " + " | ".join(list(columns)[1:]) + " |",
        "|---|---|" + "---|" * (len(columns) - 1),
    ]
    for label, (model, batch) in models(args.bert_base).items():
        model = model.to(args.device)
        batch = {k: v.to(args.device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(args.device)
        t = measure(model, batch, dtype, columns, args.iters, args.repeats, args.device)
        base, base_med = t["torch.autocast"], t["torch.autocast median"]
        cells = []
        for n in list(columns)[1:]:
            ref, ref_med = (t["torch.autocast compiled"], t["torch.autocast compiled median"]) \
                if n == "fp16kit default compiled" else (base, base_med)
            cells.append(f"{t[n] / ref:.2f} / {t[n + ' median'] / ref_med:.2f}")
        lines.append(f"| {label} | {base * 1e3:.3f} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines += ["", "`fp16kit default compiled` is the ratio to `torch.autocast compiled` (both Inductor)."
              if args.compile else ""]
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.dtype}{'_compiled' if args.compile else ''}{'_cuda' if args.device == 'cuda' else ''}"
    out = args.out or RESULTS.with_name(f"{RESULTS.stem}{suffix}.md")
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
