"""LossScaler.update's CPU fast path (``_clean_cpu_update``) against the general path, bitwise.

With torch's options (hysteresis 1, no floor, no cap) a clean step on the CPU runs torch's update op alone; every
other step (an overflow, a NaN flag, the extras, a static scale) takes the general path. The reference here is the
general path itself, forced by making the fast path's flag read return NaN (the condition ``flag == 0`` then fails).
"""

from __future__ import annotations

import math
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fp16kit.amp import GradScaler, loss_scaler
from fp16kit.amp.loss_scaler import SCALE_FLOOR, LossScaler
from fp16kit.kernels import merge_found_inf

_FP32_MAX = torch.finfo(torch.float32).max

# flag values: clean, torch's overflow value, NaN (counts as overflow), inf, a sum of two flags, a negative value
_FLAG_VALUES = st.sampled_from([0.0, 0.0, 0.0, 1.0, math.nan, math.inf, 2.0, -1.0])
_FLAG_DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64])
# one step: the flags of several optimizers/devices, merged as GradScaler.update merges them
_STEP = st.lists(st.tuples(_FLAG_VALUES, _FLAG_DTYPES), min_size=1, max_size=3)
_SCALES = st.one_of(
    st.sampled_from([2.0**16, 1.0, SCALE_FLOOR, 2.0**-125, _FP32_MAX, 2.0**127, 3.0e38]),
    st.floats(min_value=SCALE_FLOOR, max_value=_FP32_MAX, allow_nan=False, allow_infinity=False),
)


def _flag(step: list[tuple[float, torch.dtype]]) -> torch.Tensor:
    flags = [torch.full((1,), v, dtype=dt) for v, dt in step]
    return flags[0] if len(flags) == 1 else merge_found_inf(flags, torch.device("cpu"))


def _state(s: LossScaler) -> tuple:
    return (
        s.scale.view(torch.int32).item(),  # the bits: -0/+0 or NaN payloads would differ too
        s.growth_tracker.item(),
        tuple(s._skips.tolist()),
        s._updates_in_window,
        s._pending is None,
    )


def _general_update(s: LossScaler, flag: torch.Tensor) -> None:
    with mock.patch.object(loss_scaler, "_cpu_scalar", lambda t: math.nan):
        s.update(flag)


@settings(max_examples=60, deadline=None)
@given(
    init_scale=_SCALES,
    growth_factor=st.sampled_from([2.0, 1.5, 3.0, 1.0000001, 65536.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9, 1e-30]),
    growth_interval=st.integers(1, 4),
    growth_tracker=st.integers(0, 3),
    warn_after_skips=st.sampled_from([None, 2, 3]),
    steps=st.lists(_STEP, min_size=1, max_size=25),
)
def test_fast_update_is_bitwise_the_general_path(
    init_scale, growth_factor, backoff_factor, growth_interval, growth_tracker, warn_after_skips, steps
):
    """Growth, backoff, interval counting, merged flags, NaN/inf/negative flags, scales at fp32 max (growth would
    overflow: kept) and at the 2**-126 floor: the fast scaler's state equals the general path's after every step,
    and both warn alike."""
    kwargs = dict(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        max_scale=None,
        strict_bounds=False,
        warn_after_skips=warn_after_skips,
        device="cpu",
    )
    fast, ref = LossScaler(**kwargs), LossScaler(**kwargs)
    for s in (fast, ref):
        s.growth_tracker.fill_(min(growth_tracker, growth_interval - 1))
    for step in steps:
        flag = _flag(step)
        with warnings.catch_warnings(record=True) as w_fast:
            warnings.simplefilter("always")
            fast.update(flag.clone())
        with warnings.catch_warnings(record=True) as w_ref:
            warnings.simplefilter("always")
            _general_update(ref, flag.clone())
        assert _state(fast) == _state(ref), step
        assert [str(w.message) for w in w_fast] == [str(w.message) for w in w_ref]
        assert SCALE_FLOOR <= fast.scale.item() <= _FP32_MAX  # never NaN, inf or 0


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in ("view", "_local_scalar_dense"):  # views and host reads of CPU scalars are not device ops
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_clean_cpu_step_runs_torch_update_op_only():
    """The point of the fast path: a clean CPU step with torch's options is torch's one update op (the general
    path ran five: ne, addcmul, maximum, the update op, the floor clamp)."""
    s = LossScaler(max_scale=None, strict_bounds=False, device="cpu", warn_after_skips=None)
    flag = torch.zeros(1)
    with _OpLog() as log:
        s.update(flag)
    assert log.ops == ["_amp_update_scale_"]
    s.update(torch.ones(1))  # an overflow: the general path (streak 1), then a clean step zeroes the streak
    with _OpLog() as log:
        s.update(flag)
    assert log.ops == ["zero_", "_amp_update_scale_"]
    assert s.consecutive_skips.item() == 0


@pytest.mark.parametrize(
    "options",
    [dict(hysteresis=2), dict(min_scale=1.0), dict(max_scale=2.0**20), dict(dynamic=False)],
    ids=["hysteresis", "floor", "cap", "static"],
)
def test_extras_keep_the_general_path(options):
    """fp16kit's extras (and a static scale) are not torch's update op alone: they never take the fast path."""
    s = LossScaler(**{"max_scale": None, "strict_bounds": False, "device": "cpu", **options})
    with mock.patch.object(LossScaler, "_clean_cpu_update", side_effect=AssertionError("fast path")):
        for v in (0.0, 1.0, 0.0, 0.0):
            s.update(torch.tensor([v]))


def test_grad_scaler_trajectory_equals_torch_through_the_fast_path():
    """End to end: fp16kit's GradScaler (whose clean CPU updates now take the fast path) and torch's, fed the same
    overflow pattern through real gradients, keep bitwise-equal scales and growth trackers."""
    w_ours, w_torch = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    ours, ref = (
        GradScaler("cpu", init_scale=2.0**120, growth_interval=2),
        torch.amp.GradScaler("cpu", 2.0**120, 2.0, 0.5, 2),
    )
    opt_ours, opt_torch = torch.optim.SGD([w_ours], lr=0.0), torch.optim.SGD([w_torch], lr=0.0)
    pattern = [0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # grows past fp32 max: kept finite
    for bad in pattern:
        for w, scaler, opt in ((w_ours, ours, opt_ours), (w_torch, ref, opt_torch)):
            scaler.scale(torch.ones(()))
            w.grad = torch.full((3,), math.inf if bad else 1.0)
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == ref.get_scale()
        assert ours._get_growth_tracker() == ref._get_growth_tracker()


@pytest.mark.parametrize(
    "options",
    [dict(), dict(hysteresis=2), dict(min_scale=1.0), dict(max_scale=2.0**20), dict(dynamic=False)],
    ids=["torch", "hysteresis", "floor", "cap", "static"],
)
def test_update_clean_is_update_with_a_zero_flag(options):
    """``update_clean`` (GradScaler's path when step() already read every flag as 0) leaves the state that
    ``update(zero flag)`` leaves, after any history, with every option set."""
    kwargs = {"max_scale": None, "strict_bounds": False, "device": "cpu", "growth_interval": 2, **options}
    clean, ref = LossScaler(**kwargs), LossScaler(**kwargs)
    for v in (0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0):
        if v:
            clean.update(torch.ones(1))
        else:
            clean.update_clean()
        ref.update(torch.tensor([v]))
        assert _state(clean) == _state(ref), v


def test_grad_scaler_update_skips_flags_step_read_as_clean():
    """After a plain optimizer's step read its flag as 0 there is nothing left to read: update takes
    ``update_clean``; after a skipped step (or a fused optimizer, whose flag is never read on the host) it does not."""
    w = torch.nn.Parameter(torch.ones(3))
    scaler, opt = GradScaler("cpu"), torch.optim.SGD([w], lr=0.0)
    for bad, expect in ((0.0, 1), (math.inf, 0), (0.0, 1)):
        scaler.scale(torch.ones(()))
        w.grad = torch.full((3,), bad or 1.0)
        scaler.step(opt)
        with mock.patch.object(LossScaler, "update_clean", autospec=True, side_effect=LossScaler.update_clean) as m:
            scaler.update()
        assert m.call_count == expect, bad
