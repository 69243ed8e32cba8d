"""Hugging Face gradient checkpointing under fp16kit's autocast: a tiny BertForMaskedLM (built locally, CPU, no
network) with ``gradient_checkpointing_enable()`` on every encoder layer gives the losses and gradients of the same
model without checkpointing, bit for bit: under ``amp.autocast`` (both engines, fp16 and bf16, fp32 and bf16
parameters, either ``use_reentrant``), ``AmpTrainer`` O1/O2, the stock ``Trainer`` and a hand-written
``amp.autocast`` + ``amp.GradScaler`` loop (docs/trainer.md, "Gradient checkpointing").

BERT's eager attention runs ``softmax`` and its layers ``layer_norm``, rows where fp16kit's table differs from
torch's CPU lists: before the recomputation re-entered fp16kit's region, ``use_reentrant=False`` raised torch's
``CheckpointError`` and ``use_reentrant=True`` gave other gradients (bf16 parameters: a dtype error).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from hf_helpers import BATCH, MaskedLMData, batches, tiny_bert
from transformers import Trainer, TrainingArguments

from fp16kit import amp
from fp16kit.amp import autocast_mode
from fp16kit.integrations.transformers import AmpTrainer

STEPS = 2


def _bert(pdtype: torch.dtype, checkpointing: bool | None):
    model = tiny_bert().to(pdtype).train()
    model.config._attn_implementation = "eager"  # softmax in Python: a row where fp16kit differs from torch's CPU list
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    return model


def _grads(pdtype: torch.dtype, low: torch.dtype, checkpointing: bool | None) -> dict[str, Any]:
    """Loss, gradients by name, and every encoder layer's output as computed (forward, then recomputation)."""
    model = _bert(pdtype, checkpointing)
    outputs: list[torch.Tensor] = []
    for layer in model.bert.encoder.layer:
        layer.output.register_forward_hook(lambda m, i, o: outputs.append(o.detach().clone()))
    batch = batches(MaskedLMData(n=4), 4)[0]
    with amp.autocast(dtype=low):
        loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "outputs": outputs, "layers": len(model.bert.encoder.layer)}


def _assert_same(ref: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(ref) == len(got), what
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), (what, i)


def _check(engine: str, combos) -> None:
    """Non-reentrant: loss and every gradient bit for bit. Reentrant: the recomputation reproduces every layer's
    forward output bit for bit and the loss and the last layer's gradients are bit for bit; the gradients below the
    first checkpoint boundary are summed in another order by torch's reentrant backward (the checkpointed layer's
    input gradient is accumulated on a detached leaf), which moves them by rounding under ``torch.autocast`` alone
    too (``test_reentrant_reorders_the_sum_under_torch_autocast_too``)."""
    with autocast_mode.use_engine(engine):
        for pdtype, low in combos:
            ref = _grads(pdtype, low, None)
            assert all(t.isfinite().all() for t in ref["grads"].values())
            for reentrant in (False, True):
                what = f"{engine} {pdtype} {low} reentrant={reentrant}"
                got = _grads(pdtype, low, reentrant)
                n = got["layers"]
                _assert_same([ref["loss"], *ref["outputs"]], [got["loss"], *got["outputs"][:n]], what)
                if reentrant:  # (non-reentrant recomputation stops early, inside the layer, before its hooks)
                    _assert_same(got["outputs"][:n], got["outputs"][n:][::-1], what + " recomputed")
                names = list(ref["grads"]) if not reentrant else [k for k in ref["grads"] if f"layer.{n - 1}." in k]
                _assert_same([ref["grads"][k] for k in names], [got["grads"][k] for k in names], what)


def test_reentrant_reorders_the_sum_under_torch_autocast_too():
    """Why the reentrant check above compares the gradients of the last layer only: torch's reentrant checkpoint
    changes the lower gradients' rounding with ``torch.autocast`` and no fp16kit region at all."""

    def grads(checkpointing):
        model = _bert(torch.float32, checkpointing)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batches(MaskedLMData(n=4), 4)[0]).loss.backward()
        return [p.grad for p in model.parameters()]

    ref, got = grads(None), grads(True)
    assert not all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_bert_gradient_checkpointing_equals_no_checkpointing():
    _check("dispatch", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
    _check("mode", [(torch.bfloat16, torch.float16)])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["dispatch", "mode"])
def test_bert_gradient_checkpointing_every_combination(engine):
    _check(engine, [(p, d) for p in (torch.float32, torch.bfloat16) for d in (torch.float16, torch.bfloat16)])


# ------------------------------------------------------------------------------------------------ trainers
class _InOrder:
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


class OrderedTrainer(_InOrder, Trainer):
    pass


class OrderedAmpTrainer(_InOrder, AmpTrainer):
    pass


def _train(cls, tmp_path, checkpointing: bool, **kw) -> tuple[list[float], list[torch.Tensor]]:
    extra = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}} \
        if checkpointing else {}
    args = TrainingArguments(output_dir=str(tmp_path / f"out{checkpointing}"), per_device_train_batch_size=BATCH,
                             max_steps=STEPS, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, learning_rate=1e-3, max_grad_norm=1.0, seed=0,
                             **extra, **kw.pop("args", {}))
    model = tiny_bert()
    model.config._attn_implementation = "eager"
    trainer = cls(model=model, args=args, train_dataset=MaskedLMData(n=2 * BATCH),
                  optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-3), None), **kw)
    trainer.model_accepts_loss_kwargs = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.train()
    assert trainer.model.is_gradient_checkpointing == checkpointing
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    return losses, [p.detach().clone() for p in trainer.model.parameters()]


def _assert_same_training(ref, got, what: str) -> None:
    assert ref[0] == got[0], what  # logged losses
    _assert_same(ref[1], got[1], what)  # parameters after the steps


@pytest.mark.parametrize("opt_level", ["O1", pytest.param("O2", marks=pytest.mark.slow)])
def test_amp_trainer_with_gradient_checkpointing_trains_as_without(tmp_path, opt_level):
    kw = {"opt_level": opt_level, "amp_options": {"verbosity": 0}}
    ref = _train(OrderedAmpTrainer, tmp_path, False, **kw)
    _assert_same_training(ref, _train(OrderedAmpTrainer, tmp_path, True, **kw), opt_level)


@pytest.mark.slow
def test_stock_trainer_bf16_with_gradient_checkpointing_trains_as_without(tmp_path):
    """The stock Trainer (torch.autocast through accelerate) in a process where fp16kit's hooks are installed."""
    with amp.autocast():  # installs fp16kit's hooks on torch.utils.checkpoint and torch.autocast
        pass
    ref = _train(OrderedTrainer, tmp_path, False, args={"bf16": True})
    _assert_same_training(ref, _train(OrderedTrainer, tmp_path, True, args={"bf16": True}), "Trainer bf16")


def _scaler_loop(checkpointing: bool, low: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    model = _bert(torch.float32, False if checkpointing else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = amp.GradScaler()
    losses = []
    for batch in batches(MaskedLMData(n=2 * BATCH), BATCH)[:STEPS]:
        with amp.autocast(dtype=low):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_autocast_and_grad_scaler_loop_with_checkpointing_trains_as_without():
    ref = _scaler_loop(False, torch.float16)
    got = _scaler_loop(True, torch.float16)
    assert all(loss.isfinite() for loss in ref[0])
    _assert_same(ref[0], got[0], "losses")
    _assert_same(ref[1], got[1], "parameters")
