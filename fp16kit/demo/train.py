"""One demo run: a small MLP with batchnorm trained on the digits with apex-style amp at one opt level.

The loop is exactly an apex.amp script (``amp.initialize``, ``amp.scale_loss``, ``optimizer.step()``).
Per-step losses and loss scales are kept as device tensors and read once at the end, so the timing is
not inflated by a host sync per step.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .. import amp
from .data import Digits

__all__ = ["RunConfig", "RunResult", "make_model", "train_one"]


@dataclass
class RunConfig:
    label: str  # "O0" ... "O3", "O2-bf16"
    opt_level: str
    low_precision_dtype: torch.dtype | None = None


@dataclass
class RunResult:
    label: str
    losses: list[float]
    scales: list[float]
    final_loss: float  # mean training loss over the last 10% of steps
    accuracy: float  # test-set accuracy after training
    skipped: int
    final_scale: float
    seconds: float
    memory_bytes: int
    memory_kind: str  # "peak allocated" (CUDA) or "training state" (CPU)
    doctor: Any = None  # the run's fp16kit.doctor report when it was watched (``doctor_every``)


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def _make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    from ..optim import FusedLAMB

    return FusedLAMB(params, lr=lr)


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by params, grads, fp32 masters and optimizer state (each tensor counted once)."""
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if isinstance(t, torch.Tensor):
            seen[id(t)] = t.numel() * t.element_size()

    for p in list(model.parameters()) + list(amp.master_params(optimizer)):
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for s in optimizer.state.values():
        for v in s.values():
            add(v)
    return sum(seen.values())


def train_one(cfg: RunConfig, data: Digits, *, steps: int, batch_size: int, hidden: int, lr: float,
              optimizer: str, device: torch.device, scale_window: int, seed: int, progress: bool,
              doctor_every: int | None = None, doctor_activations: bool = True) -> RunResult:
    """Train one run. With ``doctor_every``, ``fp16kit.doctor`` watches it (parameter gradients, and activation
    gradients unless ``doctor_activations`` is false, every ``doctor_every`` steps, the run's loss scale divided
    out) and ``RunResult.doctor`` is its report."""
    from tqdm.auto import tqdm

    model = make_model(hidden, seed).to(device)
    opt = _make_optimizer(optimizer, list(model.parameters()), lr)
    model, opt = amp.initialize(model, opt, opt_level=cfg.opt_level, verbosity=0,
                                low_precision_dtype=cfg.low_precision_dtype, scale_window=scale_window)
    session = opt._amp_stash.session
    scaler = session.scalers[0]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = data.x_train.shape[0]
    losses, scales = [], []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    watcher = None
    if doctor_every:
        from .. import doctor

        watcher = doctor.watch(model, every=doctor_every, activations=doctor_activations, scaler=scaler)
    start = time.perf_counter()
    model.train()
    with watcher or contextlib.nullcontext():
        for _ in tqdm(range(steps), desc=f"{cfg.label:>8}", disable=not progress, leave=True, dynamic_ncols=True):
            idx = torch.randint(0, n, (batch_size,), generator=gen).to(device)
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.detach().float())
            scales.append(scaler.scale.detach().clone())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        accuracy = float((model(data.x_test).argmax(1) == data.y_test).float().mean())
    loss_values = torch.stack(losses).cpu().tolist()
    scale_values = torch.cat(scales).cpu().tolist()
    tail = loss_values[-max(1, steps // 10):]
    if device.type == "cuda":
        memory, kind = torch.cuda.max_memory_allocated(device), "peak allocated"
    else:
        memory, kind = _state_bytes(model, opt), "training state"
    return RunResult(
        label=cfg.label, losses=loss_values, scales=scale_values, final_loss=sum(tail) / len(tail),
        accuracy=accuracy, skipped=session.steps_skipped(0), final_scale=scaler.get_scale(), seconds=seconds,
        memory_bytes=memory, memory_kind=kind,
        doctor=None if watcher is None else watcher.report(cfg.low_precision_dtype or torch.float16),
    )
