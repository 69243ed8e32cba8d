"""The LAMB/Adam Triton kernels (under the interpreter, and on a GPU when there is one), the torch fallback's
device-side skip, and the functional API.

Interpreter tests use a few thousand elements: one program instance costs ~20 ms there. The tensor of 4100
elements spans two 4096-element chunks, so per-tensor norms are reduced across chunks and programs.
"""

from __future__ import annotations

import pytest
import torch
from optim_helpers import (
    adam_step_and_check,
    assert_same_bits,
    bits,
    clone_params,
    lamb_step_and_check,
    make_params,
    set_grads,
)

from fp16kit.kernels import use_backend
from fp16kit.kernels.fallback import adam as fb_adam
from fp16kit.kernels.fallback import lamb as fb_lamb
from fp16kit.optim import FusedAdam, FusedLAMB, adam_step_, lamb_step_
from fp16kit.optim import functional as F

SHAPES = [(300,), (4100,), (3, 7)]


# ------------------------------------------------------------------------------------- Triton interpreter


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("dtype", "adam_w_mode", "master", "max_grad_norm"),
    [(torch.float32, True, False, 0.0), (torch.float16, False, False, 1.0), (torch.bfloat16, True, True, 0.0)],
)
def test_lamb_kernels_match_reference_and_fallback(dtype, adam_w_mode, master, max_grad_norm):
    params = make_params(SHAPES, dtype, 1, grad_scale=4.0)  # the clip triggers unless max_grad_norm = 0
    twin = clone_params(params)
    kw = {"lr": 0.01, "weight_decay": 0.01, "adam_w_mode": adam_w_mode, "master_weights": master}
    kw["max_grad_norm"] = max_grad_norm
    opt, fb = FusedLAMB(params, **kw), FusedLAMB(twin, **kw)
    for k in range(2):
        lamb_step_and_check(opt)  # Triton kernels (interpreter)
        with use_backend("torch"):  # torch fallback: the same reference, the same budget
            lamb_step_and_check(fb)
        set_grads(params, 10 + k)
        set_grads(twin, 10 + k)


@pytest.mark.interpreter
def test_lamb_kernel_skips_on_found_inf_and_nvlamb_without_decay():
    params = make_params(SHAPES[:2], torch.float32, 2)
    opt = FusedLAMB(params, lr=0.01, weight_decay=0.0, use_nvlamb=True)
    lamb_step_and_check(opt)
    params[1].grad[4097] = float("nan")  # in the second chunk of the second tensor
    before = bits(opt, params)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert_same_bits(bits(opt, params), before)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    ("dtype", "adam_w_mode", "master"), [(torch.float32, False, False), (torch.bfloat16, True, True)]
)
def test_adam_kernel_matches_reference_and_fallback(dtype, adam_w_mode, master):
    params = make_params(SHAPES, dtype, 3)
    twin = clone_params(params)
    kw = {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": adam_w_mode, "master_weights": master}
    opt, fb = FusedAdam(params, **kw), FusedAdam(twin, **kw)
    for k in range(2):
        adam_step_and_check(opt, adam_w_mode=adam_w_mode)  # Triton kernel (interpreter)
        with use_backend("torch"):  # torch fallback (torch.optim.Adam's foreach sequence): same reference
            adam_step_and_check(fb, adam_w_mode=adam_w_mode)
        set_grads(params, 20 + k)
        set_grads(twin, 20 + k)


@pytest.mark.interpreter
def test_mixed_rows_kernel_and_fallback_in_one_step():
    """fp32 + fp16 params (two launches) and a non-contiguous param (torch fallback) in one step."""
    a = make_params([(200,)], torch.float32, 4)
    b = make_params([(50,)], torch.float16, 5)
    c = torch.nn.Parameter(torch.randn(6, 5).t())  # a transposed leaf: not contiguous
    c.grad = torch.randn(5, 6)
    opt = FusedLAMB(a + b + [c], lr=0.01)
    for k in range(2):
        lamb_step_and_check(opt)
        set_grads(a + b + [c], 30 + k)


# ------------------------------------------------------------------------------- fallback device-side skip


@pytest.mark.parametrize("kind", ["lamb", "adam"])
def test_fallback_masked_commit(kind):
    """The path used off-CPU (torch.where commits, no host read): a set flag keeps every bit even with NaN
    grads; a clear flag gives exactly the host-branch result."""
    params = make_params([(9,), (2, 3)], torch.float16, 6)
    masters = [p.detach().float() for p in params]
    grads = [p.grad for p in params]
    step_fn = fb_lamb.lamb_ if kind == "lamb" else fb_adam.adam_
    hp = torch.tensor([0.01, 0.9, 0.999, 0.1, 0.001, 1e-6, 0.01, 0.1, 0.001, 1.0, 1.0])
    modes = {"l2_mode": False, "decoupled": True} | ({"trust": True} if kind == "lamb" else {})

    def run(flag, host_branch, grads):
        ms = [m.clone() for m in masters]
        ps = [p.detach().clone() for p in params]
        st = [torch.full_like(m, 0.5) for m in ms], [torch.full_like(m, 0.25) for m in ms]
        step_fn(ms, grads, *st, ps, hp, torch.tensor([flag]), **modes, host_branch=host_branch)
        return ms + ps + st[0] + st[1]

    nan_grads = [torch.full_like(g, float("nan")) for g in grads]
    host_result = run(0.0, True, grads)
    skipped = run(1.0, False, nan_grads)
    assert_same_bits(skipped[: len(masters)], masters)
    assert_same_bits(skipped[len(masters) : 2 * len(masters)], [p.detach() for p in params])
    # The host path uses fused foreach forms (alpha-add, addcmul_, lerp_, addcdiv_) of the same math: the two
    # differ by a few fp32 roundings (<= 8 ulp here, no cancellation in these values) and the fp16 model
    # copies by at most one fp16 rounding step.
    for a, b in zip(run(0.0, False, grads), host_result):
        torch.testing.assert_close(a, b, rtol=8 * 2.0**-24 if a.dtype == torch.float32 else 2.0**-10, atol=0)


# ------------------------------------------------------------------------------------------ functional API


def test_functional_lamb_equals_class():
    params = make_params([(12,), (3, 4)], torch.bfloat16, 7)
    twin = clone_params(params)
    opt = FusedLAMB(params, lr=0.02, master_weights=True)
    masters = [p.detach().float() for p in twin]
    m = [torch.zeros_like(x) for x in masters]
    v = [torch.zeros_like(x) for x in masters]
    step = torch.zeros(1)
    for k in range(3):
        opt.step()
        flag = lamb_step_(masters, [p.grad for p in twin], m, v, step=step, lr=torch.tensor(0.02), model_params=twin)
        assert float(flag) == 0.0
        set_grads(params, k)
        set_grads(twin, k)
    assert_same_bits([p.detach() for p in twin] + masters + m + v, [p.detach() for p in params] + bits_of(opt))
    assert float(step) == 3.0


def bits_of(opt):
    ps = [p for g in opt.param_groups for p in g["params"]]
    return (
        [opt.state[p]["master"] for p in ps]
        + [opt.state[p]["exp_avg"] for p in ps]
        + [opt.state[p]["exp_avg_sq"] for p in ps]
    )


def test_functional_adam_scaled_and_skipping():
    params = make_params([(10,)], torch.float32, 8)
    twin = clone_params(params)
    opt = FusedAdam(params, lr=0.01, weight_decay=0.01)
    opt.step()
    p = [twin[0].detach()]
    m, v, step = [torch.zeros(10)], [torch.zeros(10)], torch.zeros(1)
    adam_step_(p, [twin[0].grad * 64], m, v, step=step, lr=0.01, weight_decay=0.01, inv_scale=1 / 64)
    assert_same_bits(
        p + m + v, [params[0].detach(), opt.state[params[0]]["exp_avg"], opt.state[params[0]]["exp_avg_sq"]]
    )
    before = [t.clone() for t in p + m + v + [step]]
    flag = adam_step_(p, [torch.full((10,), float("inf"))], m, v, step=step)
    assert float(flag) == 1.0
    assert_same_bits(p + m + v + [step], before)


def test_functional_bad_input():
    p, g = [torch.zeros(4)], [torch.zeros(4)]
    m, v = [torch.zeros(4)], [torch.zeros(4)]
    with pytest.raises(TypeError, match="step must be a one-element floating tensor"):
        lamb_step_(p, g, m, v, step=1)
    with pytest.raises(TypeError, match=r"optimizer state must be torch\.float32"):
        lamb_step_(p, g, [torch.zeros(4, dtype=torch.float16)], v, step=torch.zeros(1))
    with pytest.raises(ValueError, match="they must pair up"):
        adam_step_(p, g + g, m, v, step=torch.zeros(1))
    with pytest.raises(ValueError, match="model_params has 2 entries"):
        adam_step_(p, g, m, v, step=torch.zeros(1), model_params=[None, None])
    with pytest.raises(ValueError, match="beta1"):
        adam_step_(p, g, m, v, step=torch.zeros(1), betas=(1.0, 0.9))
    with pytest.raises(TypeError, match="single tensor"):
        adam_step_(p[0], g, m, v, step=torch.zeros(1))


def test_clip_factor_rule():
    assert float(F.clip_factor(torch.tensor(3.0), 1.5)) == 2.0
    assert float(F.clip_factor(torch.tensor(1.0), 1.5)) == 1.0
    assert float(F.clip_factor(torch.tensor(3.0), 0.0)) == 1.0  # max_grad_norm = 0 disables clipping


# --------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_lamb_matches_reference_without_sync(dtype):
    params = [torch.nn.Parameter(p.detach().cuda()) for p in make_params([(1000,), (70000,), (33, 9)], dtype, 9)]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    opt = FusedLAMB(params, lr=0.01, master_weights=dtype != torch.float32)
    lamb_step_and_check(opt)
    opt.grad_scale, opt.found_inf = torch.full((1,), 1.0, device="cuda"), torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()  # a warm step under a scaler: no host sync anywhere
    finally:
        torch.cuda.set_sync_debug_mode("default")
    del opt.grad_scale, opt.found_inf
    lamb_step_and_check(opt)


@pytest.mark.gpu
def test_gpu_adam_matches_torch_fused_adamw():
    base = make_params([(4096,), (513, 7)], torch.float32, 10)
    ours = [torch.nn.Parameter(p.detach().cuda()) for p in base]
    theirs = [torch.nn.Parameter(p.detach().cuda()) for p in base]
    for p, q, b in zip(ours, theirs, base):
        p.grad, q.grad = b.grad.cuda(), b.grad.cuda()
    opt = FusedAdam(ours, lr=0.01, weight_decay=0.01)
    ref = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.01, fused=True)
    opt.step()
    ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=8 * 2.0**-24, atol=1e-9)


@pytest.mark.gpu
def test_gpu_bf16_model_copy_is_rtne():
    params = [torch.nn.Parameter(torch.randn(9000, device="cuda").bfloat16())]
    params[0].grad = torch.randn_like(params[0])
    opt = FusedAdam(params, master_weights=True)
    opt.step()
    assert torch.equal(params[0].detach(), opt.state[params[0]]["master"].bfloat16())


# ------------------------------------------------------------------------------------ native CPU kernel


@pytest.fixture
def native():
    from fp16kit.kernels.fallback import lamb_native as _cpu_native

    if not _cpu_native.enable():  # builds once (~1 min), then loads from torch's extension cache
        pytest.skip("the native CPU LAMB kernel cannot be built here (no C++ compiler or ninja)")
    yield _cpu_native
    _cpu_native.enable(False)


@pytest.mark.slow
def test_native_cpu_lamb_matches_reference_and_skips(native):
    params = make_params([(300,), (20000,), (3, 7)], torch.float32, 12, grad_scale=3.0)
    opt = FusedLAMB(params, lr=0.01, weight_decay=0.01, adam_w_mode=False)
    for k in range(3):
        assert native.takes_grads([p.grad for p in params])
        lamb_step_and_check(opt)
        set_grads(params, 40 + k, scale=0.1 if k else 3.0)  # the clip triggers on the first step only
    params[1].grad[12345] = float("nan")
    before = bits(opt, params)
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step()
    assert_same_bits(bits(opt, params), before)
