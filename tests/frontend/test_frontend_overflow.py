"""An injected inf: the step is skipped, params and optimizer state stay untouched, the scale halves and apex's
message is printed; closures on a skipped step, delay_overflow_check, the floor, static scales, fused optimizers."""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import batch, bits, make_model, train_steps
from torch.nn import functional as F

from fp16kit import amp

MSG = "Gradient overflow.  Skipping step, loss scaler {} reducing loss scale to {}\n"


def _snapshot(model, opt):
    params = [bits(p) for p in model.parameters()] + [bits(p) for p in amp.master_params(opt)]
    state = [(k, bits(v) if torch.is_tensor(v) and v.is_floating_point() else v)
             for s in opt.state.values() for k, v in sorted(s.items())]
    return params, state


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert len(pa) == len(pb) and all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert [k for k, _ in sa] == [k for k, _ in sb]
    for (_, x), (_, y) in zip(sa, sb):
        assert torch.equal(x, y) if torch.is_tensor(x) else x == y


def _make(level, optimizer="sgd", **kwargs):
    model = make_model()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    elif optimizer == "fused":  # torch's fused Adam: declares _step_supports_amp_scaling (skips inside step)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    else:  # fp16kit's FusedAdam: same protocol, with an fp32 [1] flag
        from fp16kit.optim import FusedAdam

        opt = FusedAdam(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level=level, verbosity=1, **kwargs)


@pytest.mark.parametrize(
    ("level", "optimizer"),
    [("O1", "sgd"), ("O2", "sgd"), ("O1", "fused"), ("O2", "fused"), ("O1", "fp16kit"), ("O2", "fp16kit")],
)
def test_injected_inf_skips_step_and_halves_scale(capsys, level, optimizer):
    model, opt = _make(level, optimizer)
    capsys.readouterr()
    train_steps(model, opt, range(2))
    before = _snapshot(model, opt)
    assert capsys.readouterr().out == ""
    train_steps(model, opt, range(2, 3), inject_inf=lambda s: True)
    assert capsys.readouterr().out == MSG.format(0, 32768.0)
    _same(_snapshot(model, opt), before)  # params, masters, momentum / Adam moments and step count untouched
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0
    if level == "O2":  # master grads are dropped with the skipped step (batchnorm's fp32 params keep theirs)
        masters = [p for p, q in zip(amp.master_params(opt), model.parameters()) if q.dtype == torch.float16]
        assert len(masters) == 4 and all(p.grad is None for p in masters)
    train_steps(model, opt, range(3, 4))  # the next clean step is applied
    assert capsys.readouterr().out == ""
    after = _snapshot(model, opt)
    assert not all(torch.equal(x, y) for x, y in zip(after[0], before[0]))
    sd = amp.state_dict()["loss_scaler0"]
    assert sd["unskipped"] == 1 and sd["fp16kit"]["steps_skipped"] == 1


def test_consecutive_overflows_halve_each_time_down_to_the_floor(capsys):
    model, opt = _make("O2", min_loss_scale=16384.0)
    capsys.readouterr()
    train_steps(model, opt, range(3), inject_inf=lambda s: True)
    assert capsys.readouterr().out == MSG.format(0, 32768.0) + MSG.format(0, 16384.0) + MSG.format(0, 16384.0)


@pytest.mark.parametrize("optimizer", ["sgd", "fused", "fp16kit"])
def test_closure_on_a_skipped_step_is_an_error(optimizer):
    model, opt = _make("O2", optimizer)
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y) * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match=r"step\(closure\) was called for a step that amp must skip"):
        opt.step(lambda: loss)


def test_closure_on_a_clean_step_runs():
    model, opt = _make("O1")
    x, y = batch(0)
    calls = []

    def closure():
        calls.append(1)
        return F.cross_entropy(model(x), y)

    with amp.scale_loss(closure(), opt) as scaled:
        scaled.backward()
    opt.step(closure)
    assert len(calls) == 2


def test_delay_overflow_check_neither_updates_nor_skips(capsys):
    model, opt = _make("O1")
    capsys.readouterr()
    x, y = batch(0)
    w = bits(model[0].weight)
    loss = F.cross_entropy(model(x), y) * float("inf")
    with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
        scaled.backward()
    opt.step()
    assert capsys.readouterr().out == ""
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 65536.0
    assert not torch.equal(bits(model[0].weight), w)  # the step was applied (with the non-finite grads)


def test_static_loss_scale_never_skips(capsys):
    model, opt = _make("O2", loss_scale=128.0)
    capsys.readouterr()
    train_steps(model, opt, range(1), inject_inf=lambda s: True)
    assert capsys.readouterr().out == ""
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0
    assert not torch.isfinite(model[0].weight).all()  # apex semantics: a static scale applies the step


def test_static_scale_unscales_fp16_grads_exactly_into_masters():
    # O2, static scale 128: master.grad = fp32(model.grad) / 128 exactly (a power of two), in one pass.
    model, opt = _make("O2", loss_scale=128.0)
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    pairs = [(p, q) for p, q in zip(amp.master_params(opt), model.parameters()) if q.dtype == torch.float16]
    assert len(pairs) == 4
    for master, param in pairs:
        assert torch.equal(master.grad, param.grad.float() / 128.0)


def test_one_overflow_skips_every_optimizer_and_prints_once(capsys):
    model = make_model()
    head = list(model[3].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    o1, o2 = torch.optim.SGD(body, lr=0.1), torch.optim.SGD(head, lr=0.1)
    model, (o1, o2) = amp.initialize(model, [o1, o2], opt_level="O2", verbosity=1)
    capsys.readouterr()
    before = [bits(p) for p in model.parameters()]
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y) * float("inf"), [o1, o2]) as scaled:
        scaled.backward()
    o1.step()
    o2.step()
    assert capsys.readouterr().out == MSG.format(0, 32768.0)
    assert all(torch.equal(bits(p), b) for p, b in zip(model.parameters(), before))


def test_verbosity_zero_is_silent_on_overflow(capsys):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    train_steps(model, opt, range(1), inject_inf=lambda s: True)
    assert capsys.readouterr().out == ""
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0


def _count_host_reads():
    """The shared detector from tests/amp (imported by path: test directories are not packages)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "amp" / "_host_reads.py"
    spec = importlib.util.spec_from_file_location("_amp_host_reads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.count_host_reads


@pytest.mark.parametrize("optimizer", ["fused", "fp16kit"])
def test_fused_optimizers_skip_without_reading_the_flag_back(optimizer):
    count_host_reads = _count_host_reads()
    model, opt = _make("O2", optimizer)
    opt._amp_stash.session.verbosity = 0  # the overflow message is the only thing that would read the flag
    before = None
    for step in range(4):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y) * (float("inf") if step == 2 else 1.0)
        if step == 2:
            before = _snapshot(model, opt)
        with count_host_reads(forbid=True):
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        if step == 2:
            _same(_snapshot(model, opt), before)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 32768.0


def test_plain_optimizer_reads_the_flag_once_per_scale_loss():
    count_host_reads = _count_host_reads()
    model, opt = _make("O2", "sgd")
    opt._amp_stash.session.verbosity = 0
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y)
    with count_host_reads(forbid=False) as calls:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert calls == ["__float__"]


def test_max_loss_scale_caps_the_start_and_the_growth():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", max_loss_scale=1024.0, scale_window=2, verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1024.0  # min(2**16, max_loss_scale)
    train_steps(model, opt, range(5))
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1024.0


def test_growth_after_scale_window_clean_steps():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", scale_window=3, verbosity=0)
    train_steps(model, opt, range(3))
    sd = amp.state_dict()["loss_scaler0"]
    assert sd["loss_scale"] == 131072.0 and sd["unskipped"] == 0


@pytest.mark.parametrize("level", ["O0", "O3"])
def test_static_scale_one_without_masters_is_a_pass_through(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y)
    (loss * 1.0).backward(retain_graph=True)  # grads already there are simply accumulated into
    first = [p.grad.clone() for p in model.parameters()]
    with amp.scale_loss(loss, opt) as scaled:
        assert torch.equal(scaled, loss.float())
        scaled.backward()
    for p, g in zip(model.parameters(), first):
        assert torch.equal(p.grad, g + g)


def _tiny(**kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O2", verbosity=0, **kwargs)


def _nan_steps(model, opt, n):
    x = torch.ones(4, 2)
    for _ in range(n):
        opt.zero_grad()
        with amp.scale_loss(model(x).sum() * float("nan"), opt) as scaled:
            scaled.backward()
        opt.step()


def test_nan_loss_from_the_start_warns_and_stops_at_the_floor():
    model, opt = _tiny(min_loss_scale=1.0)
    with pytest.warns(RuntimeWarning, match=r"50 optimizer steps in a row were skipped") as record:
        _nan_steps(model, opt, 50)
    assert "the min_scale floor (1.0)" in str(record[0].message)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1.0  # 2**16 halved 16 times, then held
    assert amp.state_dict()["loss_scaler0"]["fp16kit"]["steps_skipped"] == 50


def test_static_scale_producing_inf_warns():
    model, opt = _tiny(loss_scale=128.0)
    with pytest.warns(RuntimeWarning, match=r"static loss scale 128 produced inf/NaN gradients in 50 steps"):
        _nan_steps(model, opt, 50)
