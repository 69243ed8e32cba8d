"""One run of the language-model demo: train one precision mode, measure it, evaluate it on the validation set.

What is measured, and how:

* **train loss**: the mean of the per-step training losses (as the mode computed them) over the last 10% of steps.
* **validation loss**: the mean next-byte cross-entropy (nats) over the corpus's fixed validation windows, with the
  model's weights *as the mode stores them* (bf16 for the bf16 modes, the fp16 model of O2) evaluated in fp32
  arithmetic by an fp32 copy of the model: every mode is measured by the same ruler, so the differences are the
  weights' and not the evaluation's rounding. Evaluated every ``eval_every`` steps and after the last one.
* **tokens/s**: training tokens over the wall time of the timed steps (all but the first ``WARMUP_STEPS``, which
  include one-time work: lazy state, kernel compilation on a GPU); evaluation is not timed.
* **bytes/param**: the bytes of the distinct storages of the model's weights, the masters and the optimizer's
  state held between steps, over the model's parameter count (gradients come on top and are not counted).
* **skipped**: steps skipped because the gradients held inf/NaN (the loss scaler's backoffs, or the optimizer's own
  count without a scaler); **scale**: the final loss scale of the modes with a scaler.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from .lm import ByteLM, LMConfig
from .modes import Hyper, Mode, held_bytes, make_trainer
from .text import Corpus

__all__ = ["WARMUP_STEPS", "LMResult", "evaluate", "train_mode"]

WARMUP_STEPS = 2


@dataclass
class LMResult:
    mode: str
    reference: str
    recipe: str
    seed: int
    train_losses: list[float]  # every step's training loss
    eval_steps: list[int]  # the steps after which the validation loss was measured (0: before training)
    val_losses: list[float]
    final_train: float
    final_val: float
    tokens_per_s: float
    bytes_per_param: float
    skipped: int
    scale: float | None
    params: int
    seconds: float  # wall time of the whole run, evaluation included
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.train_losses + self.val_losses)


@torch.no_grad()
def evaluate(model: ByteLM, x: torch.Tensor, y: torch.Tensor, chunk: int = 64) -> float:
    """Mean next-byte cross-entropy of ``model`` (in its own dtype) over the windows ``x`` -> ``y``."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], chunk):
        logits = model(x[i:i + chunk]).float()
        total += F.cross_entropy(logits.flatten(0, 1), y[i:i + chunk].flatten(), reduction="sum").double()
    return float(total) / y.numel()


def _build(cfg: LMConfig, seed: int) -> ByteLM:
    torch.manual_seed(seed)
    return ByteLM(cfg)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_mode(mode: Mode, corpus: Corpus, cfg: LMConfig, hyper: Hyper, *, steps: int, seed: int,
               device: torch.device, eval_every: int, val_windows: int, progress: bool = True,
               desc: str | None = None) -> LMResult:
    """Train ``mode`` for ``steps`` steps from the fp32 initialisation of ``seed`` on the batches of ``seed``."""
    from tqdm.auto import tqdm

    if steps <= WARMUP_STEPS:
        raise ValueError(f"steps={steps}: need more than the {WARMUP_STEPS} untimed warm-up steps.")
    start = time.perf_counter()
    trainer = make_trainer(mode, lambda: _build(cfg, seed), hyper, device, seed)
    probe = ByteLM(cfg).to(device)  # fp32 ruler for the validation loss
    vx, vy = (t.to(device) for t in corpus.validation(val_windows, cfg.seq_len))
    params = sum(p.numel() for p in trainer.model.parameters())
    gen = torch.Generator().manual_seed(seed)

    def validate() -> float:
        probe.load_state_dict({k: v.float() for k, v in trainer.weights().items()})
        return evaluate(probe, vx, vy)

    losses: list[torch.Tensor] = []
    eval_steps, val_losses = [0], [validate()]
    timed = 0.0
    bar = tqdm(range(steps), desc=desc or mode.name, disable=not progress, leave=True, dynamic_ncols=True)
    for step in bar:
        x, y = (t.to(device, non_blocking=True) for t in corpus.batch(gen, cfg.batch, cfg.seq_len))
        if step == WARMUP_STEPS:
            _sync(device)
            t0 = time.perf_counter()
        losses.append(trainer.step(x, y, hyper.lr_at(trainer.base_lr, step, steps)))
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            _sync(device)
            if step >= WARMUP_STEPS:
                timed += time.perf_counter() - t0
            eval_steps.append(step + 1)
            val_losses.append(validate())
            bar.set_postfix(val=f"{val_losses[-1]:.3f}", refresh=False)
            t0 = time.perf_counter()
    train_losses = torch.stack(losses).float().cpu().tolist()
    tail = train_losses[-max(1, steps // 10):]
    return LMResult(
        mode=mode.name, reference=mode.reference, recipe=mode.recipe, seed=seed, train_losses=train_losses,
        eval_steps=eval_steps, val_losses=val_losses, final_train=sum(tail) / len(tail), final_val=val_losses[-1],
        tokens_per_s=(steps - WARMUP_STEPS) * cfg.tokens_per_step / timed,
        bytes_per_param=held_bytes(trainer.state_tensors()) / params, skipped=trainer.skipped(),
        scale=trainer.scale(), params=params, seconds=time.perf_counter() - start,
    )
