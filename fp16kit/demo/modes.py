"""The precision modes the language-model demo compares, each a complete training recipe.

A mode builds its model (from the same seeded fp32 initialisation), its optimizer and its scaler, and runs one
training step the way a user's script would with that recipe. Every mode sees the same batches, the same
learning-rate schedule and the same hyper-parameters as its reference:

==================  ===========================================================================  ===========
mode                recipe                                                                        reference
==================  ===========================================================================  ===========
fp32                fp32 model, ``torch.optim.AdamW``                                             (itself)
torch-amp           ``torch.autocast(fp16)`` + ``torch.amp.GradScaler`` + ``torch.optim.AdamW``  fp32
fp32-lamb           fp32 model, ``fp16kit.optim.FusedLAMB``                                       (itself)
amp-lamb            ``fp16kit.amp.autocast(fp16)`` + ``fp16kit.amp.GradScaler`` + FusedLAMB      fp32-lamb
O2-lamb             apex-style ``amp.initialize(opt_level="O2")`` + FusedLAMB (fp16 model)       fp32-lamb
bf16-master         bf16 model, ``FusedAdam(master_weights=True)`` (fp32 masters)                fp32
bf16-split          bf16 model, ``FusedAdam(master_weights="split")`` (16+16 masters)            fp32
bf16-stochastic     bf16 model, ``FusedAdam(master_weights="stochastic")`` (no masters)          fp32
...-8bit            the three bf16 modes with ``state_bits=8`` (8-bit moments)                    fp32
==================  ===========================================================================  ===========

fp32-lamb is the LAMB modes' reference so that a mode's distance to its reference measures precision, not the
choice between AdamW and LAMB (LAMB with weight decay applies a per-tensor trust ratio: another optimizer). The
bf16 modes use ``FusedAdam`` in AdamW mode, whose numbers are ``torch.optim.AdamW``'s (docs/optim.md), so they
compare with the fp32 AdamW run directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from .lm import ByteLM

__all__ = ["MODES", "Hyper", "Mode", "Trainer", "make_trainer"]


@dataclass(frozen=True)
class Mode:
    name: str
    reference: str  # the mode it is compared against (its own name for a reference)
    recipe: str  # one line for the table's legend
    optimizer: str  # "adamw" (torch), "lamb" or "adam" (fp16kit.optim)
    autocast: str | None = None  # "torch" or "fp16kit": fp16 autocast with that library's GradScaler
    opt_level: str | None = None  # apex-style amp.initialize
    bf16: str | bool | None = None  # the master_weights option of a bf16 model (True, "split", "stochastic")
    state_bits: int = 32


def _bf16_modes() -> list[Mode]:
    out = []
    for bits in (32, 8):
        for mw, short, what in ((True, "master", "fp32 masters"), ("split", "split", "16+16 split masters"),
                                ("stochastic", "stochastic", "stochastic rounding, no masters")):
            suffix, moments = ("-8bit", ", 8-bit moments") if bits == 8 else ("", "")
            option = "True" if mw is True else f'"{mw}"'
            out.append(Mode(f"bf16-{short}{suffix}", "fp32",
                            f"bf16 model, FusedAdam(master_weights={option}{', state_bits=8' if bits == 8 else ''})"
                            f": {what}{moments}", "adam", bf16=mw, state_bits=bits))
    return out


MODES: dict[str, Mode] = {m.name: m for m in [
    Mode("fp32", "fp32", "fp32 model, torch.optim.AdamW (the reference)", "adamw"),
    Mode("torch-amp", "fp32", "torch.autocast(fp16) + torch.amp.GradScaler + torch.optim.AdamW", "adamw",
         autocast="torch"),
    Mode("fp32-lamb", "fp32-lamb", "fp32 model, fp16kit FusedLAMB (the LAMB modes' reference)", "lamb"),
    Mode("amp-lamb", "fp32-lamb", "fp16kit.amp.autocast(fp16) + fp16kit GradScaler + FusedLAMB", "lamb",
         autocast="fp16kit"),
    Mode("O2-lamb", "fp32-lamb", 'fp16kit amp.initialize(opt_level="O2") + FusedLAMB: fp16 model, fp32 masters',
         "lamb", opt_level="O2"),
    *_bf16_modes(),
]}


@dataclass(frozen=True)
class Hyper:
    """Optimizer settings shared by every mode (LAMB's lr is its own: the trust ratio scales steps per tensor)."""

    lr: float = 3e-3
    lamb_lr: float = 5e-2
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    clip: float = 1.0  # global gradient-norm clipping (FusedLAMB's max_grad_norm; clip_grad_norm_ for AdamW)
    warmup: float = 0.1  # fraction of the steps with a linear warm-up, then cosine decay to 10%
    scale_window: int = 100  # clean steps before a dynamic loss scale doubles (torch's and apex's: 2000)

    def lr_at(self, base: float, step: int, steps: int) -> float:
        import math

        warm = max(1, round(self.warmup * steps))
        if step < warm:
            return base * (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return base * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """One mode's model, optimizer and scaler. ``step(x, y, lr)`` trains on one batch and returns the loss (a
    detached fp32 device tensor); ``weights()`` the model's weights as stored; ``state_tensors()`` every tensor
    held between steps (weights, masters, moments; gradients excluded); ``skipped()`` the steps skipped for
    inf/NaN gradients; ``scale()`` the loss scale (``None`` without a scaler)."""

    def __init__(self, mode: Mode, model: ByteLM, hyper: Hyper, device: torch.device, seed: int) -> None:
        self.mode, self.hyper = mode, hyper
        self.model = model
        self.base_lr = hyper.lamb_lr if mode.optimizer == "lamb" else hyper.lr
        self.scaler: Any = None
        self._session: Any = None
        self._skips: torch.Tensor | None = None  # steps whose update backed the scale off (a device counter)
        if mode.bf16 is not None:
            self.model = model.to(torch.bfloat16)
        self.opt = self._optimizer(seed)
        if mode.opt_level is not None:
            from .. import amp

            self.model, self.opt = amp.initialize(self.model, self.opt, opt_level=mode.opt_level, verbosity=0,
                                                  scale_window=hyper.scale_window)
            self._session = self.opt._amp_stash.session
        elif mode.autocast == "torch":
            self.scaler = torch.amp.GradScaler(device.type, growth_interval=hyper.scale_window)
        elif mode.autocast == "fp16kit":
            from ..amp import GradScaler

            self.scaler = GradScaler(growth_interval=hyper.scale_window)
        self._device = device
        # LAMB clips inside its step (max_grad_norm); Adam/AdamW clip before it, as training scripts do
        self._clip_here = mode.optimizer != "lamb" and hyper.clip > 0

    def _optimizer(self, seed: int) -> torch.optim.Optimizer:
        m, h = self.mode, self.hyper
        params = list(self.model.parameters())
        if m.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=h.lr, betas=h.betas, weight_decay=h.weight_decay)
        from ..optim import FusedAdam, FusedLAMB

        if m.optimizer == "lamb":
            return FusedLAMB(params, lr=h.lamb_lr, betas=h.betas, weight_decay=h.weight_decay, max_grad_norm=h.clip)
        options: dict[str, Any] = {"state_bits": m.state_bits}
        if m.bf16 is not None:
            options["master_weights"] = m.bf16
        if m.bf16 == "stochastic":
            options["rounding_seed"] = seed
        return FusedAdam(params, lr=h.lr, betas=h.betas, weight_decay=h.weight_decay, **options)

    def _region(self) -> contextlib.AbstractContextManager[Any]:
        if self.mode.autocast == "torch":
            return torch.autocast(self._device.type, dtype=torch.float16)
        if self.mode.autocast == "fp16kit":
            from ..amp import autocast

            return autocast(dtype=torch.float16)
        return contextlib.nullcontext()

    def step(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> torch.Tensor:
        for group in self.opt.param_groups:
            group["lr"] = lr
        with self._region():
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        self.opt.zero_grad(set_to_none=True)
        if self._session is not None:
            from .. import amp

            with amp.scale_loss(loss, self.opt) as scaled:
                scaled.backward()
            self.opt.step()
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
            if self._clip_here:
                self.scaler.unscale_(self.opt)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hyper.clip)
            self.scaler.step(self.opt)
            before = self._scale_tensor().clone()
            self.scaler.update()
            backed_off = (self._scale_tensor() < before).int()
            self._skips = backed_off if self._skips is None else self._skips + backed_off
        else:
            loss.backward()
            if self._clip_here:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.hyper.clip)
            self.opt.step()
        return loss.detach()

    def _scale_tensor(self) -> torch.Tensor:
        # The scale as a device tensor, read without a host sync (a backoff halves it: one skipped step).
        if self.mode.autocast == "torch":
            return self.scaler._scale  # torch's GradScaler keeps it there (no public accessor without a sync)
        return self.scaler.loss_scaler.scale

    def skipped(self) -> int:
        if self._session is not None:
            return self._session.steps_skipped(0)
        if self.scaler is not None:
            return 0 if self._skips is None else int(self._skips.sum().item())
        counter = getattr(self.opt, "nonfinite_skips", None)
        return 0 if counter is None else int(counter.item())

    def scale(self) -> float | None:
        if self._session is not None:
            return self._session.scalers[0].get_scale()
        return None if self.scaler is None else self.scaler.get_scale()

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.model.parameters()
        yield from self.model.buffers()
        for state in self.opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        if self._session is not None:
            from .. import amp

            yield from amp.master_params(self.opt)


def held_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer, such as an 8-bit moment's codes
    and its absmax, count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def make_trainer(mode: Mode, build: Callable[[], ByteLM], hyper: Hyper, device: torch.device,
                 seed: int) -> Trainer:
    """The mode's trainer around a freshly built model (``build`` seeds and returns an fp32 model)."""
    return Trainer(mode, build().to(device), hyper, device, seed)
