"""apex's ``LossScaler`` internals that real scripts touch: ``_overflow_buf``, ``update_scale()``, ``_has_overflow``.

NVIDIA DeepLearningExamples' BERT ``run_pretraining.py`` (``--allreduce_post_accumulation``) runs ``scale_loss`` with
``delay_overflow_check=True``, rescales the master grads into a flat buffer with ``amp_C.multi_tensor_scale``,
all-reduces it, scales back while checking into its own ``overflow_buf``, swaps that buffer into
``_amp_state.loss_scalers[0]`` and calls ``update_scale()`` to decide the step. These tests run that pattern (and
its pieces) against fp16kit's own ``scale_loss`` loop: the same bits.
"""

from __future__ import annotations

import pytest
import torch
from apex_models import batches, classifier
from torch import nn
from torch._utils import _unflatten_dense_tensors

from fp16kit import amp, amp_C
from fp16kit.amp import _amp_state
from fp16kit.multi_tensor_apply import multi_tensor_applier
from fp16kit.optim import FusedLAMB


def _model() -> nn.Module:
    return classifier(nn.LayerNorm)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(n, size=5, seed=1)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, poison: bool) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x).float(), y)
    return loss * float("inf") if poison else loss


def _setup(opt_cls: type) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = opt_cls(model.parameters(), lr=1e-2) if opt_cls is FusedLAMB else opt_cls(model.parameters(), lr=0.05)
    return amp.initialize(model, opt, opt_level="O2", verbosity=0)


POISON = {2, 5}  # micro-batches whose loss is inf: an overflowed, skipped step


def _reference(opt_cls: type, steps: int, accum: int) -> tuple[list[torch.Tensor], dict]:
    """fp16kit's own loop: ``scale_loss`` decides the skip."""
    model, opt = _setup(opt_cls)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**12
    data = _batches(steps * accum)
    for s in range(steps):
        for k in range(accum):
            x, y = data[s * accum + k]
            with amp.scale_loss(_loss(model, x, y, s * accum + k in POISON) / accum, opt,
                                delay_unscale=k < accum - 1) as scaled:
                scaled.backward()
        opt.step()
        for p in model.parameters():
            p.grad = None
    return [p.detach().clone() for p in model.parameters()], amp.state_dict()


def _dle(opt_cls: type, steps: int, accum: int) -> tuple[list[torch.Tensor], dict, int]:
    """The DeepLearningExamples pattern: delay_overflow_check, manual rescale round trip, update_scale()."""
    model, opt = _setup(opt_cls)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**12
    data = _batches(steps * accum)
    overflow_buf = torch.zeros(1, dtype=torch.int32)
    skipped = 0
    for s in range(steps):
        for k in range(accum):
            x, y = data[s * accum + k]
            with amp.scale_loss(_loss(model, x, y, s * accum + k in POISON), opt, delay_unscale=k < accum - 1,
                                delay_overflow_check=True) as scaled:
                scaled.backward()
        loss_scale = _amp_state.loss_scalers[0].loss_scale()
        master_grads = [p.grad for p in amp.master_params(opt) if p.grad is not None]
        flat_raw = torch.empty(sum(g.numel() for g in master_grads), dtype=torch.float32)
        views = _unflatten_dense_tensors(flat_raw, master_grads)
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [master_grads, views], loss_scale / accum)
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [list(views), master_grads], 1.0 / loss_scale)
        scaler = _amp_state.loss_scalers[0]
        old = scaler._overflow_buf
        scaler._overflow_buf = overflow_buf
        had_overflow = scaler.update_scale()
        scaler._overflow_buf = old
        if had_overflow == 0:
            opt.step()
        else:
            skipped += 1
            for m in opt._amp_stash.all_fp32_from_fp16_params:
                m.grad = None
        for p in model.parameters():
            p.grad = None
    return [p.detach().clone() for p in model.parameters()], amp.state_dict(), skipped


@pytest.mark.parametrize("opt_cls", [FusedLAMB, torch.optim.SGD], ids=["FusedLAMB", "SGD"])
def test_dle_allreduce_post_accumulation_pattern_matches_scale_loss(opt_cls) -> None:
    ref_params, ref_state = _reference(opt_cls, steps=4, accum=2)
    params, state, skipped = _dle(opt_cls, steps=4, accum=2)
    assert skipped == 2  # micro-batches 2 and 5: steps 1 and 2
    for a, b in zip(ref_params, params):
        assert torch.equal(a, b)
    assert state["loss_scaler0"]["loss_scale"] == ref_state["loss_scaler0"]["loss_scale"] == 2.0**10
    assert state["loss_scaler0"]["unskipped"] == ref_state["loss_scaler0"]["unskipped"]
    assert state["loss_scaler0"]["fp16kit"]["steps_skipped"] == 2


def test_overflow_buf_follows_each_unscaling_exit_and_update_scale_decides() -> None:
    model, opt = _setup(FusedLAMB)
    view = _amp_state.loss_scalers[0]
    assert view is _amp_state.loss_scalers[0]  # one object: state kept on it persists
    assert view._overflow_buf.dtype == torch.int32 and int(view._overflow_buf) == 0
    x, y = _batches(1)[0]
    with amp.scale_loss(_loss(model, x, y, True), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    assert int(view._overflow_buf) == 1 and view._has_overflow is False
    assert view.loss_scale() == 65536.0  # delay_overflow_check: no update yet
    assert view.update_scale() is True and view._has_overflow is True
    assert view.loss_scale() == 32768.0 and view._unskipped == 0
    for p in model.parameters():
        p.grad = None
    with amp.scale_loss(_loss(model, x, y, False), opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    assert int(view._overflow_buf) == 0 and view._has_overflow is False  # the exit cleared the verdict
    assert view.update_scale() is False and view._unskipped == 1 and view.loss_scale() == 32768.0
    view.clear_overflow_state()
    assert int(view._overflow_buf) == 0
    assert (view._scale_seq_len, view._min_loss_scale, view._max_loss_scale) == (2000, None, 2.0**24)


def test_update_scale_grows_after_scale_window_and_respects_the_floor() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, scale_window=2, min_loss_scale=16384.0)
    view = _amp_state.loss_scalers[0]
    view._overflow_buf.zero_()
    assert [view.update_scale(), view.update_scale()] == [False, False]
    assert view.loss_scale() == 131072.0
    for expected in (65536.0, 32768.0, 16384.0, 16384.0):
        view._overflow_buf.fill_(1)
        view._has_overflow = False
        assert view.update_scale() is True
        assert view.loss_scale() == expected


def test_static_scale_never_skips() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    view = _amp_state.loss_scalers[0]
    view._overflow_buf.fill_(1)
    assert view.update_scale() is False and view.loss_scale() == 128.0 and not view.dynamic


def test_view_unscale_is_apex_lossscaler_unscale() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    view = _amp_state.loss_scalers[0]
    src = [torch.full((3,), 32768.0), torch.tensor([1.0, float("inf")], dtype=torch.float16)]
    dst = [torch.empty(3), torch.empty(2)]
    view._loss_scale = 32768.0
    view.clear_overflow_state()
    view.unscale(src, dst, None)
    assert torch.equal(dst[0], torch.ones(3)) and int(view._overflow_buf) == 1


def test_loss_scale_beyond_the_cap_is_clamped_with_a_warning() -> None:
    _setup(torch.optim.SGD)
    view = _amp_state.loss_scalers[0]
    with pytest.warns(RuntimeWarning, match=r"outside \[min_loss_scale, max_loss_scale\].*using 1.67772e\+07"):
        view._loss_scale = 2.0**32  # some scripts' init_loss_scale; apex's first growth clamped it to the cap
    assert view.loss_scale() == 2.0**24
