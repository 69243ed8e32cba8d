"""The amp frontend's lifecycle after ``initialize`` (issue 9): ``add_param_group``, resuming amp and master
checkpoints, trainers that call ``backward()`` themselves, optimizer wrappers (accelerate), option errors.

Every test here failed on the frontend before issue 9's fixes (docs/migrating-from-apex.md, "Lifecycle and
checkpoints", describes the behaviour they pin down).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from frontend_helpers import batch, bits, make_model, roundtrip, train_steps
from torch import nn
from torch.nn import functional as F

from fp16kit import amp
from fp16kit.amp._frontend.masters import MASTERS_KEY
from fp16kit.optim import FusedAdam

F16, F32 = torch.float16, torch.float32
S0 = 65536.0  # the first dynamic loss scale


def _two_layers(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _backward(model, opt, step=0, **kwargs):
    x, y = batch(step)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt, **kwargs) as scaled:
        scaled.backward()


def _stash_sizes(opt):
    stash = opt._amp_stash
    return len(stash.model), len(stash.masters), len(stash.direct), len(stash.direct_stash)


# ------------------------------------------------------------------------------------------- add_param_group
def test_o1_group_added_after_initialize_is_unscaled_and_checked():
    model = _two_layers()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.05})

    # the same forward/backward without amp: true (unscaled) gradients of the new group
    x, y = batch(0)
    reference = _two_layers()
    with amp.autocast(dtype=F16):
        out = reference(x)
    F.cross_entropy(out.float(), y).backward()
    _backward(model, opt)
    for p, r in zip(model[2].parameters(), reference[2].parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-7)  # not S0 times larger

    # an inf only in the new group's gradients: the step is skipped for every group
    opt.zero_grad()
    w0, w2 = bits(model[0].weight), bits(model[2].weight)
    model[2].weight.register_hook(lambda g: g * math.inf)
    _backward(model, opt)
    opt.step()
    assert torch.equal(bits(model[0].weight), w0) and torch.equal(bits(model[2].weight), w2)
    assert opt._amp_stash.session.scalers[0].get_scale() == S0 / 2


def test_o2_group_added_after_initialize_gets_masters_and_steps_through_them():
    model = _two_layers()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.5)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.add_param_group({"params": model[2].parameters(), "lr": 0.25})  # a generator, as torch accepts
    assert len(opt.param_groups) == 2
    for group in opt.param_groups:
        assert all(q.dtype == F32 for q in group["params"])  # both groups hold fp32 masters
    added = opt.param_groups[1]["params"]
    for q, p in zip(added, model[2].parameters()):
        assert p.dtype == F16 and torch.equal(q, p.float())

    start = [[q.detach().clone() for q in g["params"]] for g in opt.param_groups]
    _backward(model, opt)
    grads = [[p.grad.float() / S0 for p in layer.parameters()] for layer in (model[0], model[2])]
    opt.step()
    for group, s, g in zip(opt.param_groups, start, grads):
        for q, q0, gq in zip(group["params"], s, g):
            assert torch.equal(q, q0 - group["lr"] * gq)  # the masters stepped on the unscaled grads
    for q, p in zip(added, model[2].parameters()):
        assert torch.equal(q.to(F16), p)  # and were written into the fp16 model
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters()) and all(q.grad is None for q in added)


def test_o3_group_added_after_initialize_is_unscaled():
    model = _two_layers()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O3", loss_scale=128.0, verbosity=0)
    opt.add_param_group({"params": list(model[2].parameters())})
    x, y = batch(0)
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    h = F.relu(F.linear(x.half(), reference[0], reference[1]))
    (F.cross_entropy(F.linear(h, reference[2], reference[3]).float(), y) * 128.0).backward()
    _backward(model, opt)
    for p, r in zip(model.parameters(), reference):
        assert torch.equal(p.grad, (r.grad.float() * (1 / 128.0)).half())


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("kind", ["fused_adam", "validating_sgd"])
def test_rejected_param_group_changes_neither_optimizer_nor_amp(level, kind):
    class ValidatingSGD(torch.optim.SGD):  # validates after torch appended the group, as some optimizers do
        def add_param_group(self, group):
            super().add_param_group(group)
            if group["lr"] < 0:
                raise ValueError(f"Invalid learning rate: {group['lr']}")

    model = _two_layers()
    cls = FusedAdam if kind == "fused_adam" else ValidatingSGD
    opt = cls(model[0].parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    groups, sizes = [list(g["params"]) for g in opt.param_groups], _stash_sizes(opt)
    group = {"params": list(model[2].parameters()), "lr": -5.0}
    with pytest.raises(ValueError, match="-5"):
        opt.add_param_group(group)
    assert [list(g["params"]) for g in opt.param_groups] == groups
    assert _stash_sizes(opt) == sizes
    assert all(a is b for a, b in zip(group["params"], model[2].parameters()))  # the caller's params back
    # the optimizer still trains, and the same layer can be added correctly afterwards
    group["lr"] = 0.01
    opt.add_param_group(group)
    w = bits(model[2].weight)
    train_steps(model, opt, range(2))
    assert not torch.equal(bits(model[2].weight), w)


def test_o2_param_already_mastered_cannot_be_added_again():
    model = _two_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    sizes = _stash_sizes(opt)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[2].weight]})
    assert len(opt.param_groups) == 1 and _stash_sizes(opt) == sizes


def test_o2_group_added_after_initialize_round_trips_through_a_checkpoint():
    model = _two_layers()
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.add_param_group({"params": list(model[2].parameters())})
    train_steps(model, opt, range(3))
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert sorted(ckpt["opt"][MASTERS_KEY]) == [0, 1, 2, 3]

    model2 = _two_layers(seed=4)
    opt2 = torch.optim.Adam(model2[0].parameters(), lr=1e-2)
    model2, opt2 = amp.initialize(model2, opt2, opt_level="O2", verbosity=0)
    opt2.add_param_group({"params": list(model2[2].parameters())})
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for a, b in zip(amp.master_params(opt), amp.master_params(opt2)):
        assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(bits(a), bits(b))


# ------------------------------------------------------------------------------------------- amp.load_state_dict
def _initialized(level, **kwargs):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)


def test_o2_resumed_from_o3_state_stays_dynamic():
    _initialized("O3")
    o3_state = roundtrip(amp.state_dict())
    model, opt = _initialized("O2")
    with pytest.warns(RuntimeWarning, match=r"saved with static loss scaling.*chose dynamic"):
        amp.load_state_dict(o3_state)
    scaler = opt._amp_stash.session.scalers[0]
    assert scaler.dynamic and scaler.get_scale() == S0
    # and it behaves dynamically: an overflow is skipped and backs off
    w = bits(model[0].weight)
    train_steps(model, opt, range(1), inject_inf=lambda s: True)
    assert torch.equal(bits(model[0].weight), w) and scaler.get_scale() == S0 / 2


def test_static_run_resumed_from_dynamic_state_keeps_its_static_scale():
    _initialized("O2")
    dynamic_state = roundtrip(amp.state_dict())
    _, opt = _initialized("O2", loss_scale=128.0)
    with pytest.warns(RuntimeWarning, match=r"saved with dynamic loss scaling.*chose static"):
        amp.load_state_dict(dynamic_state)
    scaler = opt._amp_stash.session.scalers[0]
    assert not scaler.dynamic and scaler.get_scale() == 128.0


def test_same_mode_resume_restores_the_scale_without_warning():
    model, opt = _initialized("O2")
    train_steps(model, opt, range(2), inject_inf=lambda s: s == 0)
    saved = roundtrip(amp.state_dict())
    _, opt2 = _initialized("O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_state_dict(saved)
    assert opt2._amp_stash.session.scalers[0].get_scale() == S0 / 2


BAD_SCALES = [float("nan"), float("inf"), -1.0, 0.0, 1e39, 2**200]


@pytest.mark.parametrize("bad", BAD_SCALES, ids=["nan", "inf", "negative", "zero", "1e39", "2**200"])
@pytest.mark.parametrize("fmt", ["apex", "fp16kit"])
def test_invalid_loss_scale_in_amp_checkpoint_is_rejected_by_key(bad, fmt):
    _, opt = _initialized("O1", num_losses=2)
    saved = roundtrip(amp.state_dict())
    saved["loss_scaler0"]["loss_scale"] = 1024.0  # a valid entry before the bad one: not loaded either
    saved["loss_scaler0"]["fp16kit"]["scale"] = 1024.0
    if fmt == "apex":
        saved = {k: {"loss_scale": v["loss_scale"], "unskipped": v["unskipped"]} for k, v in saved.items()}
        saved["loss_scaler1"]["loss_scale"] = bad
    else:
        saved["loss_scaler1"]["fp16kit"]["scale"] = bad
    with pytest.raises(ValueError, match=r"state_dict\['loss_scaler1'\].*scale.*not a loss scale"):
        amp.load_state_dict(saved)
    assert [s.get_scale() for s in opt._amp_stash.session.scalers] == [S0, S0]


@pytest.mark.parametrize(
    ("path", "bad"),
    [(("unskipped",), -1), (("unskipped",), 1.5), (("fp16kit", "growth_tracker"), float("nan")),
     (("fp16kit", "consecutive_skips"), -3)],
    ids=["negative", "fraction", "nan", "negative-skips"],
)
def test_invalid_counter_in_amp_checkpoint_is_rejected_by_key(path, bad):
    _, opt = _initialized("O1")
    saved = roundtrip(amp.state_dict())
    entry = saved["loss_scaler0"]
    for name in path[:-1]:
        entry = entry[name]
    entry[path[-1]] = bad
    with pytest.raises(ValueError, match=r"state_dict\['loss_scaler0'\].*" + path[-1] + r".*not a count"):
        amp.load_state_dict(saved)
    assert opt._amp_stash.session.scalers[0].get_scale() == S0


def _o2_checkpoint():
    model, opt = _initialized("O2")
    train_steps(model, opt, range(2))
    return model, opt, roundtrip(opt.state_dict())


def _snapshot(model, opt):
    out = [bits(p) for p in model.parameters()] + [bits(q) for q in amp.master_params(opt)]
    return out + [bits(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]


@pytest.mark.parametrize(
    ("corrupt", "needle"),
    [
        (lambda m: m.__setitem__(0, torch.full_like(m[0], float("nan"))), r"\[0\].*inf/NaN"),
        (lambda m: m[1].__setitem__(3, float("inf")), r"\[1\].*inf/NaN"),
        (lambda m: m.__setitem__(4, m[4][:-1]), r"\[4\].*group 0, index 4.*shape"),
        (lambda m: m.__setitem__(5, m[5].half()), r"\[5\].*torch.float16"),
        (lambda m: m.pop(1), r"\[1\].*missing"),
    ],
    ids=["nan", "inf", "shape", "dtype", "missing"],
)
def test_corrupt_o2_masters_in_optimizer_checkpoint_are_rejected_before_anything_changes(corrupt, needle):
    _, _, ckpt = _o2_checkpoint()
    corrupt(ckpt[MASTERS_KEY])
    model, opt = _initialized("O2")
    train_steps(model, opt, range(1))
    before = _snapshot(model, opt)
    with pytest.raises((ValueError, RuntimeError), match=MASTERS_KEY + ".*" + needle):
        opt.load_state_dict(ckpt)
    after = _snapshot(model, opt)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


# ------------------------------------------------------------------------------------------- backward() outside
def test_o2_step_after_a_plain_backward_warns_once_and_changes_nothing():
    # what HF Trainer / accelerate do: loss.backward() themselves, then optimizer.step()
    model, opt = _initialized("O2")
    before = [bits(p) for p in model.parameters()] + [bits(q) for q in amp.master_params(opt)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = batch(step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            model.zero_grad()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "amp.scale_loss" in messages[0]
    after = [bits(p) for p in model.parameters()] + [bits(q) for q in amp.master_params(opt)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # fp32 batchnorm params included


def test_o2_step_after_delay_unscale_only_warns_too():
    model, opt = _initialized("O2")
    _backward(model, opt, delay_unscale=True)
    w = bits(model[0].weight)
    with pytest.warns(RuntimeWarning, match="delay_unscale"):
        opt.step()
    assert torch.equal(bits(model[0].weight), w)


def test_normal_o2_loops_never_see_the_warning():
    model, opt = _initialized("O2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_steps(model, opt, range(2))
        opt.step()  # a second step with the same (already unscaled) grads
        opt.zero_grad(set_to_none=False)
        opt.step()  # zeroed grads
        _backward(model, opt)
        opt.step()


# ------------------------------------------------------------------------------------------- optimizer wrappers
class AcceleratedOptimizerStandIn(torch.optim.Optimizer):
    """Shaped like accelerate's ``AcceleratedOptimizer``: an ``Optimizer`` subclass that never ran
    ``Optimizer.__init__``, delegates to ``self.optimizer``, reloads the optimizer's own state dict when it is
    built (accelerate's device placement) and zeroes grads with ``set_to_none=False`` by default."""

    def __init__(self, optimizer):  # no super().__init__(), as accelerate
        self.optimizer = optimizer
        optimizer.load_state_dict(optimizer.state_dict())

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=None):
        self.optimizer.zero_grad(set_to_none=bool(set_to_none))


class PlainWrapper:
    """Not an Optimizer at all (e.g. a trainer's own holder)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()

    def zero_grad(self):
        self.optimizer.zero_grad()


@pytest.mark.parametrize(
    "wrap",
    [AcceleratedOptimizerStandIn, lambda o: AcceleratedOptimizerStandIn(AcceleratedOptimizerStandIn(o)),
     lambda o: PlainWrapper(AcceleratedOptimizerStandIn(o)), lambda o: [AcceleratedOptimizerStandIn(o)]],
    ids=["accelerated", "nested", "plain-of-accelerated", "list"],
)
def test_scale_loss_unwraps_optimizer_wrappers(wrap):
    expected_model, expected_opt = _initialized("O2")
    train_steps(expected_model, expected_opt, range(3), inject_inf=lambda s: s == 1)

    model, opt = _initialized("O2")
    wrapped = wrap(opt)
    handle = wrapped[0] if isinstance(wrapped, list) else wrapped
    for step in range(3):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        if step == 1:
            loss = loss * math.inf
        handle.zero_grad()
        with amp.scale_loss(loss, wrapped) as scaled:
            scaled.backward()
        handle.step()
    for a, b in zip(model.parameters(), expected_model.parameters()):
        assert torch.equal(bits(a), bits(b))


def test_scale_loss_with_a_wrapper_of_no_optimizer_names_the_problem():
    model, _ = _initialized("O1")
    x, y = batch(0)
    loss = F.cross_entropy(model(x), y)
    with pytest.raises(TypeError, match=r"amp.scale_loss: expected an optimizer.*\.optimizer"), \
            amp.scale_loss(loss, PlainWrapper(object())):
        pass


# ------------------------------------------------------------------------------------------- option errors
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"loss_scale": 1e39}, r"loss_scale=1e\+39 is out of range.*\(0, 3.4028235e\+38\]"),
        ({"loss_scale": 2**200}, r"loss_scale=1.6\d*e\+60 is out of range"),
        ({"loss_scale": 10**400}, r"loss_scale=inf is out of range"),
        ({"loss_scale": "nan"}, r"loss_scale=nan is out of range"),
        ({"min_loss_scale": -1.0}, r"min_loss_scale=-1.0 is out of range.*None for no floor"),
        ({"min_loss_scale": float("nan")}, r"min_loss_scale=nan is out of range"),
        ({"max_loss_scale": 1e39}, r"max_loss_scale=1e\+39 is out of range.*None for no cap"),
        ({"max_loss_scale": 0.0}, r"max_loss_scale=0.0 is out of range"),
        ({"min_loss_scale": 4.0, "max_loss_scale": 2.0}, r"min_loss_scale=4.0 is larger than max_loss_scale=2.0"),
        ({"scale_window": 0}, r"scale_window must be a positive integer.*scale_window=0"),
        ({"scale_window": 2.5}, r"scale_window must be a positive integer"),
        ({"scale_window": "100"}, r"scale_window must be a positive integer"),
        ({"hysteresis": 0}, r"hysteresis must be a positive integer.*hysteresis=0"),
        ({"hysteresis": True}, r"hysteresis must be a positive integer"),
        ({"keep_batchnorm_fp32": "yes"}, r"keep_batchnorm_fp32 must be a boolean.*keep_batchnorm_fp32=yes"),
        ({"master_weights": "False"}, r"master_weights must be True, False or None.*'False'"),
        ({"master_weights": 1}, r"master_weights must be True, False or None"),
        ({"cast_model_type": "float16"}, r"cast_model_type must be a floating torch.dtype"),
        ({"cast_model_outputs": torch.int32}, r"cast_model_outputs must be a floating torch.dtype"),
    ],
)
def test_bad_option_values_name_the_option_and_leave_the_model_untouched(kwargs, needle):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((ValueError, RuntimeError), match=needle):
        amp.initialize(model, opt, opt_level="O2", verbosity=0, **kwargs)
    assert all(p.dtype == F32 and torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert not hasattr(opt, "_amp_stash")
    amp.initialize(model, opt, opt_level="O2", verbosity=0)  # the same model and optimizer still initialize


def test_min_loss_scale_above_the_default_start_raises_the_first_scale():
    _, opt = _initialized("O2", min_loss_scale=2.0**20)
    assert opt._amp_stash.session.scalers[0].get_scale() == 2.0**20
