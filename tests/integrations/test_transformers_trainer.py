"""The real HF ``transformers.Trainer`` on a tiny BertForMaskedLM (built locally, CPU, no network).

* torch-style: ``Trainer(bf16=True / fp16=True, optimizers=(FusedLAMB(...), sched))`` trains exactly as the
  same loop written by hand with ``torch.autocast`` (+ ``GradScaler``) and the fused optimizer;
* apex-style: ``AmpTrainer`` at O1/O2 trains exactly as the apex loop written by hand (``scale_loss``,
  ``delay_unscale`` accumulation, clipping of ``amp.master_params``), logs the unscaled grad norm, skips
  overflowed steps and resumes from its checkpoints bit for bit;
* the stock Trainer with amp-initialized objects warns, naming the fix.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from hf_helpers import ACCUM, BATCH, CLIP, STEPS, MaskedLMData, autocast_reference, batches, tiny_bert
from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

from fp16kit import amp
from fp16kit.integrations.transformers import AMP_STATE_NAME, AmpTrainer
from fp16kit.optim import FusedAdam, FusedLAMB


class _InOrder:
    """Sequential data order and the model's own mean loss, so that a hand-written loop can follow exactly."""

    poison_steps: tuple[int, ...] = ()

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.state.global_step in self.poison_steps:
            loss = loss * float("inf")  # an overflow: the step must be skipped and the scale backed off
        return loss


class OrderedTrainer(_InOrder, Trainer):
    pass


class OrderedAmpTrainer(_InOrder, AmpTrainer):
    pass


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _args(tmp_path, device: str = "cpu", **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
                max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=device == "cpu",
                disable_tqdm=True,
                learning_rate=1e-3, max_grad_norm=CLIP, seed=0)
    base.update(kw)
    return TrainingArguments(**base)


def _trainer(cls, tmp_path, opt_cls=FusedLAMB, args=None, **kw):
    model = tiny_bert()
    trainer = cls(model=model, args=args or _args(tmp_path), train_dataset=MaskedLMData(),
                  optimizers=(opt_cls(model.parameters(), lr=1e-3), None), **kw)
    trainer.model_accepts_loss_kwargs = False  # the model's mean loss, divided by the accumulation steps
    return trainer


def _norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------------ torch-style
def test_trainer_bf16_with_fused_lamb_is_the_autocast_loop(tmp_path) -> None:
    trainer = _trainer(OrderedTrainer, tmp_path, args=_args(tmp_path, bf16=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.train()
    model, norms = autocast_reference(torch.bfloat16, schedule=True)
    _assert_same(_params(trainer.model), _params(model))
    assert _norms(trainer) == pytest.approx(norms, rel=0, abs=0)


@pytest.mark.parametrize("device", DEVICES)
def test_trainer_fp16_gradscaler_route_with_fused_lamb(tmp_path, device) -> None:
    """``Trainer(fp16=True)``: accelerate's GPU route (autocast fp16 + GradScaler handing grad_scale/found_inf to the
    fused optimizer, unscale before clipping); on the CPU forced (accelerate turns fp16 off on CPU devices)."""
    trainer = _trainer(OrderedTrainer, tmp_path, args=_args(tmp_path, device, fp16=True))
    if device == "cpu":
        trainer.accelerator.native_amp = True
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    trainer.train()
    scaler = torch.amp.GradScaler(device, init_scale=2.0**16)
    model, norms = autocast_reference(torch.float16, scaler, schedule=True, device=device)
    _assert_same(_params(trainer.model), _params(model))
    assert _norms(trainer) == pytest.approx(norms, rel=0, abs=0)
    assert trainer.accelerator.scaler.get_scale() == scaler.get_scale()


# ------------------------------------------------------------------------------------------------ apex-style
def _apex_hand_loop(opt_level: str, opt_cls, poison: tuple[int, ...] = (), device: str = "cpu", **amp_kw):
    model = tiny_bert().to(device)
    opt = opt_cls(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **amp_kw)
    sched = get_linear_schedule_with_warmup(opt, 0, STEPS)
    data = batches(MaskedLMData(), BATCH, device)
    norms = []
    model.train()
    for s in range(STEPS):
        for k in range(ACCUM):
            loss = model(**data[(s * ACCUM + k) % len(data)]).loss
            if s in poison:
                loss = loss * float("inf")
            with amp.scale_loss(loss / ACCUM, opt, delay_unscale=k < ACCUM - 1) as scaled:
                scaled.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(amp.master_params(opt), CLIP)))
        opt.step()
        sched.step()
        model.zero_grad()
    return model, opt, norms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_level, opt_cls", [("O2", FusedLAMB), ("O2", torch.optim.AdamW), ("O1", FusedAdam)],
                         ids=["O2-FusedLAMB", "O2-AdamW", "O1-FusedAdam"])
def test_amp_trainer_is_the_apex_loop(tmp_path, opt_level, opt_cls, device) -> None:
    trainer = _trainer(OrderedAmpTrainer, tmp_path, opt_cls=opt_cls, args=_args(tmp_path, device),
                       opt_level=opt_level, amp_options={"verbosity": 0})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # none of the amp trap warnings
        trainer.train()
    model, _, norms = _apex_hand_loop(opt_level, opt_cls, device=device)
    _assert_same(_params(trainer.model), _params(model))
    assert _norms(trainer) == pytest.approx(norms, rel=0, abs=0)
    assert 0.5 < norms[0] < 10.0  # the unscaled norm (the stock Trainer logged 65536 times this)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_cls", [FusedLAMB, torch.optim.AdamW], ids=["FusedLAMB", "AdamW"])
def test_amp_trainer_skips_an_overflowed_step_and_resumes_bit_for_bit(tmp_path, device, opt_cls) -> None:
    amp_options = {"verbosity": 0, "scale_window": 2}
    args = _args(tmp_path, device, max_steps=6, save_strategy="steps", save_steps=3)
    straight = _trainer(OrderedAmpTrainer, tmp_path, opt_cls=opt_cls, args=args, amp_options=amp_options)
    straight.poison_steps = (1,)
    straight.train()
    norms = _norms(straight)
    assert norms[1] != norms[1] or norms[1] == float("inf")  # the overflowed step: inf/NaN norm, step skipped
    final_state = amp.state_dict(optimizer=straight.optimizer)
    assert final_state["loss_scaler0"]["fp16kit"]["steps_skipped"] == 1
    ckpt = tmp_path / "out" / "checkpoint-3"
    assert (ckpt / AMP_STATE_NAME).is_file()
    saved = torch.load(ckpt / AMP_STATE_NAME, weights_only=True)
    assert saved["loss_scaler0"]["loss_scale"] == 32768.0  # backed off at step 1, grown back... not yet

    resumed = _trainer(OrderedAmpTrainer, tmp_path, opt_cls=opt_cls, args=args, amp_options=amp_options)
    resumed.poison_steps = (1,)
    resumed.train(resume_from_checkpoint=str(ckpt))
    _assert_same(_params(straight.model), _params(resumed.model))
    state = amp.state_dict(optimizer=resumed.optimizer)
    assert state == final_state
    _assert_same(list(amp.master_params(straight.optimizer)), list(amp.master_params(resumed.optimizer)))
    assert torch.isfinite(torch.tensor(resumed.evaluate(MaskedLMData(16))["eval_loss"]))  # the O2 model evaluates


def test_amp_trainer_refuses_torch_mixed_precision_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="scaled twice"):
        _trainer(AmpTrainer, tmp_path, args=_args(tmp_path, bf16=True))


# ------------------------------------------------------------------------------------------------ the traps
def test_stock_trainer_with_o1_warns_no_loss_scaling(tmp_path) -> None:
    trainer = _trainer(OrderedTrainer, tmp_path, args=_args(tmp_path, max_steps=2))
    amp.initialize(trainer.model, trainer.optimizer, opt_level="O1", verbosity=0)
    with pytest.warns(RuntimeWarning, match=r"not loss-scaled.*AmpTrainer"):
        trainer.train()


def test_stock_trainer_with_o2_warns_it_trains_nothing(tmp_path) -> None:
    trainer = _trainer(OrderedTrainer, tmp_path, args=_args(tmp_path, max_steps=2))
    amp.initialize(trainer.model, trainer.optimizer, opt_level="O2", verbosity=0)
    before = _params(trainer.model)
    with pytest.warns(RuntimeWarning, match=r"changes no weight.*AmpTrainer"):
        trainer.train()
    _assert_same(before, _params(trainer.model))


class ScaleLossOverride(OrderedTrainer):
    """What docs used to suggest: ``amp.scale_loss`` in a ``training_step`` override, the Trainer's clipping kept."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, inputs) / ACCUM
        with amp.scale_loss(loss, self.optimizer, delay_unscale=not self.accelerator.sync_gradients) as scaled:
            scaled.backward()
        return loss.detach()


def test_scale_loss_override_with_the_trainers_clipping_warns(tmp_path) -> None:
    trainer = _trainer(ScaleLossOverride, tmp_path, args=_args(tmp_path, max_steps=2))
    amp.initialize(trainer.model, trainer.optimizer, opt_level="O2", verbosity=0)
    with pytest.warns(RuntimeWarning, match=r"clips the scaled gradients.*AmpTrainer"):
        trainer.train()
    assert _norms(trainer)[0] > 1000.0  # the scaled norm the stock Trainer logs
