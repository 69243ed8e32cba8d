"""``amp.autocast`` with ``torch.autocast``'s signature, beside ``torch.autocast`` on the same calls; the scope of
``policy_override``; ``fp16kit.amp.autocast_mode`` reachable as docs/autocast.md writes it (docs/autocast.md,
"torch.autocast's signature")."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F

import fp16kit.amp
from fp16kit import amp
from fp16kit.amp.autocast_mode import AutocastDisabledWarning

NO_CUDA = not torch.cuda.is_available()

#: (args, kwargs) of calls both accept; the ops are rows where fp16kit's table and torch's CPU table agree
CALLS = [
    (("cpu",), {}),
    (("cpu", torch.float16), {}),
    (("cpu",), {"dtype": torch.bfloat16, "enabled": True, "cache_enabled": False}),
    (("cpu",), {"enabled": False}),
    ((), {"device_type": "cpu", "dtype": torch.float16}),
    (("cpu", torch.bfloat16, True, True), {}),
]


def _ops() -> list[torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    y = F.linear(x, w)
    return [y, x @ w, torch.mm(x, w), F.linear(x, w)]  # twice: the second use of w may hit the weight cache


@pytest.mark.parametrize(("args", "kwargs"), CALLS, ids=[repr(c) for c in CALLS])
def test_torch_signature_does_what_torch_autocast_does(args, kwargs):
    with torch.autocast(*args, **kwargs):
        ref = _ops()
        ref_state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    with amp.autocast(*args, **kwargs) as region:
        got = _ops()
        state = (amp.is_autocast_enabled(), region.dtype)
    assert state == ref_state
    for a, b in zip(ref, got, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("call", ["cpu fp32", "cuda without CUDA"])
def test_where_torch_disables_its_region_so_does_amp_with_a_warning_naming_the_fix(call):
    if call == "cuda without CUDA" and not NO_CUDA:
        pytest.skip("needs a machine without CUDA")
    args = ("cpu", torch.float32) if call == "cpu fp32" else ("cuda", torch.float16)
    with pytest.warns(UserWarning), torch.autocast(*args):
        ref = _ops()
    fix = r"dtype=torch\.float16 or dtype=torch\.bfloat16" if call == "cpu fp32" else r"amp\.autocast\('cpu'"
    with pytest.warns(AutocastDisabledWarning, match=fix), amp.autocast(*args):
        assert not amp.is_autocast_enabled()
        got = _ops()
    for a, b in zip(ref, got, strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


def test_signature_mistakes_say_what_to_write():
    with pytest.raises(TypeError, match=r"dtype is given twice.*autocast\(dtype=torch\.float16\)"):
        amp.autocast(torch.bfloat16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"no autocast for device type 'tpu'.*autocast\('cuda', \.\.\.\)"):
        amp.autocast("tpu")
    with pytest.raises(RuntimeError, match="tpu"):
        torch.autocast("tpu")  # torch refuses it too, without saying what to write
    with pytest.raises(ValueError, match="expected a str"):
        amp.autocast(3)
    # fp16kit's own forms are unchanged
    assert amp.autocast().dtype == torch.float16 and amp.autocast(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"must be torch\.float16 or torch\.bfloat16"):
        amp.autocast(dtype=torch.float32)


def test_torch_signature_as_a_decorator():
    @amp.autocast("cpu", dtype=torch.float16)
    def f(x, w):
        return x @ w, (x @ w).softmax(-1)

    y, s = f(torch.randn(2, 3), torch.randn(3, 3))
    assert (y.dtype, s.dtype) == (torch.float16, torch.float32)


def test_policy_override_is_process_wide():
    """``policy_override`` changes the one table every thread reads (documented in its docstring and
    docs/autocast.md): a region on another thread sees the override while the block is open, and not after."""
    entered, release, seen = threading.Event(), threading.Event(), {}

    def other_thread():
        entered.wait(10)
        with amp.autocast(dtype=torch.bfloat16):
            seen["during"] = torch.randn(2, 4).softmax(-1).dtype  # FP32 row, overridden to LOW below
        release.set()

    t = threading.Thread(target=other_thread)
    t.start()
    with amp.policy_override({"softmax": "low"}):
        entered.set()
        assert release.wait(30)
    t.join(30)
    with amp.autocast(dtype=torch.bfloat16):
        after = torch.randn(2, 4).softmax(-1).dtype
    assert seen["during"] == torch.bfloat16 and after == torch.float32


def test_autocast_mode_is_reachable_without_importing_it():
    """``fp16kit.amp.autocast_mode.set_engine("mode")``, as docs/autocast.md writes it, after ``import fp16kit``."""
    module = fp16kit.amp.autocast_mode
    del fp16kit.amp.autocast_mode  # as in a fresh interpreter where nothing imported the submodule yet
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert fp16kit.amp.autocast_mode.set_engine is module.set_engine
            assert "autocast_mode" in dir(fp16kit.amp)
    finally:
        fp16kit.amp.autocast_mode = module
