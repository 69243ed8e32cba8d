"""What initialize does to models: dtypes of params/grads/outputs under O0-O3 (with batchnorm), input and
output casts, fp32 state_dict, return shapes, and the model errors."""

from __future__ import annotations

import copy

import pytest
import torch
from frontend_helpers import batch, make_model, roundtrip
from torch import nn
from torch.nn import functional as F

from fp16kit import amp

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16

# opt level -> (linear weight dtype, batchnorm weight dtype, optimizer param dtype)
EXPECTED = {
    "O0": (F32, F32, F32),
    "O1": (F32, F32, F32),
    "O2": (F16, F32, F32),  # optimizer holds fp32 masters
    "O3": (F16, F16, F16),
}


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_dtypes_of_params_grads_outputs(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    lin_dtype, bn_dtype, opt_dtype = EXPECTED[level]
    linear, bn = model[0], model[1]
    assert linear.weight.dtype == lin_dtype and linear.bias.dtype == lin_dtype
    assert bn.weight.dtype == bn_dtype and bn.running_mean.dtype == bn_dtype and bn.running_var.dtype == bn_dtype
    assert {p.dtype for p in amp.master_params(opt)} == {opt_dtype, bn_dtype} - ({F16} if level == "O2" else set())

    x, y = batch(0)  # fp32 input: cast on the way in under O2/O3
    out = model(x)
    assert out.dtype == F32  # outputs come back fp32 at every level
    loss = F.cross_entropy(out, y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == F32 and scaled.dim() == 0
        scaled.backward()
    for p in model.parameters():  # model grads in the model's dtype
        assert p.grad.dtype == p.dtype
    for p in amp.master_params(opt):  # grads the optimizer sees match the params it updates
        assert p.grad is not None and p.grad.dtype == p.dtype
    opt.step()


def test_o1_runs_the_policy_inside_forward_only():
    model = make_model(batchnorm=False)
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.__setitem__("linear", o.dtype))
    model = amp.initialize(model, opt_level="O1", verbosity=0)
    x, _ = batch(0)
    out = model(x)
    assert seen["linear"] == F16  # linear is a LOW op
    assert out.dtype == F32  # the low-precision output is handed back as fp32
    assert (x @ x.T).dtype == F32  # outside the model's forward nothing is cast


def test_o1_cast_model_outputs_keeps_fp16():
    model = amp.initialize(make_model(batchnorm=False), opt_level="O1", cast_model_outputs=F16, verbosity=0)
    assert model(batch(0)[0]).dtype == F16


def test_o2_cast_model_outputs_and_input_containers():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, inputs, idx, *, extra):
            assert inputs["x"].dtype == F16 and extra[0].dtype == F16
            assert idx.dtype == torch.int64  # integer tensors are never cast
            return {"out": self.lin(inputs["x"]) + extra[0], "idx": idx}

    model = amp.initialize(Net(), opt_level="O2", cast_model_outputs=BF16, verbosity=0)
    x = torch.randn(2, 8)
    out = model({"x": x}, torch.arange(2), extra=(torch.zeros(2, 4),))
    assert out["out"].dtype == BF16 and out["idx"].dtype == torch.int64


def test_o2_input_namedtuple_and_custom_batch_objects():
    from collections import namedtuple

    Pair = namedtuple("Pair", "x mask")

    class Batch:  # apex casts custom batch classes through their .to()
        def __init__(self, x):
            self.x = x

        def to(self, dtype):
            return Batch(self.x.to(dtype))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, pair, extra):
            assert isinstance(pair, Pair) and pair.x.dtype == F16 and pair.mask.dtype == torch.bool
            assert extra.x.dtype == F16
            return self.lin(pair.x + extra.x)

    model = amp.initialize(Net(), opt_level="O2", verbosity=0)
    out = model(Pair(torch.randn(2, 8), torch.ones(2, dtype=torch.bool)), Batch(torch.randn(2, 8)))
    assert out.dtype == F32


def test_o2_state_dict_is_fp32_and_loads_back():
    model = amp.initialize(make_model(), opt_level="O2", verbosity=0)
    sd = model.state_dict()
    assert all(v.dtype in (F32, torch.int64) for v in sd.values())
    assert model[0].state_dict()["weight"].dtype == F32  # submodules too
    assert model[0].weight.dtype == F16  # the model itself stays fp16
    fresh = amp.initialize(make_model(seed=1), opt_level="O2", verbosity=0)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_keep_batchnorm_fp32_false_casts_batchnorm():
    model = amp.initialize(make_model(), opt_level="O2", keep_batchnorm_fp32=False, verbosity=0)
    assert model[1].weight.dtype == F16
    assert model(batch(0)[0]).dtype == F32


def test_bf16_low_precision_dtype():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=BF16, verbosity=0)
    assert model[0].weight.dtype == BF16 and model[1].weight.dtype == F32
    x, y = batch(0)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    assert model[0].weight.grad.dtype == BF16
    opt.step()
    master = next(iter(amp.master_params(opt)))
    assert master.dtype == F32 and torch.equal(master.to(BF16), model[0].weight)


def test_bf16_o1_policy_dtype():
    model = make_model(batchnorm=False)
    seen = {}
    model[0].register_forward_hook(lambda m, i, o: seen.__setitem__("linear", o.dtype))
    model = amp.initialize(model, opt_level="O1", low_precision_dtype=BF16, verbosity=0)
    model(batch(0)[0])
    assert seen["linear"] == BF16


def test_return_values_mirror_inputs():
    def fresh():
        m = make_model()
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    m, o = fresh()
    assert amp.initialize(m, verbosity=0) is m
    m, o = fresh()
    rm, ro = amp.initialize(m, o, verbosity=0)
    assert rm is m and ro is o
    (m1, o1), (m2, o2) = fresh(), fresh()
    rms, ro = amp.initialize([m1, m2], o1, verbosity=0)
    assert isinstance(rms, list) and rms == [m1, m2] and ro is o1
    (m1, o1), (m2, o2) = fresh(), fresh()
    rm, ros = amp.initialize(m1, [o1, o2], verbosity=0)
    assert rm is m1 and ros == [o1, o2]
    (m1, o1), (m2, o2) = fresh(), fresh()
    rms = amp.initialize([m1, m2], verbosity=0)
    assert rms == [m1, m2]
    m, o = fresh()
    assert amp.initialize(m, o, enabled=False) == (m, o)
    assert amp.initialize(m, enabled=False) is m


def test_disabled_is_a_pass_through():
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level="O2", enabled=False)
    assert m[0].weight.dtype == F32
    loss = F.cross_entropy(m(batch(0)[0]), batch(0)[1])
    with amp.scale_loss(loss, o) as scaled:
        assert scaled is loss


@pytest.mark.parametrize("wrapper", ["dp", "ddp"])
def test_parallel_wrapped_model_is_an_error(wrapper, monkeypatch):
    model = make_model()
    if wrapper == "dp":
        wrapped = nn.DataParallel(model)
        name = "torch.nn.parallel.DataParallel"
    else:  # an instance without a process group: isinstance is all that matters
        wrapped = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
        nn.Module.__init__(wrapped)
        name = "torch.nn.parallel.DistributedDataParallel"
    with pytest.raises(RuntimeError, match=f"Incoming model is an instance of {name}. Parallel wrappers should only"):
        amp.initialize(wrapped, verbosity=0)


def test_half_model_and_second_initialize_of_a_model_are_errors():
    with pytest.raises(RuntimeError, match=r"you do not need to call \.half"):
        amp.initialize(make_model().half(), opt_level="O2", verbosity=0)
    model = amp.initialize(make_model(), opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match=r"already passed through amp\.initialize"):
        amp.initialize(model, opt_level="O1", verbosity=0)


def test_wrong_types():
    with pytest.raises(TypeError, match="models must be"):
        amp.initialize("model", verbosity=0)
    with pytest.raises(TypeError, match="optimizers must be"):
        amp.initialize(make_model(), optimizers=["not an optimizer"], verbosity=0)


def test_deepcopy_of_an_initialized_model_is_independent():
    model = amp.initialize(make_model(), opt_level="O2", verbosity=0)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone[0].weight.zero_()
    x = batch(0)[0]
    assert clone(x).dtype == F32
    assert not torch.equal(clone(x), model(x))
    assert model[0].weight.abs().sum() > 0


def test_o1_model_pickles_and_runs_in_dataparallel_threads():
    model = amp.initialize(make_model(batchnorm=False), opt_level="O1", verbosity=0)
    clone = roundtrip(model)  # torch.save of the whole module, hooks included
    x = batch(0)[0]
    assert torch.equal(clone(x), model(x))
    # DataParallel on CPU runs the module directly; on CUDA its replicas share these hooks across threads
    assert nn.DataParallel(model)(x).dtype == F32
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: model(x), range(8)))
    assert all(torch.equal(o, clone(x)) for o in outs)
