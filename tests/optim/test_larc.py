"""LARC around any optimizer: the rewritten gradients against the float64 reference on both backends (the
per-tensor norms come from fp16kit.kernels.l2norm), a full step against the reference + torch.optim.SGD, the
wrapper contract (groups, state, checkpoints, zero_grad, schedulers), scalers, amp O2, non-finite grads.

Tolerance of a rewritten gradient ``(g + wd p) a``: the factor ``a`` comes from two norms (relative error
gamma(n) + a few u each, float64 arithmetic after that, rounded once to fp32), then one multiply and one
multiply-add in the grad dtype: ``(K u + 2 gamma(n)) (|g| + wd |p|) a`` plus one ulp of the grad dtype per
operation (at the magnitude ``(|g| + wd |p|) a``: the two terms may cancel).
"""

from __future__ import annotations

import pytest
import torch
from apex_optim_helpers import check_grad_scaler
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_helpers import U32, K, assert_same_bits, assert_within, clone_params, make_params, set_grads

from fp16kit.kernels import use_backend
from fp16kit.numerics import gamma, ulp
from fp16kit.numerics.reference import larc_grads, sgd_step
from fp16kit.optim import LARC, FusedLAMB, FusedSGD

SHAPES = st.lists(st.sampled_from([(1,), (7,), (3, 5), (64,)]), min_size=1, max_size=3)
CONFIG = {
    "dtype": st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    "seed": st.integers(0, 2**16),
    "lr": st.sampled_from([1e-3, 0.1, 10.0]),
    "weight_decay": st.sampled_from([0.0, 1e-4, 0.1]),
    "trust_coefficient": st.sampled_from([0.02, 0.001, 1.0]),
    "clip": st.booleans(),
    "eps": st.sampled_from([1e-8, 0.0]),
    "grad_exp": st.integers(-10, 4),
    "zero": st.sampled_from(["none", "param", "grad"]),
}


class _Recorder(torch.optim.SGD):
    """An optimizer whose step records the grads and weight decay it was given (and changes nothing)."""

    def step(self, closure=None):
        self.seen = [p.grad.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.seen_wd = [g["weight_decay"] for g in self.param_groups]


def _check_grads(shapes, dtype, seed, lr, weight_decay, trust_coefficient, clip, eps, grad_exp, zero):
    zp = (0,) if zero == "param" else ()
    zg = (0,) if zero == "grad" else ()
    params = make_params(shapes, dtype, seed, grad_scale=2.0**grad_exp, zero_params=zp, zero_grads=zg)
    inner = _Recorder(params, lr=lr, weight_decay=weight_decay)
    larc = LARC(inner, trust_coefficient=trust_coefficient, clip=clip, eps=eps)
    p64 = [p.detach().double() for p in params]
    g64 = [p.grad.double() for p in params]
    larc.step()
    assert inner.seen_wd == [0]  # LARC applied the decay itself
    assert larc.param_groups[0]["weight_decay"] == weight_decay  # and handed it back
    want = larc_grads(
        p64, g64, lr=lr, weight_decay=weight_decay, trust_coefficient=trust_coefficient, clip=clip, eps=eps
    )
    for i, (got, w) in enumerate(zip(inner.seen, want)):
        factor = (w.norm() / (g64[i] + weight_decay * p64[i]).norm()).item() if w.norm() > 0 else 1.0
        mag = (g64[i].abs() + weight_decay * p64[i].abs()) * factor
        budget = (K * U32 + 2 * gamma(g64[i].numel(), torch.float32)) * mag
        if dtype != torch.float32:  # g a, (wd a) p and their sum each rounded to the grad dtype
            budget = budget + 3 * ulp(mag, dtype)
        assert_within(got, w, budget, f"grad {i}")


@settings(max_examples=40, deadline=None)
@given(shapes=SHAPES, **CONFIG)
def test_grads_match_reference_torch_backend(shapes, **kw):
    _check_grads(shapes, **kw)


@pytest.mark.interpreter
@settings(max_examples=6, deadline=None)
@given(shapes=SHAPES, **CONFIG)
def test_grads_match_reference_triton_interpreter(shapes, **kw):
    _check_grads(shapes, **kw)


@pytest.mark.interpreter
def test_backends_agree():
    """The norms of the Triton l2norm kernel (interpreter) and of the torch fallback give grads within a few
    fp32 roundings of each other (4100 elements: two chunks)."""
    a = make_params([(4100,), (300,)], torch.float32, 3)
    b = clone_params(a)
    ra, rb = _Recorder(a, lr=0.1, weight_decay=0.01), _Recorder(b, lr=0.1, weight_decay=0.01)
    LARC(ra).step()
    with use_backend("torch"):
        LARC(rb).step()
    for x, y in zip(ra.seen, rb.seen):
        assert_within(x, y.double(), 16 * U32 * y.double().abs(), "kernel vs fallback")


def test_step_matches_reference_with_torch_sgd():
    """LARC(torch.optim.SGD with momentum and decay): two steps against larc_grads + sgd_step (weight decay 0
    inside the step) in float64."""
    params = make_params([(10,), (4, 3)], torch.float32, 4)
    larc = LARC(torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01), trust_coefficient=0.02)
    p64 = [p.detach().double() for p in params]
    bufs = [None] * len(params)
    for k in range(2):
        g = larc_grads(p64, [p.grad.double() for p in params], lr=0.1, weight_decay=0.01)
        p64, bufs = sgd_step(p64, g, bufs, lr=0.1, momentum=0.9)
        larc.step()
        for i, p in enumerate(params):
            assert_within(p, p64[i], 64 * U32 * (p64[i].abs() + 1e-3), f"param {i} at step {k + 1}")
        set_grads(params, 7 + k)


def test_wraps_any_optimizer_and_delegates():
    params = make_params([(6,), (2, 2)], torch.float16, 5)
    inner = FusedLAMB(params, lr=0.01, master_weights=True)
    larc = LARC(inner, clip=False)
    assert isinstance(larc, torch.optim.Optimizer)
    assert larc.param_groups is inner.param_groups and larc.defaults is inner.defaults
    larc.step()
    assert larc.state is inner.state and "master" in larc.state[params[0]]
    assert larc.state_dict()["param_groups"] == inner.state_dict()["param_groups"]
    extra = make_params([(3,)], torch.float16, 6)
    larc.add_param_group({"params": extra})
    assert inner.param_groups[-1]["params"] == extra
    sched = torch.optim.lr_scheduler.StepLR(larc, step_size=1, gamma=0.5)
    larc.step()
    sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.005)
    larc.zero_grad()
    assert all(p.grad is None for p in params)  # FusedLAMB's set_grad_none=True
    larc2 = LARC(FusedLAMB(clone_params(params), lr=0.01, master_weights=True))
    larc2.add_param_group({"params": clone_params(extra)})
    larc2.load_state_dict(larc.state_dict())
    assert larc2.param_groups[0]["lr"] == pytest.approx(0.005)


def test_nonfinite_grads_pass_through_unchanged():
    """A NaN/inf gradient makes its norm non-finite: LARC leaves that grad as it was (apex turns it into NaN or
    0), so a fp16kit optimizer sees it and skips the step instead of writing NaN."""
    params = make_params([(5,), (3,)], torch.float32, 8)
    params[0].grad[2] = float("inf")
    params[1].grad[0] = float("nan")
    grads = [p.grad.clone() for p in params]
    before = [p.detach().clone() for p in params]
    larc = LARC(FusedSGD(params, lr=0.1, weight_decay=0.01))
    with pytest.warns(RuntimeWarning, match="skipped"):
        larc.step()
    assert_same_bits([p.detach() for p in params], before)
    for p, g0 in zip(params, grads):
        assert torch.equal(p.grad.nan_to_num(), g0.nan_to_num())


@pytest.mark.parametrize("scaler_kind", ["torch", "fp16kit"])
def test_with_grad_scaler(scaler_kind):
    """scaler.step(larc): the scaler unscales the grads (LARC declares no fused hand-over), LARC rescales them,
    the inner optimizer steps; with a power-of-two scale the result equals the unscaled run bit for bit, and an
    inf gradient skips the whole step."""
    check_grad_scaler(lambda ps: LARC(FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)), scaler_kind)


def test_amp_o2():
    from fp16kit import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    larc = LARC(FusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    model, larc = amp.initialize(model, larc, opt_level="O2", verbosity=0)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    masters = list(amp.master_params(larc))
    start = [m.detach().clone() for m in masters]
    for _ in range(3):
        larc.zero_grad()
        with amp.scale_loss(model(x.half()).float().square().sum(), larc) as scaled:
            scaled.backward()
        larc.step()
    assert all(m.dtype == torch.float32 and torch.isfinite(m).all() for m in masters)
    assert any(not torch.equal(m, s) for m, s in zip(masters, start))
    for m, p in zip(masters, model.parameters()):
        assert torch.equal(m.to(p.dtype), p.detach())


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"trust_coefficient": float("nan")}, ValueError, "trust_coefficient"),
        ({"trust_coefficient": -1.0}, ValueError, "trust_coefficient"),
        ({"eps": float("inf")}, ValueError, "eps"),
    ],
)
def test_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        LARC(torch.optim.SGD(make_params([(3,)], torch.float32, 0), lr=0.1), **kwargs)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        LARC([torch.zeros(3)])


def test_weight_decay_restored_after_an_error():
    """If the wrapped step raises, every group gets its own weight decay back (a group without one stays
    without one)."""
    a, b = make_params([(3,)], torch.float32, 9), make_params([(2,)], torch.float32, 10)

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("boom")

    inner = Failing([{"params": a, "weight_decay": 0.1}, {"params": b}], lr=0.1)
    del inner.param_groups[1]["weight_decay"]
    with pytest.raises(RuntimeError, match="boom"):
        LARC(inner).step()
    assert inner.param_groups[0]["weight_decay"] == 0.1
    assert "weight_decay" not in inner.param_groups[1]
