"""LossScaler: the spec's state machine step by step, the skip warning, checkpoints, no host sync.

The reference below is written from loss-scaler.md alone (plain Python, fp32 rounding via numpy),
independently of the implementation, which reuses torch's ``_amp_update_scale_`` op.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from _host_reads import count_host_reads
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.amp import LossScaler

FLT_MAX = float(np.finfo(np.float32).max)


class SpecScaler:
    """loss-scaler.md's state machine, in Python floats rounded to fp32 where the scaler stores fp32."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale):
        self.scale = float(np.float32(init_scale))
        self.gf, self.bf, self.interval, self.h = growth_factor, backoff_factor, growth_interval, hysteresis
        self.min, self.max = min_scale, max_scale
        self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

    def update(self, inf: bool) -> None:
        if inf:
            self.growth_tracker = 0
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
            if self.hysteresis_tracker == 0:
                new = float(np.float32(self.scale * self.bf))
                self.scale = new if self.min is None else max(new, float(np.float32(self.min)))
        else:
            self.growth_tracker += 1
            self.hysteresis_tracker = self.h
            if self.growth_tracker == self.interval:
                self.growth_tracker = 0
                with np.errstate(over="ignore"):
                    grown = float(np.float32(self.scale * self.gf))
                if math.isfinite(grown):
                    self.scale = grown if self.max is None else min(grown, float(np.float32(self.max)))


def flag(inf: bool | float) -> torch.Tensor:
    return torch.tensor([float(inf)])


def trajectory(scaler: LossScaler, infs) -> list[tuple[float, int, int]]:
    out = []
    for inf in infs:
        scaler.update(flag(inf))
        out.append((scaler.scale.item(), int(scaler.growth_tracker.item()), int(scaler.hysteresis_tracker.item())))
    return out


def spec_trajectory(spec: SpecScaler, infs) -> list[tuple[float, int, int]]:
    out = []
    for inf in infs:
        spec.update(bool(inf))
        out.append((spec.scale, spec.growth_tracker, spec.hysteresis_tracker))
    return out


# ----------------------------------------------------------------------------- exact sequences
def test_growth_and_backoff_sequence_by_hand():
    s = LossScaler(init_scale=8.0, growth_interval=2, warn_after_skips=None)
    got = [x[0] for x in trajectory(s, [0, 0, 0, 0, 1, 0, 1, 1, 0, 0])]
    assert got == [8.0, 16.0, 16.0, 32.0, 16.0, 16.0, 8.0, 4.0, 4.0, 8.0]


def test_hysteresis_sequence_by_hand():
    # hysteresis=3: two overflows in a row are tolerated (no backoff, step skipped, growth reset);
    # the third backs off, and every further one in the same streak backs off again.
    s = LossScaler(init_scale=64.0, growth_interval=3, hysteresis=3, warn_after_skips=None)
    got = trajectory(s, [1, 1, 1, 1, 0, 1, 0, 0, 0])
    assert got == [
        (64.0, 0, 2),
        (64.0, 0, 1),
        (32.0, 0, 0),
        (16.0, 0, 0),
        (16.0, 1, 3),  # a clean step resets the hysteresis
        (16.0, 0, 2),  # tolerated again, growth tracker reset
        (16.0, 1, 3),
        (16.0, 2, 3),
        (32.0, 0, 3),
    ]


def test_tolerated_overflow_never_grows_even_with_interval_one():
    s = LossScaler(init_scale=4.0, growth_interval=1, hysteresis=2, warn_after_skips=None)
    assert trajectory(s, [0, 1, 0, 1, 1]) == [(8.0, 0, 2), (8.0, 0, 1), (16.0, 0, 2), (16.0, 0, 1), (8.0, 0, 0)]


def test_min_scale_floor_and_max_scale_cap():
    s = LossScaler(init_scale=4.0, growth_interval=1, min_scale=1.5, max_scale=20.0, warn_after_skips=None)
    scales = [x[0] for x in trajectory(s, [1, 1, 1, 1, 0, 0, 0, 0, 0])]
    # 4 -> 2 -> max(1, 1.5) = 1.5 stays; 1.5 -> 3 -> 6 -> 12 -> min(24, 20) = 20 stays
    assert scales == [2.0, 1.5, 1.5, 1.5, 3.0, 6.0, 12.0, 20.0, 20.0]


def test_never_grows_to_inf_without_cap():
    s = LossScaler(init_scale=2.0**127, growth_interval=1, max_scale=None, warn_after_skips=None)
    scales = [x[0] for x in trajectory(s, [0, 0, 0])]
    assert scales == [2.0**127] * 3  # 2**128 overflows fp32: the scale stays finite
    s = LossScaler(init_scale=FLT_MAX / 1.5, growth_factor=1.5, growth_interval=1, max_scale=None)
    s.update(flag(0))
    assert math.isfinite(s.get_scale())


def test_static_scale_never_changes():
    s = LossScaler(init_scale=128.0, dynamic=False, growth_interval=1, warn_after_skips=None)
    assert [x[0] for x in trajectory(s, [1, 0, 0, 1, 1, 0])] == [128.0] * 6


def test_nan_flag_counts_as_overflow_and_sums_of_flags_work():
    s = LossScaler(init_scale=16.0, warn_after_skips=None)
    s.update(torch.tensor([float("nan")]))
    s.update(torch.tensor([2.0]))  # e.g. two per-optimizer flags added up
    assert s.get_scale() == 4.0


@settings(max_examples=40, deadline=None)
@given(
    infs=st.lists(st.booleans(), min_size=1, max_size=40),
    hysteresis=st.integers(1, 3),
    interval=st.integers(1, 4),
    factors=st.sampled_from([(2.0, 0.5), (1.7, 0.3), (3.0, 0.25), (1.001, 0.999)]),
    bounds=st.sampled_from([(None, None), (0.5, 1024.0), (None, 2.0**24), (0.75, None)]),
    init=st.sampled_from([1.0, 3.0, 1000.0 / 3.0]),
)
def test_matches_spec_reference(infs, hysteresis, interval, factors, bounds, init):
    gf, bf = factors
    lo, hi = bounds
    s = LossScaler(init, gf, bf, interval, hysteresis=hysteresis, min_scale=lo, max_scale=hi, warn_after_skips=None)
    ref = SpecScaler(init, gf, bf, interval, hysteresis, lo, hi)
    assert trajectory(s, infs) == spec_trajectory(ref, infs)


@settings(max_examples=25, deadline=None)
@given(infs=st.lists(st.booleans(), min_size=1, max_size=40), interval=st.integers(1, 4))
def test_bitwise_equal_to_torch_update_op(infs, interval):
    """hysteresis=1 and no bounds is torch's GradScaler.update, non-power-of-two factors included."""
    s = LossScaler(1000.0 / 3.0, 1.7, 0.3, interval, max_scale=None, warn_after_skips=None)
    scale, tracker = torch.full((), 1000.0 / 3.0), torch.zeros((), dtype=torch.int32)
    for inf in infs:
        s.update(flag(inf))
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(inf)), 1.7, 0.3, interval)
        assert s.scale.view(()).view(torch.int32).item() == scale.view(torch.int32).item()
        assert s.growth_tracker.item() == tracker.item()


def test_inv_scale_is_the_fp64_reciprocal_rounded_once_and_follows_the_scale():
    s = LossScaler(init_scale=3.0, warn_after_skips=None)
    inv = s.inv_scale()
    assert inv.dtype == torch.float32 and inv.shape == (1,)
    assert inv.item() == float(np.float32(1.0 / np.float64(np.float32(3.0))))
    assert s.inv_scale() is inv  # cached while the scale is unchanged
    s.update(flag(1))
    assert s.inv_scale().item() == float(np.float32(1.0 / 1.5))
    f = s.new_found_inf()
    assert f.dtype == torch.float32 and f.shape == (1,) and f.item() == 0.0


def test_set_scale_checks_and_clamps():
    s = LossScaler(init_scale=4.0, min_scale=1.0, max_scale=64.0)
    s.set_scale(8.0)
    assert s.get_scale() == 8.0
    with pytest.raises(ValueError, match=r"scale=100.0 lies outside \[min_scale, max_scale\]"):
        s.set_scale(100.0)
    s.set_scale(torch.tensor(1000.0))  # a tensor cannot be checked without a sync: clamped on the device
    assert s.get_scale() == 64.0


# ----------------------------------------------------------------------------- bad configuration
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1.0"),
        ({"backoff_factor": 1.0}, "backoff_factor must be < 1.0"),
        ({"backoff_factor": 0.0}, "backoff_factor must be a positive finite number"),
        ({"init_scale": float("inf")}, "init_scale must be a positive finite number"),
        ({"growth_interval": 0}, "growth_interval must be an integer >= 1"),
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1"),
        ({"min_scale": 10.0, "max_scale": 5.0}, "min_scale=10.0 is larger than max_scale=5.0"),
        ({"init_scale": 2.0**30}, r"init_scale=1073741824.0 lies outside \[min_scale, max_scale\]"),
        ({"max_scale": 1e39}, "exceeds the fp32 range"),
        ({"warn_after_skips": 0}, "warn_after_skips must be an integer >= 1"),
    ],
)
def test_bad_options_raise_with_the_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScaler(**kwargs)


def test_update_rejects_a_non_flag():
    s = LossScaler()
    with pytest.raises(TypeError, match="one-element float tensor"):
        s.update(torch.zeros(2))
    with pytest.raises(TypeError, match="one-element float tensor"):
        s.update(torch.zeros(1, dtype=torch.int32))


# ----------------------------------------------------------------------------- skip warning
def skip_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "in a row" in str(w.message)]


def run_flags(s: LossScaler, infs) -> list[int]:
    """Indices (0-based) of the updates after which a skip warning was raised."""
    when = []
    for i, inf in enumerate(infs):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            s.update(flag(inf))
        if skip_warnings(rec):
            when.append(i)
    return when


def test_nan_from_the_start_warns_after_k_steps_and_names_the_cause():
    s = LossScaler(warn_after_skips=5, min_scale=1.0)
    with pytest.warns(RuntimeWarning, match="5 optimizer steps in a row were skipped") as rec:
        for _ in range(5):
            s.update(flag(1))
    msg = skip_warnings(rec)[0]
    assert "now 2048" in msg and "check the loss" in msg and "min_scale floor (1.0)" in msg


def test_skip_warning_timing_streaks_and_repeats():
    k = 4
    # 3 skips (short), clean, then a streak of exactly 4 that straddles the check after update 8:
    # window_max catches it at the check after update 12 at the latest (on the CPU, at once at 8 or 12).
    infs = [1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0]
    assert run_flags(LossScaler(warn_after_skips=k), infs) == [11]
    # an ongoing streak is reported once, not at every check
    assert run_flags(LossScaler(warn_after_skips=k), [1] * 20) == [3]
    # a new streak after a clean step is reported again
    assert run_flags(LossScaler(warn_after_skips=k), [1] * 8 + [0] + [1] * 11) == [3, 15]
    # never K in a row: never a warning
    assert run_flags(LossScaler(warn_after_skips=k), [1, 1, 1, 0] * 6) == []
    assert run_flags(LossScaler(warn_after_skips=None), [1] * 20) == []


def test_skip_warning_is_also_checked_when_the_scale_is_read():
    s = LossScaler(warn_after_skips=10)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(8):
            s.update(flag(1))
        assert not skip_warnings(rec)
        s.update(flag(1))
        s.update(flag(1))  # update 10: periodic check
    assert len(skip_warnings(rec)) == 1
    s = LossScaler(warn_after_skips=3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        s.update(flag(0))
        for _ in range(3):
            s.update(flag(1))
        assert len(skip_warnings(rec)) == 0  # the streak straddles the check after update 3
        s.get_scale()  # a sync anyway: checks the partial window
    assert len(skip_warnings(rec)) == 1


def test_static_scale_warns_that_inf_steps_were_applied():
    s = LossScaler(init_scale=128.0, dynamic=False, warn_after_skips=3)
    with pytest.warns(RuntimeWarning, match="static loss scale 128 produced inf/NaN gradients in 3 steps"):
        for _ in range(3):
            s.update(flag(1))


# ----------------------------------------------------------------------------- no host sync


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_update_never_reads_back_without_the_warning(hysteresis):
    s = LossScaler(growth_interval=2, hysteresis=hysteresis, min_scale=1.0, warn_after_skips=None)
    flags = [flag(i % 3 == 0) for i in range(30)]
    with count_host_reads(forbid=True):
        for f in flags:
            s.update(f)
            s.inv_scale()


def test_skip_check_reads_back_once_every_k_updates():
    s = LossScaler(warn_after_skips=10)
    flags = [flag(0)] * 35
    with count_host_reads(forbid=False) as calls:
        for f in flags:
            s.update(f)
    assert calls == ["tolist"] * 3  # the snapshot reads after updates 10, 20, 30


# ----------------------------------------------------------------------------- checkpoints
@settings(max_examples=15, deadline=None)
@given(
    before=st.lists(st.booleans(), max_size=20),
    after=st.lists(st.booleans(), min_size=1, max_size=20),
    hysteresis=st.integers(1, 3),
)
def test_state_dict_round_trip_continues_bit_identically(before, after, hysteresis):
    opts = dict(init_scale=1024.0, growth_interval=3, hysteresis=hysteresis, min_scale=0.25, warn_after_skips=None)
    a = LossScaler(**opts)
    trajectory(a, before)
    sd = a.state_dict()
    b = LossScaler(init_scale=2.0, growth_factor=4.0, warn_after_skips=None)
    b.load_state_dict(sd)
    assert b.state_dict() == sd
    assert trajectory(a, after) == trajectory(b, after)


def test_state_dict_contents():
    s = LossScaler(init_scale=8.0, growth_interval=5, hysteresis=2, warn_after_skips=None)
    trajectory(s, [0, 0, 1])
    assert s.state_dict() == {
        "scale": 8.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 5,
        "hysteresis": 2,
        "min_scale": None,
        "max_scale": 2.0**24,
        "dynamic": True,
        "growth_tracker": 0,
        "hysteresis_tracker": 1,
        "consecutive_skips": 1,
    }


def test_load_state_dict_errors_and_clamp():
    s = LossScaler(max_scale=2.0**20)
    with pytest.raises(KeyError, match="no 'scale' entry"):
        s.load_state_dict({"growth_tracker": 3})
    with pytest.warns(RuntimeWarning, match="continuing from 1048576.0"):
        s.load_state_dict({"scale": 2.0**22})
    assert s.get_scale() == 2.0**20
    s.load_state_dict({"scale": 16.0, "hysteresis": 3, "hysteresis_tracker": 1})
    assert s.consecutive_skips.item() == 2


def test_to_moves_state_and_keeps_it():
    s = LossScaler(init_scale=8.0, warn_after_skips=None)
    trajectory(s, [0, 1])
    assert s.to("cpu") is s
    assert s.get_scale() == 4.0 and s.device == torch.device("cpu")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_update_matches_cpu_and_never_syncs():
    infs = [0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    cpu = LossScaler(init_scale=256.0, growth_interval=2, hysteresis=2, min_scale=4.0, warn_after_skips=None)
    gpu = LossScaler(
        init_scale=256.0, growth_interval=2, hysteresis=2, min_scale=4.0, warn_after_skips=5, device="cuda"
    )
    flags = [torch.tensor([float(i)], device="cuda") for i in infs]
    torch.cuda.synchronize()
    expected = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for i, f in zip(infs, flags):
                gpu.update(f)
                gpu.inv_scale()
                cpu.update(flag(i))
                expected.append(cpu.scale.clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert gpu.get_scale() == cpu.get_scale()
    assert gpu.state_dict()["growth_tracker"] == cpu.state_dict()["growth_tracker"]
    moved = LossScaler(device="cuda").to("cpu")
    assert moved.scale.device.type == "cpu"


@pytest.mark.gpu
def test_cuda_skip_warning_arrives_without_sync():
    s = LossScaler(warn_after_skips=4, device="cuda")
    f = torch.ones(1, device="cuda")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(4):
            s.update(f)
        torch.cuda.synchronize()  # let the snapshot arrive; it is read by the next update
        s.update(f)
    assert len(skip_warnings(rec)) == 1
