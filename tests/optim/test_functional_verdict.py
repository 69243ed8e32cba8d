"""The functional steps' remembered list checks (``fp16kit/optim/functional.py``, ``_check_lists``): a repeated
call with tensors of the same metadata skips the per-tensor checks; anything they could reject is checked again,
with the same messages."""

from __future__ import annotations

import pytest
import torch

import fp16kit.optim.functional as F
from fp16kit.optim import adam_step_, lamb_step_


def _lists(n=4, dtype=torch.float32):
    torch.manual_seed(0)
    ps = [torch.randn(3, 2, dtype=dtype) for _ in range(n)]
    gs = [torch.randn(3, 2, dtype=dtype) for _ in range(n)]
    state = torch.float64 if dtype == torch.float64 else torch.float32
    ms = [torch.zeros(3, 2, dtype=state) for _ in range(n)]
    vs = [torch.zeros(3, 2, dtype=state) for _ in range(n)]
    return ps, gs, ms, vs


@pytest.fixture
def full_checks(monkeypatch):
    calls = []
    real = F._check_tensor_lists

    def counting(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(F, "_check_tensor_lists", counting)
    F._verdicts.clear()
    return calls


@pytest.mark.parametrize("fn", [adam_step_, lamb_step_])
def test_repeated_calls_check_once_and_match(fn, full_checks):
    ps, gs, ms, vs = _lists()
    ref = _lists()
    step, ref_step = torch.zeros(1), torch.zeros(1)
    for _ in range(3):
        gs = [torch.randn(3, 2) for _ in ps]  # new grads every call, same metadata
        fn(ps, gs, ms, vs, step=step)
        F._verdicts.clear()  # the reference checks every call
        fn(ref[0], [g.clone() for g in gs], ref[2], ref[3], step=ref_step)
    assert full_checks.count(fn.__name__) == 4  # 1 for the first call, 3 for the reference
    for a, b in zip(ps + ms + vs, ref[0] + ref[2] + ref[3]):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("edit", "error", "match"),
    [
        ("grad_shape", ValueError, r"params\[1\] has shape \(3, 2\) but grads\[1\] has shape \(6,\)"),
        ("moment_dtype", TypeError, r"exp_avgs\[2\]/exp_avg_sqs\[2\] are torch.float64/torch.float32"),
        ("grad_int", TypeError, r"grads\[0\] has dtype torch.int32"),
        ("not_tensor", TypeError, r"grads\[3\] is a float"),
        ("fewer", ValueError, r"params has 4 tensors but grads has 3"),
        ("single_tensor", TypeError, r"grads must be a list of tensors, got a single tensor"),
        ("model_shape", ValueError, r"model_params\[0\] has shape \(2, 3\), params\[0\] \(3, 2\)"),
    ],
)
def test_bad_lists_after_a_remembered_verdict_raise_the_same_errors(edit, error, match):
    ps, gs, ms, vs = _lists()
    models = [p.half() for p in ps]
    adam_step_(ps, gs, ms, vs, step=torch.zeros(1), model_params=models)
    adam_step_(ps, gs, ms, vs, step=torch.zeros(1), model_params=models)
    if edit == "grad_shape":
        gs[1] = torch.randn(6)
    elif edit == "moment_dtype":
        ms[2] = torch.zeros(3, 2, dtype=torch.float64)
    elif edit == "grad_int":
        gs[0] = torch.ones(3, 2, dtype=torch.int32)
    elif edit == "not_tensor":
        gs[3] = 1.0
    elif edit == "fewer":
        gs = gs[:3]
    elif edit == "single_tensor":
        gs = torch.randn(4, 3, 2)
    else:
        models[0] = torch.zeros(2, 3, dtype=torch.float16)
    with pytest.raises(error, match=match):
        adam_step_(ps, gs, ms, vs, step=torch.zeros(1), model_params=models)
