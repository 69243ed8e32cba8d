"""A tiny BertForMaskedLM trains with 8-bit moments to within a stated margin of fp32 moments (docs/optim.md,
"8-bit moments"). The run is also the source of the docs table (``benchmarks/bench_state8.py`` imports it).

Model: hidden 32, 2 layers, 2 heads, intermediate 128, vocabulary 1024 (so that the word embeddings and the four
FFN matrices, 49152 of the 60960 parameters, have at least ``SMALL_NUMEL`` = 4096 elements and get 8-bit moments);
one fixed synthetic masked-LM batch (16 x 16 tokens, a quarter masked); 30 steps; torch backend (CPU).
"""

from __future__ import annotations

import pytest
import torch

from fp16kit.optim import FusedAdam, FusedLAMB

VOCAB, SEQ, BATCH, STEPS = 1024, 16, 16, 30
#: (optimizer, lr) of the runs
RUNS = {"FusedAdam": (FusedAdam, 3e-3), "FusedLAMB": (FusedLAMB, 5e-2)}
#: The final loss with 8-bit moments is within this relative margin of the fp32-moment run's.
MARGIN = 0.02


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config)


def masked_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    masked = torch.rand(BATCH, SEQ, generator=g) < 0.25
    labels[masked] = ids[masked]
    return ids.masked_fill(masked, 4), labels


def train(name: str, state_bits: int, steps: int = STEPS, master: bool = False) -> tuple[float, torch.optim.Optimizer]:
    """The final loss of ``steps`` steps of optimizer ``name`` with ``state_bits`` moments, and the optimizer.
    ``master``: a bf16 model with fp32 master weights (``master_weights=True``); its loss is computed in bf16."""
    make, lr = RUNS[name]
    model = tiny_bert()
    if master:
        model = model.to(torch.bfloat16)
    ids, labels = masked_batch()
    opt = make(model.parameters(), lr=lr, weight_decay=0.01, state_bits=state_bits, master_weights=master)
    for _ in range(steps):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss.item(), opt


@pytest.mark.parametrize("name", sorted(RUNS))
def test_tiny_bert_8bit_moments_within_margin_of_fp32(name):
    pytest.importorskip("transformers")
    loss32, _ = train(name, 32)
    loss8, opt = train(name, 8)
    assert loss32 < 4.0  # it trained (the loss starts at ln(1024) = 6.93)
    assert abs(loss8 - loss32) <= MARGIN * loss32, (loss8, loss32)
    eight = [p for p, s in opt.state.items() if s["exp_avg"].dtype == torch.uint8]
    assert sum(p.numel() for p in eight) == 49152
