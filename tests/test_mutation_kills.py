"""Tests that kill the mutants of round 3's code which the other tests let live (scripts/mutation.py; the ids and
the survivors judged equivalent are in docs/guarantees.md, "Mutation testing"). Each test names what it pins; the
comment above it names the mutant ids (``file:line:col:operator``) it kills."""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import Bf16Weights, DeviceStep, copy_, step_check, use_backend
from fp16kit.kernels.bf16_weights.modes import (
    PLAIN,
    SPLIT,
    STOCHASTIC,
    Epilogue,
    epilogue_mode,
    launch_arguments,
    low_rows,
    philox_uint32,
    round_with_bits,
    row_table,
    stochastic_round,
    stochastic_round_list,
)
from fp16kit.kernels.engine.step_scalars import StepFlags
from fp16kit.optim import FusedAdam, FusedSGD


def _on_both_backends(run):
    """``run()`` under the Triton interpreter (the device step) and under the torch fallback (the host step)."""
    out = {}
    for backend in ("auto", "torch"):
        with use_backend(backend):
            out[backend] = run()
    return out


def _two_steps_agree(make):
    """Two steps of ``make()``'s ``(optimizer, param)`` on each backend: both count 2 steps and leave the param the
    same, bit for bit."""

    def run():
        opt, p = make()
        opt.step()
        opt.step()
        return float(opt.param_groups[0]["step"]), p.detach().clone()

    out = _on_both_backends(run)
    assert out["auto"][0] == out["torch"][0] == 2.0 and torch.equal(out["auto"][1], out["torch"][1])


# fp16kit/kernels/bf16_weights/modes.py:116:4:return_none, :116:71:const_int (epilogue_mode)
def test_epilogue_constexprs_and_launch_arguments_of_each_mode():
    bf, fp = [torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(3)]
    assert epilogue_mode(None, bf, True) == PLAIN.value
    assert epilogue_mode(Bf16Weights("split"), bf, True) == SPLIT.value
    assert epilogue_mode(Bf16Weights("split"), bf, False) == PLAIN.value  # no low halves: written plainly
    assert epilogue_mode(Bf16Weights("stochastic"), bf, False) == STOCHASTIC.value
    assert epilogue_mode(Bf16Weights("stochastic"), fp, False) == PLAIN.value  # fp32 params: updated directly
    step, spare, idx = torch.zeros(1), torch.empty(1), torch.zeros(2, dtype=torch.int64)
    args, const, model_row = launch_arguments(Bf16Weights("stochastic", 7, 3, step), bf, True, spare, idx)
    assert args[:2] == (7, 3) and args[2] is step and args[3] is idx
    assert const == {"EPILOGUE": Epilogue(WEIGHTS=STOCHASTIC.value, ROW_IDX=True)} and model_row is True
    args, const, model_row = launch_arguments(Bf16Weights("stochastic", 7, 3, step), bf, False, spare, None)
    assert args[3] is spare and const["EPILOGUE"].ROW_IDX is False and model_row is False
    args, const, model_row = launch_arguments(Bf16Weights("split", 7, 3, step), bf, True, spare, idx)
    assert args[:2] == (0, 0) and args[2] is spare and args[3] is spare  # split reads no random-bit arguments
    assert const == {"EPILOGUE": Epilogue(WEIGHTS=SPLIT.value, ROW_IDX=False)} and model_row is False  # row 4: halves
    args, const, model_row = launch_arguments(None, bf, True, spare, None)
    assert const == {"EPILOGUE": Epilogue(WEIGHTS=PLAIN.value, ROW_IDX=False)} and model_row is True
    assert row_table([2, 5], [0, 16], torch.device("cpu")).tolist() == [2, 0, 5, 16]
    lo = torch.tensor([-1, 7], dtype=torch.int16)
    none, view = low_rows([None, lo])
    assert none is None and view.dtype == torch.bfloat16 and view.data_ptr() == lo.data_ptr()
    assert Bf16Weights("stochastic", offsets=(0, 4096)).offset(1) == 4096 and Bf16Weights("split").offset(3) == 0


# fp16kit/kernels/engine/step_scalars.py:75:54:const_bool, :75:74:const_bool (the legacy layout's constexprs)
def test_a_host_vector_gives_placeholders_and_every_device_flag_off():
    hp = torch.zeros(11)
    ptr, scalars, flags = DeviceStep.arguments(hp, None, ("lr", "beta1"))
    assert ptr is hp and all(s is hp for s in scalars[:4]) and scalars[4:] == (0.0,) * 6
    assert list(flags) == ["STEP"] and flags["STEP"]._asdict() == dict.fromkeys(StepFlags._fields, False)


# fp16kit/kernels/optimizers.py:163:8:return_none, :163:15:const_bool (step_check with no grads)
def test_step_check_of_no_grads_does_nothing_and_says_so():
    flag = torch.full((1,), 5.0)
    assert step_check([], None, flag, None, own_flag=True) is False
    assert flag.item() == 5.0


# fp16kit/kernels/optimizers.py:162:7:unary_drop_Not (step_check: one kernel group is checked in one launch)
@pytest.mark.interpreter
def test_step_check_of_one_kernel_group_flags_and_norms_in_its_launch():
    grads = [torch.full((5,), 3.0), torch.full((7,), 4.0)]
    flag, norm = torch.full((1,), 9.0), torch.zeros(1)
    assert step_check(grads, None, flag, norm, own_flag=True) is True
    assert flag.item() == 0.0 and norm.item() == pytest.approx((45.0 + 112.0) ** 0.5, rel=1e-6)
    grads[1][3] = float("inf")
    assert step_check(grads, None, flag, None, own_flag=True) is True
    assert flag.item() == 1.0


# fp16kit/optim/_base.py:815:19:const_bool, :815:12:return_none, :817:12:return_none (_on_device)
@pytest.mark.interpreter
def test_a_compiled_step_never_takes_the_device_path(monkeypatch):
    opt = FusedAdam([torch.nn.Parameter(torch.zeros(4))])
    cpu = torch.device("cpu")
    assert opt._on_device(cpu) is True  # the interpreter's Triton kernels, no scaler
    with use_backend("torch"):
        assert opt._on_device(cpu) is False
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert opt._on_device(cpu) is False


# fp16kit/kernels/bf16_weights/modes.py:293:65:const_int (stochastic_round)
def test_stochastic_round_of_one_tensor_is_the_list_rule():
    x = torch.linspace(-3, 3, 37)
    step = torch.tensor([4.0])
    got = stochastic_round(x, 11, 2, 1, step)
    assert torch.equal(got.view(torch.int16), stochastic_round_list([x], 11, [2], 1, step)[0].view(torch.int16))


# fp16kit/optim/_base.py:878:16:stmt_delete (_step_on_device: a group without grads)
@pytest.mark.interpreter
def test_a_group_without_grads_counts_its_step_as_the_host_step_does():
    def run():
        a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
        a.grad = torch.ones(4)
        opt = FusedAdam([{"params": [a]}, {"params": [b]}], lr=0.1)
        opt.step()
        return [float(g["step"]) for g in opt.param_groups]

    out = _on_both_backends(run)
    assert out["auto"] == out["torch"]


# fp16kit/kernels/optimizers.py:210:12:stmt_delete (_lamb_or_adam: a device step whose rows all go to the fallback)
@pytest.mark.interpreter
def test_a_device_step_with_only_fallback_rows_still_advances_its_counter():
    def make():
        p = torch.nn.Parameter(torch.zeros(3, 5))
        p.grad = torch.ones(5, 3).t()  # not contiguous: the torch rows of the step
        return FusedAdam([p], lr=0.1), p

    _two_steps_agree(make)


# fp16kit/optim/_base.py:872:42:binop_Mult (_step_on_device: the torch check pass of several grad dtypes)
@pytest.mark.interpreter
def test_a_device_step_over_two_grad_dtypes_skips_a_grad_whose_square_overflows():
    def run():
        p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
        p.grad, q.grad = torch.full((4,), 3e19), torch.ones(4, dtype=torch.bfloat16)
        opt = FusedAdam([p, q], lr=0.1, on_nonfinite="skip")
        opt.step()
        return float(opt.param_groups[0]["step"]), p.detach().clone(), int(opt.nonfinite_skips)

    out = _on_both_backends(run)
    assert out["auto"][0] == out["torch"][0] == 0.0 and out["auto"][2] == out["torch"][2] == 1
    assert torch.equal(out["auto"][1], torch.zeros(4))


# fp16kit/kernels/optimizers.py:165:7:boolop_Or (step_check: a list the kernels take only in part)
@pytest.mark.interpreter
def test_step_check_leaves_a_list_with_fallback_rows_to_the_torch_passes():
    grads = [torch.ones(6), torch.ones(4, 3).t()]
    flag = torch.full((1,), 7.0)
    assert step_check(grads, None, flag, None, own_flag=True) is False
    assert flag.item() == 7.0


# fp16kit/kernels/optimizers.py:548:11:binop_Sub (_kernel_hps: the last launch advances the counter)
@pytest.mark.interpreter
def test_fused_sgd_device_step_advances_its_counter_like_the_torch_step():
    def make():
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.ones(4)
        return FusedSGD([p], lr=0.1, momentum=0.9), p

    _two_steps_agree(make)


# fp16kit/kernels/optimizers.py:229:57:const_int (_lamb_or_adam: version counters of the kernels' writes)
@pytest.mark.interpreter
def test_a_kernel_step_bumps_the_version_of_both_moments():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    opt = FusedAdam([p], lr=0.1)
    opt.step()
    m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
    before = (m._version, v._version)
    opt.step()
    assert m._version > before[0] and v._version > before[1]


# fp16kit/kernels/engine/rounding.py:30:35:const_int (round_to: torch's canonical bf16 NaN)
@pytest.mark.interpreter
def test_the_kernels_write_nan_as_the_canonical_bf16_nan():
    dst = torch.zeros(3, dtype=torch.bfloat16)
    copy_([dst], [torch.tensor([float("nan"), 1.0, -float("nan")])])
    assert dst.view(torch.int16).tolist() == [0x7FC0, 0x3F80, 0x7FC0]


# fp16kit/kernels/bf16_weights/modes.py:316:61:binop_RShift, :316:70:const_int (stochastic_round_list: which bits)
def test_each_element_takes_its_documented_sixteen_random_bits():
    n, seed, row, stream, step = 21, 5, 3, 2, torch.tensor([9.0])
    x = torch.linspace(-2, 2, n)
    e = torch.arange(n, dtype=torch.int64)
    words = philox_uint32(seed, e // 8, row, stream, 9)  # the counter of element e: (e // 8, row, stream, step)
    word = words.gather(1, ((e // 2) % 4)[:, None])[:, 0]
    r = ((word >> (16 * (e % 2))) & 0xFFFF).to(torch.int32)  # half e % 2 of word (e // 2) % 4
    want = round_with_bits(x, r)
    got = stochastic_round_list([x], seed, [row], stream, step)[0]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# fp16kit/kernels/engine/rounding.py:29:19:binop_Add, :29:26:const_int (round_to: ties go to the even mantissa)
@pytest.mark.interpreter
def test_the_kernels_round_exact_ties_to_even_as_torch_does():
    ties = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 2 + 2.0**-7, 1.5 + 2.0**-8, 1.0 + 2.0**-9, 3 * 2.0**-135]
    src = torch.tensor(ties + [-t for t in ties], dtype=torch.float32)
    dst = torch.zeros(len(src), dtype=torch.bfloat16)
    copy_([dst], [src])
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))


# fp16kit/kernels/engine/step_scalars.py:175:8:return_none (inv_scale64: a GradScaler's scale read on the device)
@pytest.mark.interpreter
def test_a_device_step_unscales_by_the_handed_over_scale_like_the_host_step():
    def run():
        p = torch.nn.Parameter(torch.ones(8))
        p.grad = torch.linspace(-4, 4, 8)
        opt = FusedAdam([p], lr=0.1)
        opt.grad_scale, opt.found_inf = torch.full((1,), 8.0), torch.zeros(1)
        opt.step()
        return p.detach().clone()

    out = _on_both_backends(run)
    assert torch.equal(out["auto"], out["torch"])


# fp16kit/amp/_dispatch.py:195:39:cmp_negate_Eq (_desired: which callable names an op in messages)
def test_each_overridden_op_is_named_by_the_best_ranked_callable_of_its_row():
    from fp16kit.amp import _dispatch, policy

    several = 0
    for name, ((_rule, _inplace, row), shown) in _dispatch._desired().items():
        base = name.partition(".")[0]
        rank = [_dispatch._rank(fn, base.endswith("_")) for fn, (_r, _i, r) in policy.RESOLVED.items()
                if r == row and base in _dispatch._aten_bases(fn)]
        several += len(set(rank)) > 1
        assert _dispatch._rank(shown, base.endswith("_")) == min(rank), name
    assert several  # some op is reached by callables of different ranks (the rule is exercised)


# fp16kit/kernels/engine/step_scalars.py:159:27:const_float_x2 (bias_correction64 without bias correction)
@pytest.mark.interpreter
def test_a_device_step_without_bias_correction_equals_the_host_step():
    def run():
        p = torch.nn.Parameter(torch.ones(8))
        p.grad = torch.linspace(-1, 1, 8)
        opt = FusedAdam([p], lr=0.1, bias_correction=False)
        opt.step()
        return p.detach().clone()

    out = _on_both_backends(run)
    assert torch.equal(out["auto"], out["torch"]) and not torch.equal(out["auto"], torch.ones(8))


# fp16kit/optim/_base.py:898:30:cmp_negate_NotEq (_counter: one counter per device, kept across steps)
@pytest.mark.interpreter
def test_a_device_step_counts_every_skipped_step():
    def run():
        p = torch.nn.Parameter(torch.zeros(4))
        opt = FusedAdam([p], lr=0.1, on_nonfinite="skip")
        for _ in range(3):
            p.grad = torch.full((4,), float("nan"))
            opt.step()
        return int(opt.nonfinite_skips)

    assert _on_both_backends(run) == {"auto": 3, "torch": 3}


# fp16kit/optim/_base.py:861:21:const_float_zero (_step_on_device: LAMB's check pass keeps the factor 1)
@pytest.mark.interpreter
def test_a_lamb_device_step_skips_a_finite_grad_that_overflows_when_unscaled():
    from fp16kit.optim import FusedLAMB

    def run():
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 3e38)
        opt = FusedLAMB([p], lr=0.1)  # max_grad_norm > 0: the check pass takes the norm
        opt.grad_scale, opt.found_inf = torch.full((1,), 0.5), torch.zeros(1)  # 1 / scale = 2: 6e38 is inf
        opt.step()
        return p.detach().clone(), float(opt.found_inf)

    out = _on_both_backends(run)
    assert torch.equal(out["auto"][0], torch.ones(4)) and out["auto"][1] == out["torch"][1] == 1.0


# fp16kit/amp/_dispatch.py:527:4:stmt_delete (_refresh: the CUDA kernels' live rows follow the table back)
def test_the_cuda_kernels_live_rows_are_dropped_when_the_row_is_restored():
    from fp16kit.amp import _dispatch, autocast_mode, policy_override

    before = autocast_mode.engine()
    autocast_mode.set_engine("dispatch")
    _dispatch.uninstall()
    _dispatch.install(autocast_mode.cast_args)
    try:
        with policy_override({"linear": "fp32"}):
            assert {n.partition(".")[0] for n in _dispatch._LIVE_CUDA} == {"linear"}
        assert _dispatch._LIVE_CUDA == {}
    finally:
        autocast_mode.set_engine(before)
        if before != "dispatch":
            _dispatch.uninstall()


# fp16kit/kernels/engine/rounding.py:33:8:return_none (round_to: fp16 outputs use Triton's own cast)
@pytest.mark.interpreter
def test_the_kernels_round_to_fp16_as_torch_does():
    src = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 70000.0, 2.0**-25, -0.1, float("nan")])
    dst = torch.zeros(len(src), dtype=torch.float16)
    copy_([dst], [src])
    assert torch.equal(dst.view(torch.int16), src.to(torch.float16).view(torch.int16))


# fp16kit/kernels/state8/triton.py:54:40:const_float_x2 and :54:45:const_float_zero (quantize_block: an all-zero
# block is divided by 1, not by its absmax 0, so its signed codes are the zero code, as in the torch quantizer)
@pytest.mark.interpreter
@pytest.mark.parametrize("signed", [True, False])
def test_the_triton_quantizer_codes_an_all_zero_block_as_torch_does(signed):
    from fp16kit.kernels.state8 import rule
    from fp16kit.kernels.state8 import triton as kq

    x = torch.zeros(3 * rule.QBLOCK + 7)
    x[rule.QBLOCK : 2 * rule.QBLOCK] = torch.linspace(-2.0 if signed else 0.0, 3.0, rule.QBLOCK)
    x[2 * rule.QBLOCK] = -0.0 if signed else 0.0
    want_codes, want_absmax = rule.quantize(x, signed)
    codes, absmax, values = kq.launch_quantize(x, signed)
    assert torch.equal(codes, want_codes) and torch.equal(absmax, want_absmax)
    assert torch.equal(values.view(torch.int32), rule.dequantize(want_codes, want_absmax, signed).view(torch.int32))


# fp16kit/kernels/state8/triton.py:124:81 and :138:85:const_bool (load_state/store_state: exp_avg_sq is read and
# written with the unsigned book; a first step reads all-zero codes, which both books decode to zero, so it takes a
# second step to see the book), :140:8 and :141:8:stmt_delete (store_state: fp32 moments are stored)
@pytest.mark.interpreter
@pytest.mark.parametrize("state_bits", [8, 32])
def test_moments_after_three_kernel_steps_equal_the_torch_implementations(state_bits):
    from fp16kit.kernels import state8_absmax

    def run():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8192))
        opt = FusedAdam([p], lr=1e-2, state_bits=state_bits)
        for _ in range(3):
            p.grad = torch.randn(8192)
            opt.step()
        st = opt.state[p]
        moments = [st[k] for k in ("exp_avg", "exp_avg_sq")]
        absmax = [state8_absmax(m).clone() if state_bits == 8 else None for m in moments]
        return p.detach().clone(), [m.clone() for m in moments], absmax

    out = _on_both_backends(run)
    for kernel, a_kernel, torch_side, a_torch in zip(*out["auto"][1:], *out["torch"][1:]):
        if state_bits == 8:  # codes and absmax bit for bit (docs/optim.md, "8-bit moments")
            assert torch.equal(kernel, torch_side) and torch.equal(a_kernel, a_torch)
        else:  # a loose check (the backends round the fp32 moments differently); an unstored moment stays 0
            torch.testing.assert_close(kernel, torch_side, rtol=1e-3, atol=0.0)
    torch.testing.assert_close(out["auto"][0], out["torch"][0], rtol=2**-18, atol=2**-30)


_BF16_PTX = r"""
import re, sys
sys.path.insert(0, sys.argv[1])
import aot_compile as A
import triton
fn, constexprs = A.CASES["unscale fp32->bf16, unaligned"][:2]
src = A.ASTSource(fn=fn, signature=A.signature(fn, constexprs), constexprs=constexprs)
ptx = triton.compile(src, target=A.GPUTarget("cuda", 90, 32), options=A.launch_options(fn, constexprs)).asm["ptx"]
code = "\n".join(line.split("//")[0] for line in ptx.splitlines())
print(len(re.findall(r"cvt(?:\.\w+)*\.bf16\.[us](?:8|16|32|64)\b", code)),
      len(re.findall(r"st\.global(?:\.\w+)*\.b16", code)))
"""


# fp16kit/kernels/engine/rounding.py:31:61:const_bool (round_to: the bf16 result is the rounded bit pattern,
# reinterpreted). The interpreter keeps bf16 as uint16 bits, so a value conversion of those bits looks the same
# there; on a GPU it is an integer-to-bf16 conversion. The sm_90 PTX, compiled without a GPU, has none.
def test_the_bf16_rounding_is_a_bit_pattern_in_the_sm90_ptx():
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton with its NVIDIA backend is not installed")
    here = Path(__file__).resolve().parent / "kernels"
    env = {**__import__("os").environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", _BF16_PTX, str(here)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    int_to_float, bf16_stores = map(int, out.stdout.split())
    assert bf16_stores > 0 and int_to_float == 0


# fp16kit/amp/_dispatch.py:223:33:const_int (_rank: a Tensor method names an out-of-place op only when no public
# function reaches it): the names the engine's messages use, as its docstring states them
def test_each_aten_op_is_named_by_its_public_function_or_its_in_place_method():
    from fp16kit.amp import _dispatch, policy

    shown = {name: policy.display_name(fn, "") for name, (_entry, fn) in _dispatch._desired().items()}
    assert shown["exp"] == "torch.exp" and shown["exp_"] == "torch.Tensor.exp_"
    assert shown["binary_cross_entropy"] == "torch.nn.functional.binary_cross_entropy"


# fp16kit/amp/_dispatch.py:233:98:const_int (_desired: callables are ranked by their own row's source, so an
# override of one of two callables reaching one aten op decides that op, whichever comes first in the table)
@pytest.mark.parametrize("overridden",
                         ["torch.nn.functional.binary_cross_entropy", "torch._C._nn.binary_cross_entropy"])
def test_an_override_of_one_callable_decides_the_aten_op_both_reach(overridden):
    from fp16kit.amp import _dispatch, policy_override
    from fp16kit.amp.policy import Rule

    assert _dispatch._desired()["binary_cross_entropy"][0][0] is Rule.BANNED
    with policy_override({overridden: "fp32"}):
        assert _dispatch._desired()["binary_cross_entropy"][0][:1] == (Rule.FP32,)

