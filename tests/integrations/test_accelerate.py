"""HF ``accelerate`` with fp16kit on a tiny BertForMaskedLM (CPU, no network).

* ``Accelerator(mixed_precision="bf16" / "fp16")`` + ``FusedLAMB``: the same bits as the autocast (+ GradScaler) loop
  written by hand;
* apex-style amp on ``accelerator.prepare``'d objects with ``fp16kit.integrations.accelerate``: the same bits as the
  plain apex loop, ``save_state``/``load_state`` resume bit for bit, and the traps (plain ``accelerator.backward``,
  amp on top of accelerate's mixed precision) warn or raise.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradientAccumulationPlugin
from hf_helpers import ACCUM, BATCH, CLIP, STEPS, MaskedLMData, autocast_reference, batches, tiny_bert

from fp16kit import amp
from fp16kit.integrations import accelerate as amp_accelerate
from fp16kit.optim import FusedLAMB


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(MaskedLMData(), batch_size=BATCH, shuffle=False)


def _accelerator(**kw) -> Accelerator:
    plugin = GradientAccumulationPlugin(num_steps=ACCUM, sync_with_dataloader=False)
    return Accelerator(cpu=True, gradient_accumulation_plugin=plugin, **kw)


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a, b) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_norms(a: list[float], b: list[float]) -> bool:
    """Equal, NaN included (an overflowed step's norm)."""
    return len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b))


def _run_accelerate(accelerator, model, opt, steps: int, backward, clip, start: int = 0) -> list[float]:
    """``steps`` optimizer steps of the documented accelerate loop, from micro-batch ``start * ACCUM``."""
    norms = []
    data = batches(MaskedLMData(), BATCH)
    model.train()
    for i in range(start * ACCUM, (start + steps) * ACCUM):
        with accelerator.accumulate(model):
            loss = model(**data[i % len(data)]).loss
            backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(clip()))
            opt.step()
            opt.zero_grad()
    return norms


# ------------------------------------------------------------------------------------------------ torch-style
@pytest.mark.parametrize("mixed", ["bf16", "fp16"])
def test_accelerator_mixed_precision_with_fused_lamb(mixed) -> None:
    accelerator = _accelerator(mixed_precision=mixed)
    scaler = None
    if mixed == "fp16":  # accelerate's GPU route (autocast fp16 + GradScaler), forced onto the CPU
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    model = tiny_bert()
    model, opt = accelerator.prepare(model, FusedLAMB(model.parameters(), lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        norms = _run_accelerate(accelerator, model, opt, STEPS, accelerator.backward,
                                lambda: accelerator.clip_grad_norm_(model.parameters(), CLIP))
    ref_model, ref_norms = autocast_reference(torch.bfloat16 if mixed == "bf16" else torch.float16, scaler)
    _assert_same(_params(model), _params(ref_model))
    assert norms == ref_norms


# ------------------------------------------------------------------------------------------------ apex-style
def _apex_reference(opt_level: str, steps: int = STEPS) -> tuple[list[torch.Tensor], list[float], dict]:
    model = tiny_bert()
    model, opt = amp.initialize(model, FusedLAMB(model.parameters(), lr=1e-3), opt_level=opt_level, verbosity=0,
                                scale_window=3)
    data = batches(MaskedLMData(), BATCH)
    norms = []
    model.train()
    for s in range(steps):
        for k in range(ACCUM):
            loss = model(**data[(s * ACCUM + k) % len(data)]).loss / ACCUM
            with amp.scale_loss(loss, opt, delay_unscale=k < ACCUM - 1) as scaled:
                scaled.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(amp.master_params(opt), CLIP)))
        opt.step()
        opt.zero_grad()
    return _params(model), norms, amp.state_dict(optimizer=opt)


def _apex_accelerate(opt_level: str):
    accelerator = _accelerator()
    model = tiny_bert()
    model, opt = amp.initialize(model, FusedLAMB(model.parameters(), lr=1e-3), opt_level=opt_level, verbosity=0,
                                scale_window=3)
    model, opt = accelerator.prepare(model, opt)
    accelerator.register_for_checkpointing(amp_accelerate.AmpState(opt))
    return accelerator, model, opt


def _amp_steps(accelerator, model, opt, steps: int, start: int = 0) -> list[float]:
    return _run_accelerate(accelerator, model, opt, steps,
                           lambda loss: amp_accelerate.backward(accelerator, loss, opt),
                           lambda: amp_accelerate.clip_grad_norm_(opt, CLIP), start=start)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_style_amp_on_prepared_objects_is_the_apex_loop(opt_level) -> None:
    accelerator, model, opt = _apex_accelerate(opt_level)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        norms = _amp_steps(accelerator, model, opt, STEPS)
    ref_params, ref_norms, ref_state = _apex_reference(opt_level)
    _assert_same(_params(model), ref_params)
    assert _same_norms(norms, ref_norms)
    assert amp.state_dict(optimizer=opt) == ref_state


def test_save_state_load_state_resume_bit_for_bit(tmp_path) -> None:
    accelerator, model, opt = _apex_accelerate("O2")
    _amp_steps(accelerator, model, opt, 2)
    accelerator.save_state(str(tmp_path / "ckpt"))
    _amp_steps(accelerator, model, opt, 3, start=2)
    straight, straight_state = _params(model), amp.state_dict(optimizer=opt)

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator, model, opt = _apex_accelerate("O2")
    accelerator.load_state(str(tmp_path / "ckpt"))
    _amp_steps(accelerator, model, opt, 3, start=2)
    _assert_same(_params(model), straight)
    assert amp.state_dict(optimizer=opt) == straight_state
    # after the checkpoint (growth tracker 2): growth at the 3rd clean step, then an overflow backs off and is skipped;
    # only a restored tracker gives the same
    assert straight_state["loss_scaler0"]["loss_scale"] == 65536.0
    assert straight_state["loss_scaler0"]["fp16kit"]["steps_skipped"] == 1


def test_plain_accelerator_backward_under_o1_warns() -> None:
    accelerator, model, opt = _apex_accelerate("O1")
    with pytest.warns(RuntimeWarning, match=r"not loss-scaled.*fp16kit\.integrations\.accelerate"):
        _run_accelerate(accelerator, model, opt, 1, accelerator.backward,
                        lambda: accelerator.clip_grad_norm_(model.parameters(), CLIP))


def test_amp_on_top_of_accelerate_mixed_precision_is_refused() -> None:
    accelerator = _accelerator(mixed_precision="bf16")
    model = tiny_bert()
    model, opt = amp.initialize(model, FusedLAMB(model.parameters(), lr=1e-3), opt_level="O2", verbosity=0)
    model, opt = accelerator.prepare(model, opt)
    loss = torch.ones((), requires_grad=True)  # refused before any backward runs
    with pytest.raises(ValueError, match="scaled twice"):
        amp_accelerate.backward(accelerator, loss, opt)
