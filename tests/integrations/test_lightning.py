"""fp16kit under a real ``lightning.Trainer`` (CPU): ``fp16kit.integrations.lightning.AmpPrecision``.

Each Lightning run is compared with a reference on the same tiny model and data:

* torch-style bf16: Lightning's own ``precision="bf16-mixed"`` (same bits on a model whose ops torch's CPU autocast
  and fp16kit's policy cast alike), and the ``fp16kit.amp.autocast`` loop written by hand (LayerNorm included,
  where torch's CPU autocast differs: it runs layer_norm in bf16, fp16kit and torch's CUDA autocast in fp32);
* torch-style fp16: Lightning's own ``MixedPrecision("16-mixed", "cpu", torch GradScaler)`` plugin (Lightning turns
  ``precision="16-mixed"`` into bf16 on a CPU, so its plugin is passed directly), overflows included; with clipping
  and a fused optimizer (which Lightning's plugin refuses) the autocast + GradScaler loop written by hand;
* apex-style O1/O2: the apex loop written by hand (``amp.initialize``, ``scale_loss`` with ``delay_unscale``,
  ``clip_grad_norm_(amp.master_params(opt))``), with gradient accumulation and clipping;
* checkpoints: ``trainer.save_checkpoint`` then ``Trainer.fit(ckpt_path=..., weights_only=True)`` in a new process
  state (new module, plugin and Trainer) ends bit for bit where the uninterrupted run ends.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

pytest.importorskip("lightning")

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from fp16kit import amp
from fp16kit.integrations.lightning import AmpPrecision
from fp16kit.optim import FusedAdam, FusedLAMB

BATCH, SAMPLES = 4, 16  # 4 micro-batches per epoch


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 64, generator=g), torch.randn(SAMPLES, 4, generator=g))


class Tiny(L.LightningModule):
    """Linear(64, 64) (4096 weights: 8-bit moments apply) -> GELU [-> LayerNorm] -> Linear(64, 4); MSE in fp32."""

    def __init__(self, make_opt: Callable, norm: bool = False, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 64), torch.nn.GELU()] + ([torch.nn.LayerNorm(64)] if norm else [])
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(64, 4)).to(dtype)
        self.make_opt = make_opt
        self.data_dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x.to(self.data_dtype)).float(), y)

    def configure_optimizers(self):
        return self.make_opt(self.parameters())


def _fit(module: Tiny, plugin=None, *, epochs: int = 1, ckpt=None, save=None, **kw) -> L.Trainer:
    args = dict(max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1)
    args.update(kw)
    if plugin is not None:
        args["plugins"] = [plugin]
    trainer = L.Trainer(**args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|does not have many workers|LeafSpec).*")
        trainer.fit(module, DataLoader(_data(), batch_size=BATCH), ckpt_path=ckpt,
                    weights_only=True if ckpt else None)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer


def _params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"param {i} differs: max |diff| {(x - y).abs().max()}"


def _loss(module: Tiny, x, y, accum: int) -> torch.Tensor:
    return torch.nn.functional.mse_loss(module(x.to(module.data_dtype)).float(), y) / accum


def _autocast_loop(module: Tiny, dtype, *, scaler=None, clip: float = 0.0, accum: int = 1, epochs: int = 1):
    """What Lightning's automatic optimization does, by hand: loss / accum per micro-batch, backward (scaled), at
    the boundary unscale + clip + step + update, zero_grad."""
    opt = module.configure_optimizers()
    batches = list(DataLoader(_data(), batch_size=BATCH))
    for _ in range(epochs):
        for i, (x, y) in enumerate(batches):
            with amp.autocast(dtype=dtype):
                loss = _loss(module, x, y, accum)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if (i + 1) % accum:
                continue
            if clip:
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(list(module.parameters()), clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return opt


def _apex_loop(module: Tiny, opt_level: str, dtype, *, clip: float = 0.0, accum: int = 1, **options):
    opt = module.configure_optimizers()
    amp.initialize(module, opt, opt_level=opt_level, low_precision_dtype=dtype, verbosity=0, **options)
    batches = list(DataLoader(_data(), batch_size=BATCH))
    for i, (x, y) in enumerate(batches):
        if opt_level == "O1":
            with amp.autocast(dtype=dtype):
                loss = _loss(module, x, y, accum)
        else:
            loss = _loss(module, x, y, accum)
        last = (i + 1) % accum == 0
        with amp.scale_loss(loss, opt, delay_unscale=not last) as scaled:
            scaled.backward()
        if not last:
            continue
        if clip:
            torch.nn.utils.clip_grad_norm_(list(amp.master_params(opt)), clip)
        opt.step()
        opt.zero_grad()
    return opt


def _lamb(params):
    return FusedLAMB(params, lr=1e-2, weight_decay=0.01)


# ------------------------------------------------------------------------------------------------ torch-style
def test_bf16_is_lightnings_bf16_mixed() -> None:
    ours = Tiny(_lamb)
    _fit(ours, AmpPrecision("bf16-mixed"))
    lightning = Tiny(_lamb)
    _fit(lightning, precision="bf16-mixed")
    _assert_same(_params(ours), _params(lightning))


@pytest.mark.slow
def test_bf16_with_layer_norm_is_the_autocast_loop() -> None:
    """With LayerNorm (which torch's CPU autocast runs in bf16, fp16kit in fp32), accumulation and clipping: the
    fp16kit autocast loop written by hand."""
    ours = Tiny(_lamb, norm=True)
    _fit(ours, AmpPrecision("bf16-mixed"), accumulate_grad_batches=2, gradient_clip_val=0.05)
    ref = Tiny(_lamb, norm=True)
    _autocast_loop(ref, torch.bfloat16, clip=0.05, accum=2)
    _assert_same(_params(ours), _params(ref))


def test_fp16_is_lightnings_mixed_precision_plugin_overflow_included() -> None:
    """fp16kit autocast + GradScaler vs Lightning's MixedPrecision with torch's autocast + GradScaler: the first
    step overflows (scale 2**30: the fp16 grads pass 65504), is skipped by both and the scale backs off."""
    make = lambda p: torch.optim.AdamW(p, lr=1e-2)
    ours = Tiny(make)
    plugin = AmpPrecision("16-mixed", scaler=amp.GradScaler(init_scale=2.0**30, growth_interval=2))
    _fit(ours, plugin, gradient_clip_val=0.5)
    theirs = Tiny(make)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, growth_interval=2)
    _fit(theirs, MixedPrecision("16-mixed", "cpu", torch_scaler), gradient_clip_val=0.5)
    _assert_same(_params(ours), _params(theirs))
    assert plugin.scaler.get_scale() == torch_scaler.get_scale() < 2.0**30  # backed off, then grew


def test_fp16_clips_with_a_fused_optimizer_lightnings_plugin_refuses() -> None:
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(Tiny(_lamb), MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu")), gradient_clip_val=0.05)
    ours = Tiny(_lamb)
    plugin = AmpPrecision("16-mixed")
    _fit(ours, plugin, gradient_clip_val=0.05, accumulate_grad_batches=2)
    ref = Tiny(_lamb)
    scaler = amp.GradScaler()
    _autocast_loop(ref, torch.float16, scaler=scaler, clip=0.05, accum=2)
    _assert_same(_params(ours), _params(ref))
    assert plugin.scaler.get_scale() == scaler.get_scale()


@pytest.mark.parametrize("mode", ["split", pytest.param("stochastic", marks=pytest.mark.slow),
                                  pytest.param("state8", marks=pytest.mark.slow)])
def test_bf16_model_with_fused_optimizer_modes(mode) -> None:
    """A bf16 model whose FusedAdam keeps split masters, rounds stochastically, or keeps 8-bit moments: the plugin's
    run is the autocast loop's, bit for bit."""
    def make(params):
        if mode == "state8":
            return FusedAdam(params, lr=1e-2, state_bits=8)
        return FusedAdam(params, lr=1e-2, master_weights=mode, rounding_seed=7 if mode == "stochastic" else None)

    ours = Tiny(make, dtype=torch.bfloat16)
    _fit(ours, AmpPrecision("bf16-mixed"), gradient_clip_val=0.5)
    ref = Tiny(make, dtype=torch.bfloat16)
    opt = _autocast_loop(ref, torch.bfloat16, clip=0.5)
    _assert_same(_params(ours), _params(ref))
    if mode == "state8":
        assert opt.state[ref.net[0].weight]["exp_avg"].dtype == torch.uint8


# ------------------------------------------------------------------------------------------------ apex-style
@pytest.mark.parametrize(("opt_level", "dtype", "make"), [
    ("O2", torch.float16, _lamb),
    pytest.param("O1", torch.bfloat16, lambda p: FusedAdam(p, lr=1e-2), marks=pytest.mark.slow),
])
def test_apex_opt_levels_are_the_apex_loop(opt_level, dtype, make) -> None:
    ours = Tiny(make, norm=True)
    plugin = AmpPrecision("16-mixed" if dtype == torch.float16 else "bf16-mixed", opt_level=opt_level)
    trainer = _fit(ours, plugin, accumulate_grad_batches=2, gradient_clip_val=0.05)
    ref = Tiny(make, norm=True)
    opt = _apex_loop(ref, opt_level, dtype, clip=0.05, accum=2)
    _assert_same(_params(ours), _params(ref))
    ours_opt = trainer.optimizers[0]
    if opt_level == "O2":  # fp16 model copy, fp32 masters in the fused optimizer's state
        assert ours.net[0].weight.dtype == torch.float16
        _assert_same(list(amp.master_params(ours_opt)), list(amp.master_params(opt)))
        assert all(m.dtype == torch.float32 for m in amp.master_params(ours_opt))
    assert amp.state_dict(optimizer=ours_opt) == amp.state_dict(optimizer=opt)


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("route", ["O2-fp16", pytest.param("16-mixed", marks=pytest.mark.slow),
                                   pytest.param("bf16-state8", marks=pytest.mark.slow)])
def test_resume_from_a_lightning_checkpoint_is_bit_for_bit(route, tmp_path) -> None:
    def plugin():
        if route == "O2-fp16":
            return AmpPrecision("16-mixed", opt_level="O2", amp_options={"scale_window": 2})
        if route == "16-mixed":
            return AmpPrecision("16-mixed", scaler=amp.GradScaler(init_scale=2.0**30, growth_interval=2))
        return AmpPrecision("bf16-mixed")

    def make(params):
        return FusedAdam(params, lr=1e-2, state_bits=8) if route == "bf16-state8" else _lamb(params)

    straight = Tiny(make)
    _fit(straight, plugin(), epochs=2)
    first = Tiny(make)
    path = tmp_path / "epoch1.ckpt"
    _fit(first, plugin(), epochs=1, save=path)
    resumed = Tiny(make)
    p2 = plugin()
    _fit(resumed, p2, epochs=2, ckpt=str(path))
    _assert_same(_params(resumed), _params(straight))
    ckpt = torch.load(path, weights_only=True)
    # bf16 needs neither a scaler nor amp state: the plugin's state is empty and Lightning stores no entry for it
    saved = ckpt.get("AmpPrecision", {})
    assert ("amp" in saved) == (route == "O2-fp16")
    assert ("scaler" in saved) == (route == "16-mixed")
    assert bool(saved) == (route != "bf16-state8")


# ------------------------------------------------------------------------------------------------ refusals
def test_refusals_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"'16-mixed' .* or 'bf16-mixed'"):
        AmpPrecision("16-true")
    with pytest.raises(ValueError, match="letter O"):
        AmpPrecision("16-mixed", opt_level="02")
    with pytest.raises(ValueError, match="bf16 needs no loss scaling"):
        AmpPrecision("bf16-mixed", scaler=amp.GradScaler())
    with pytest.raises(ValueError, match="need an opt_level"):
        AmpPrecision("16-mixed", amp_options={"loss_scale": 128.0})
    with pytest.raises(ValueError, match="apex-style amp state"):
        AmpPrecision("16-mixed").load_state_dict({"amp": {}})
    with pytest.raises(ValueError, match="GradScaler's state"):
        AmpPrecision("bf16-mixed").load_state_dict({"scaler": {}})
