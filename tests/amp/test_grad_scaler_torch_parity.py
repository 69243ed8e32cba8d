"""GradScaler's defaults, trajectory and checkpoints against ``torch.amp.GradScaler("cpu")`` run beside it.

Each test drives both scalers with the same inputs (gradients that are finite or inf/NaN at chosen steps) and
compares the scale and the growth tracker after every update. The contract (loss-scaler.md, issue 11): torch's
defaults (no cap: the scale doubles past 2**24), every scale torch accepts is accepted (constructor, loaded
state, ``update(new_scale)``), and a user-set cap clips growth but never refuses or moves a scale. Issue 9: the
scale can never become NaN, inf or 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.amp import GradScaler
from fp16kit.amp.loss_scaler import SCALE_FLOOR, _copy_valid_scale


class _Pair:
    """One parameter and a learning-rate-0 SGD per scaler: a step only unscales/checks the gradient we set."""

    def __init__(self, scaler):
        self.scaler = scaler
        self.p = torch.nn.Parameter(torch.zeros(3))
        self.opt = torch.optim.SGD([self.p], lr=0.0)
        scaler.scale(torch.ones(1))  # creates the scale tensor (lazy in both)

    def step(self, bad: float | None) -> tuple[float, int]:
        g = torch.ones(3)
        if bad is not None:
            g[1] = bad
        self.p.grad = g
        self.scaler.step(self.opt)
        self.scaler.update()
        return self.scaler.get_scale(), int(self.scaler.state_dict()["_growth_tracker"])


def _run_both(flags, ours_kw=None, **kw):
    a = _Pair(GradScaler("cpu", **kw, **(ours_kw or {})))
    b = _Pair(torch.amp.GradScaler("cpu", **kw))
    for i, bad in enumerate(flags):
        mine, ref = a.step(bad), b.step(bad)
        assert mine == ref, f"update {i}: fp16kit {mine} != torch {ref}"
    return a, b


@pytest.mark.parametrize("init_scale", [2.0**25, 2.0**32, 1e38, 3.0e-30, 1000.0 / 3.0])
def test_constructor_accepts_what_torch_accepts(init_scale):
    ours, theirs = GradScaler("cpu", init_scale=init_scale), torch.amp.GradScaler("cpu", init_scale=init_scale)
    loss = torch.tensor([1.5, -2.0])
    torch.testing.assert_close(ours.scale(loss), theirs.scale(loss), rtol=0, atol=0)
    assert ours.get_scale() == theirs.get_scale()
    assert ours.state_dict()["scale"] == theirs.state_dict()["scale"]


def test_default_scale_keeps_doubling_past_2_24_like_torch():
    # growth_interval=1: 2**16 -> 2**127 in 111 clean updates, then the next growth would overflow to inf and is
    # refused (the scale stays at 2**127), exactly as torch's op does.
    a, _ = _run_both([None] * 120, growth_interval=1)
    assert a.scaler.get_scale() == 2.0**127


@settings(max_examples=12, deadline=None)
@given(
    flags=st.lists(st.sampled_from([None, None, None, math.inf, -math.inf, math.nan]), min_size=1, max_size=150),
    init_exp=st.integers(-20, 126),
    interval=st.integers(1, 4),
    factors=st.sampled_from([(2.0, 0.5), (1.7, 0.3), (4.0, 0.125), (1.0001, 0.9999)]),
)
def test_trajectory_equals_torch(flags, init_exp, interval, factors):
    _run_both(
        flags, init_scale=2.0**init_exp, growth_interval=interval, growth_factor=factors[0], backoff_factor=factors[1]
    )


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_round_trips_both_ways_and_continues_identically(direction):
    flags = [None, None, math.inf, None, None, None, math.nan, None, None, None]
    src_cls = torch.amp.GradScaler if direction == "torch_to_ours" else GradScaler
    src = _Pair(src_cls("cpu", init_scale=2.0**29, growth_interval=2))
    for bad in flags[:4]:
        src.step(bad)
    state = src.scaler.state_dict()
    assert state["scale"] == 2.0**29 and state["_growth_tracker"] == 1  # grew to 2**30, backed off, one clean
    a, b = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    a.load_state_dict(state)
    b.load_state_dict(
        {k: state[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")}
    )
    pa, pb = _Pair(a), _Pair(b)
    assert a.get_scale() == b.get_scale() == 2.0**29
    for i, bad in enumerate(flags + [None] * 6):
        assert pa.step(bad) == pb.step(bad), f"update {i} after the load"
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(a.state_dict())  # torch reads its five keys from ours
    assert back.state_dict() == b.state_dict()


def test_torch_state_with_scale_2_30_loads_as_2_30():
    t = torch.amp.GradScaler("cpu", init_scale=2.0**30)
    t.scale(torch.ones(1))
    for make in (lambda: GradScaler("cpu"), lambda: GradScaler("cpu", max_scale=2.0**24)):
        ours = make()
        ours.load_state_dict(t.state_dict())
        assert ours.get_scale() == 2.0**30
        ours.scale(torch.ones(1))
        assert ours.get_scale() == 2.0**30


def test_update_new_scale_accepts_what_torch_accepts():
    a, b = _run_both([None])
    for value in (2.0**30, torch.tensor(2.0**31), torch.tensor(3.0e-20, dtype=torch.float64), 1e38):
        a.scaler.update(new_scale=value)
        b.scaler.update(new_scale=value)
        assert a.scaler.get_scale() == b.scaler.get_scale()


def test_a_cap_clips_growth_and_never_refuses_or_moves_a_scale():
    s = GradScaler("cpu", init_scale=2.0**30, growth_interval=1, max_scale=2.0**24, min_scale=2.0**10)
    p = _Pair(s)
    assert p.step(None)[0] == 2.0**30  # above the cap: growth does not raise it, nor does the cap lower it
    assert p.step(math.inf)[0] == 2.0**29  # backoff works as usual
    assert p.step(None)[0] == 2.0**29
    s.update(new_scale=2.0**40)  # accepted as given
    assert s.get_scale() == 2.0**40
    s.update(new_scale=2.0**20)
    assert [p.step(None)[0] for _ in range(6)] == [2.0**21, 2.0**22, 2.0**23, 2.0**24, 2.0**24, 2.0**24]
    s.update(new_scale=2.0**5)  # below the floor: backoff does not go further down, nor does the floor raise it
    assert p.step(math.inf)[0] == 2.0**5 and p.step(None)[0] == 2.0**6


# ----------------------------------------------------------------------------- issue 9: never NaN, inf or 0
BAD_VALUES = [math.nan, math.inf, -math.inf, 0.0, -0.0, -2.0, 1e39, 2.0**-127, 1e-45]


@pytest.mark.parametrize("as_tensor", [False, True], ids=["float", "cpu_tensor"])
@pytest.mark.parametrize("bad", BAD_VALUES)
def test_update_rejects_invalid_new_scale(bad, as_tensor):
    s = GradScaler("cpu")
    p = _Pair(s)
    p.step(None)
    value = torch.tensor([bad], dtype=torch.float64) if as_tensor else bad
    with pytest.raises(ValueError, match="new_scale"):
        s.update(new_scale=value)
    assert s.get_scale() == 2.0**16  # unchanged
    p.step(None)  # and the scaler still works


def test_device_tensor_new_scale_is_checked_on_the_device():
    """The accelerator path (no host read) as a function: an invalid value keeps the scale and is counted."""
    scale, rejected = torch.tensor([8.0]), torch.zeros(1, dtype=torch.int32)
    for bad in BAD_VALUES:
        _copy_valid_scale(scale, torch.tensor([bad], dtype=torch.float64), rejected)
        assert scale.item() == 8.0
    _copy_valid_scale(scale, torch.tensor(2.0**30), rejected)
    assert scale.item() == 2.0**30 and rejected.item() == len(BAD_VALUES)


def test_backoff_never_reaches_zero_and_matches_torch_down_to_the_floor():
    # 2**16 halves to fp32's smallest normal 2**-126 after 142 overflows, identically in both. Below it torch goes
    # on into subnormals, whose reciprocal (the unscale factor) is inf so that every later step overflows, and
    # after 165 overflows its scale is 0 for good (0 * growth_factor = 0). Ours stays at 2**-126 and recovers.
    a, b = _run_both([math.inf] * 142)
    assert a.scaler.get_scale() == SCALE_FLOOR == 2.0**-126
    for _ in range(30):
        assert a.step(math.inf)[0] == SCALE_FLOOR
        b.step(math.inf)
    assert b.scaler.get_scale() == 0.0
    a.scaler.set_growth_interval(1)
    assert a.step(None)[0] == 2.0**-125


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
def test_loading_an_invalid_scale_is_refused(bad):
    t = torch.amp.GradScaler("cpu")
    state = {**t.state_dict(), "scale": bad}
    ours = GradScaler("cpu")
    with pytest.raises(ValueError, match="scale"):
        ours.load_state_dict(state)
    assert ours.get_scale() == 2.0**16
