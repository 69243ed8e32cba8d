"""A tiny BertForMaskedLM built locally (no hub, no network) and a fixed masked-LM data set, for the Trainer and
accelerate tests."""

from __future__ import annotations

import torch

VOCAB, SEQ = 100, 12
#: the loops the tests run: batch size, micro-batches per step, optimizer steps, max grad norm
BATCH, ACCUM, STEPS, CLIP = 8, 2, 4, 1.0


def tiny_bert(seed: int = 0, dropout: float = 0.0):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=SEQ + 4, hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout)
    return BertForMaskedLM(config)


class MaskedLMData(torch.utils.data.Dataset):
    """``n`` sequences; 3 positions each carry a label (the rest -100), their inputs replaced by token 4."""

    def __init__(self, n: int = 64, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(5, VOCAB, (n, SEQ), generator=g)
        self.labels = torch.full_like(self.ids, -100)
        for i in range(n):
            pos = torch.randperm(SEQ, generator=g)[:3]
            self.labels[i, pos] = self.ids[i, pos]
            self.ids[i, pos] = 4

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.labels[i]}


def batches(data: MaskedLMData, batch_size: int, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """The data in order, as the Trainer's default collator stacks it."""
    out = []
    for start in range(0, len(data), batch_size):
        items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
        out.append({k: torch.stack([it[k] for it in items]).to(device) for k in items[0]})
    return out


def autocast_reference(dtype: torch.dtype, scaler: torch.amp.GradScaler | None = None, schedule: bool = False,
                       device: str = "cpu"):
    """What ``Trainer(bf16=True / fp16=True)`` and ``Accelerator(mixed_precision=...)`` do through accelerate, by
    hand, with ``FusedLAMB``: autocast forward, (scaled) backward, unscale before clipping, (scaler) step, the
    Trainer's linear LR schedule with ``schedule``. Returns ``(model, per-step grad norms)``."""
    from transformers import get_linear_schedule_with_warmup

    from fp16kit.optim import FusedLAMB

    model = tiny_bert().to(device)
    opt = FusedLAMB(model.parameters(), lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, 0, STEPS) if schedule else None
    data = batches(MaskedLMData(), BATCH, device)
    norms = []
    model.train()
    for s in range(STEPS):
        for k in range(ACCUM):
            with torch.autocast(device, dtype=dtype):
                loss = model(**data[(s * ACCUM + k) % len(data)]).loss
            loss = loss.float() / ACCUM
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        if sched is not None:
            sched.step()
        model.zero_grad()
    return model, norms
