"""A tiny BERT (transformers' ``BertForMaskedLM``: hidden 32, 2 layers) trained in bf16 on a fixed synthetic batch
with each weight mode of FusedAdam and FusedLAMB (docs/optim.md, "bf16 weights without fp32 masters"): split mode
ends exactly where fp32 masters do (its masters are theirs bit for bit; only the forward's weights differ, at ties),
stochastic rounding within ``MARGIN`` of that final loss. The torch backend (the CPU path) runs the steps.
``train_tiny_bert`` is also the loss column of ``benchmarks/bench_bf16_modes.py``."""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdam, FusedLAMB

transformers = pytest.importorskip("transformers")

STEPS = 60
#: Stochastic rounding's final loss may exceed the fp32-master run's by at most this fraction (measured: see
#: docs/optim.md; the plain bf16 run, round-to-nearest without masters, stalls far above it).
MARGIN = 0.03
OPTIMIZERS = {
    "adam": lambda ps, mode: FusedAdam(ps, lr=3e-3, weight_decay=0.01, master_weights=mode,
                                       **({"rounding_seed": 0} if mode == "stochastic" else {})),
    "lamb": lambda ps, mode: FusedLAMB(ps, lr=1e-2, weight_decay=0.01, master_weights=mode,
                                       **({"rounding_seed": 0} if mode == "stochastic" else {})),
}


def tiny_batch(vocab: int = 64, batch: int = 8, seq: int = 16) -> dict[str, torch.Tensor]:
    """A fixed masked-LM batch: random tokens, 15% of positions to predict (label -100 elsewhere)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, seq), generator=g)
    picked = torch.rand(batch, seq, generator=g) < 0.15
    labels = torch.where(picked, ids, torch.full_like(ids, -100))
    return {"input_ids": torch.where(picked, torch.full_like(ids, 3), ids), "labels": labels}


def train_tiny_bert(kind: str, mode: bool | str, steps: int = STEPS) -> list[float]:
    """The loss of every step of a bf16 tiny BERT trained with ``OPTIMIZERS[kind]`` in weight mode ``mode``
    (``True``: fp32 masters, ``False``: plain bf16, ``"split"``, ``"stochastic"``), from the same initial weights."""
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).to(torch.bfloat16)
    batch = tiny_batch()
    opt = OPTIMIZERS[kind](list(model.parameters()), mode)
    losses = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads cost more than they give (and results do not depend on it)
    try:
        with use_backend("torch"):
            for _ in range(steps):
                opt.zero_grad()
                logits = model(input_ids=batch["input_ids"]).logits.float()  # the loss in fp32
                loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), batch["labels"].view(-1))
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
    finally:
        torch.set_num_threads(threads)
    return losses


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_tiny_bert_final_loss_per_weight_mode(kind):
    master = train_tiny_bert(kind, True)
    split = train_tiny_bert(kind, "split")
    stochastic = train_tiny_bert(kind, "stochastic")
    assert master[-1] < 0.8 * master[0]  # it learns
    assert abs(split[-1] - master[-1]) <= 0.01 * master[-1], (split[-1], master[-1])
    assert stochastic[-1] <= master[-1] * (1 + MARGIN), (stochastic[-1], master[-1])
