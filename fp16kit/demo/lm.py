"""The language-model demo's model: a small decoder-only byte-level transformer, in plain torch modules.

GPT-2's shape at a small scale: token (byte, 256 values) and learned position embeddings, ``layers`` pre-LayerNorm
blocks of causal self-attention (``torch.nn.functional.scaled_dot_product_attention`` with ``is_causal=True``) and a
4x GELU MLP, a final LayerNorm, and an output head tied to the token embedding. No dropout, so that a run is a
function of its seed and the precision mode alone.

``SIZES`` holds the presets of ``--size``: ``quick`` (the test suite's smoke run), ``cpu`` (the demo's default on a
2-core CPU), ``bench`` (the CPU convergence study) and ``gpu`` (a larger variant, about 10.8M parameters).
Every preset's Linear weights and token embedding hold at least 4096 elements, the size from which ``state_bits=8``
quantizes the moments (``fp16kit.kernels.state8.SMALL_NUMEL``), so the 8-bit modes apply to all of them (and to the
position embedding except in ``quick``); biases and LayerNorms keep fp32 moments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SIZES", "ByteLM", "LMConfig"]

VOCAB = 256  # bytes


@dataclass(frozen=True)
class LMConfig:
    """The model's shape and the batch it trains on (``batch`` sequences of ``seq_len`` bytes per step)."""

    d_model: int
    layers: int
    heads: int
    seq_len: int
    batch: int

    def __post_init__(self) -> None:
        if min(self.d_model, self.layers, self.heads, self.seq_len, self.batch) < 1:
            raise ValueError(f"LMConfig: every field must be >= 1, got {self}.")
        if self.d_model % self.heads:
            raise ValueError(f"LMConfig: d_model={self.d_model} must be a multiple of heads={self.heads}.")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.batch


SIZES: dict[str, LMConfig] = {
    "quick": LMConfig(d_model=64, layers=1, heads=2, seq_len=32, batch=4),
    "cpu": LMConfig(d_model=64, layers=2, heads=4, seq_len=64, batch=6),
    "bench": LMConfig(d_model=64, layers=2, heads=4, seq_len=64, batch=8),
    "gpu": LMConfig(d_model=384, layers=6, heads=6, seq_len=256, batch=64),
}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteLM(nn.Module):
    """``forward(idx)``: int64 bytes ``[batch, t]`` (``t <= seq_len``) -> logits ``[batch, t, 256]`` in the
    model's dtype (or autocast's). Initialisation: GPT-2's (normal, std 0.02; residual projections scaled by
    ``1 / sqrt(2 * layers)``; zero biases)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                continue  # biases are zero and LayerNorm weights one already
            std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
            nn.init.normal_(p, std=std)
        for block in self.blocks:
            for lin in (block.qkv, block.proj, block.fc, block.out):
                nn.init.zeros_(lin.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"ByteLM: a sequence of {t} bytes is longer than seq_len={self.cfg.seq_len}.")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok.weight)  # the head is the token embedding (tied)
