"""GPU: one BERT-base training step end to end, fp16kit against torch (the issue's target: <= 1.03x).

``BertForMaskedLM`` (BERT-base config, random init), batch 32 x 128, fp16 mixed precision; one iteration is the
forward and backward pass under autocast, the scaler's unscale/step/update and ``zero_grad``:

* fp16kit: ``fp16kit.amp.autocast`` + ``fp16kit.amp.GradScaler`` + ``FusedLAMB`` (device step);
* torch: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW(fused=True)``;
* and fp16kit's ``FusedLAMB`` under torch's autocast and scaler, which separates the optimizer's share.

Rounds interleave the implementations (``--iters`` iterations each, wall clock between synchronizations);
medians over ``--rounds``. Usage: ``python benchmarks/gpu_bert_step.py [--out bert_step.md]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

DEV = "cuda"


def _model() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig()).to(DEV)


def _batch(batch: int = 32, seq: int = 128, vocab: int = 30522) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, vocab, (batch, seq), device=DEV)
    labels = torch.where(torch.rand(batch, seq, device=DEV) < 0.15, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def make(kind: str):
    import fp16kit.amp as famp
    from fp16kit.optim import FusedLAMB

    model = _model()
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
        scaler, region = torch.amp.GradScaler("cuda"), (lambda: torch.autocast("cuda", dtype=torch.float16))
    elif kind == "fp16kit":
        opt = FusedLAMB(model.parameters(), lr=1e-4, weight_decay=0.01)
        scaler, region = famp.GradScaler("cuda"), (lambda: famp.autocast(dtype=torch.float16))
    else:  # fp16kit's optimizer under torch's autocast and scaler
        opt = FusedLAMB(model.parameters(), lr=1e-4, weight_decay=0.01)
        scaler, region = torch.amp.GradScaler("cuda"), (lambda: torch.autocast("cuda", dtype=torch.float16))
    batch = _batch()

    def iteration() -> None:
        with region():
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return iteration


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bert_step.md")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    kinds = ("torch", "fp16kit", "FusedLAMB under torch amp")
    runs = {k: make(k) for k in kinds}
    for fn in runs.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k, fn in runs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) / args.iters * 1e3)
    peer = statistics.median(times["torch"])
    lines = [f"# BERT-base b32x128 fp16 training step, {torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| implementation | ms / iteration (median) | min | / torch |", "|---|---|---|---|"]
    for k in kinds:
        med = statistics.median(times[k])
        lines.append(f"| {k} | {med:.2f} | {min(times[k]):.2f} | {med / peer:.3f} |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
