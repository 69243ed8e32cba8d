"""Tests that kill the survivors of the full mutation run that no test written before it could see (scripts/mutation.py;
docs/guarantees.md, "The full run"). Each test names the contract it pins; the comment above it names the mutant
ids of that run (``file:line:col:operator``, the paths before the kernels moved into folders) and, in brackets,
today's file."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fp16kit.amp import _dispatch as D
from fp16kit.amp import autocast, autocast_mode, disable_casts, policy_override
from fp16kit.kernels import adam_update, lamb_update, state8_absmax, to_state8, use_backend
from fp16kit.kernels.bf16_weights import modes
from fp16kit.kernels.bf16_weights.modes import _stochastic_bits, philox_uint32, stochastic_round_list
from fp16kit.kernels.fallback.step import masked_commits
from fp16kit.kernels.state8 import rule as s8
from fp16kit.numerics.assertions import assert_bitwise_equal
from fp16kit.numerics.reference.bf16_weights import stochastic_round_bf16
from fp16kit.optim import FusedAdam
from fp16kit.optim import functional as FN

CPU = torch.device("cpu")

# ---------------------------------------------------------------------------------------------------------------
# The dispatcher engine's registration (fp16kit/amp/_dispatch.py)


@pytest.fixture
def dispatch_engine():
    """The dispatcher engine, installed afresh and installed again after the test (which may uninstall it); then the
    engine the session runs (leaving this one uninstalls it)."""
    with autocast_mode.use_engine("dispatch"):
        D.uninstall()
        D.install(autocast_mode.cast_args)
        yield
        D.install(autocast_mode.cast_args)


# fp16kit/amp/_dispatch.py:488:4:stmt_delete (_unwrap_functional keeps the rows its wrappers read): uninstalling
# removes every wrapper, those a caller still holds included; inside a region of the engine entered without
# installing it again (as a checkpoint's recomputation replays one) such a wrapper runs its function as called.
@pytest.mark.usefixtures("dispatch_engine")
def test_a_wrapper_held_past_uninstall_applies_no_row():
    y = torch.randn(4, 8).bfloat16()
    with autocast(dtype=torch.bfloat16):
        held = F.layer_norm  # the wrapper (an FP32 row that torch's CPU autocast leaves alone)
        assert held(y, (8,)).dtype == torch.float32
    assert held.__fp16kit_wrapped__ is not held
    D.uninstall()
    with D.region(torch.bfloat16):
        got = held(y, (8,))
        want = held.__fp16kit_wrapped__(y, (8,))
    assert want.dtype == torch.bfloat16
    assert_bitwise_equal(got, want)


# fp16kit/amp/_dispatch.py:547:32:cmp_negate_Is (live_plan with no plans handed in)
@pytest.mark.usefixtures("dispatch_engine")
def test_live_plan_computes_the_plans_it_is_not_handed():
    plans = {key: D.plan(key) for key in D.KEYS}
    live = D.live_plan()
    assert live == D.live_plan(plans)
    assert set(live) == set().union(*plans.values())
    assert {"softmax.int", "layer_norm"} <= set(D.installed_ops("AutocastCPU")) <= set(live)


# fp16kit/amp/_dispatch.py:574:90:const_bool (_refresh registers the AutocastCUDA kernels without the keyset). On a
# CUDA tensor the dispatcher calls a kernel registered on AutocastCUDA with the dispatch keyset first; that call is
# made here on CPU tensors, so no GPU is needed to see the calling convention.
@pytest.mark.usefixtures("dispatch_engine")
def test_the_autocast_cuda_kernel_of_a_user_row_takes_the_dispatch_keyset():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 4, generator=g).bfloat16(), torch.randn(5, 4, generator=g).bfloat16()
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
    with autocast(dtype=torch.bfloat16), policy_override({"linear": "fp32"}):
        assert "linear" in D.cuda_overrides()  # torch's CUDA kernel runs linear low: the user's row gets a kernel
        kernel = torch.library.get_kernel(torch.ops.aten.linear.default, "AutocastCUDA")
        got = kernel.call_boxed(keyset, x, w, None)
        with disable_casts():
            want = F.linear(x.float(), w.float())
    assert_bitwise_equal(got, want)  # the row's fp32, not torch's bf16
    assert kernel.call_boxed(keyset, x, w, None).dtype == torch.bfloat16  # outside a region: torch's kernel


# fp16kit/amp/_dispatch.py:617:8:stmt_delete (install registers its table listener again after every uninstall):
# however often the engine is uninstalled and installed again, a change of the table recomputes its plan once.
@pytest.mark.usefixtures("dispatch_engine")
def test_reinstalling_the_engine_keeps_one_table_listener(monkeypatch):
    calls: list[str] = []
    real = D.plan
    monkeypatch.setattr(D, "plan", lambda key: calls.append(key) or real(key))

    def plans_per_change() -> int:
        calls.clear()
        with policy_override({"softmax": "low"}):  # two changes: the override enters and leaves
            pass
        return len(calls)

    first = plans_per_change()
    for _ in range(3):
        D.uninstall()
        D.install(autocast_mode.cast_args)
    assert first == 2 * len(D.KEYS)
    assert plans_per_change() == first


# ---------------------------------------------------------------------------------------------------------------
# Stochastic rounding's random bits (fp16kit/kernels/bf16_weights/modes.py)


def _low_halves(n: int, seed: int) -> torch.Tensor:
    """fp32 values of every binade with random low halves (each rounding then depends on its random bits)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())


def _spec_bits(seed: int, row: int, stream: int, step: int, first: int, n: int) -> torch.Tensor:
    """The 16 random bits of elements ``first .. first + n - 1`` as the module docstring states them: element ``e``
    takes half ``e % 2`` of word ``(e // 2) % 4`` of Philox4x32-10 at counter ``(e // 8 mod 2**32, row,
    stream + (e // 8 >> 32) * 2**16, step)``, computed one counter high word at a time."""
    e = torch.arange(first, first + n, dtype=torch.int64)
    k = e // 8
    words = torch.empty(n, 4, dtype=torch.int64)
    for high in k.div(2**32, rounding_mode="floor").unique().tolist():
        at = (k >> 32) == high
        words[at] = philox_uint32(seed, k[at] - high * 2**32, row, stream + high * 2**16, step)
    word = words.gather(1, ((e // 2) % 4)[:, None])[:, 0]
    return (word >> (16 * (e % 2))) & 0xFFFF


# fp16kit/kernels/_bf16_weights.py:308:16:binop_Sub [bf16_weights/modes.py] (stochastic_round_list: a shard that
# starts at counter f draws f counters too many): one Philox evaluation per 8 elements of the shards, wherever they
# start (a shard far into a large tensor would otherwise draw, and hold in memory, a counter per 8 elements before it).
def test_shards_at_offsets_draw_one_philox_counter_per_8_elements(monkeypatch):
    drawn: list[int] = []
    real = modes.philox_uint32
    monkeypatch.setattr(modes, "philox_uint32", lambda seed, c0, *words: drawn.append(c0.numel()) or real(
        seed, c0, *words))
    xs = [_low_halves(n, 3) for n in (20, 33, 8)]
    offsets = [8 * 5000 + 3, 5, 64]
    stochastic_round_list(xs, 11, [0, 1, 2], 0, torch.tensor(3.0), offsets)
    assert drawn == [sum((o + x.numel() + 7) // 8 - o // 8 for o, x in zip(offsets, xs))]


# fp16kit/kernels/_bf16_weights.py:316:40:binop_Add, :316:49:binop_Mult, :316:50:binop_RShift, :316:55:const_int,
# :316:61:const_int [bf16_weights/modes.py] (stochastic_round_list: the counter's high bits in the stream word). A
# shard of a tensor of more than 2**35 elements (an FSDP2 shard's offset) straddling element 2**35, where the
# counter e // 8 reaches 2**32: its rounding follows the stated counter layout on both sides.
def test_stochastic_bits_past_element_2_35_follow_the_counter_layout():
    n, first = 2048, 2**35 - 1000 - 3
    seed, row, stream, step = 0x1234_5678_9ABC, 3, 5, 9
    x = _low_halves(n, 1)
    got = stochastic_round_list([x], seed, [row], stream, torch.tensor(float(step)), [first])[0]
    r16 = _spec_bits(seed, row, stream, step, first, n)
    want = [stochastic_round_bf16(xv, r) for xv, r in zip(x.tolist(), r16.tolist())]
    assert got.float().tolist() == want


@triton.jit
def _stochastic_kernel(x_ptr, out_ptr, n, first, seed, row, stream, step, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    bits = _stochastic_bits(x, seed, first + offs.to(tl.int64), row, stream, step.to(tl.uint32))
    tl.store(out_ptr + offs, bits, mask=mask)


# The same counters in the kernels' device function (the Triton twin) and the torch implementation, past 2**35.
@pytest.mark.interpreter
def test_stochastic_bits_past_element_2_35_equal_the_triton_twin():
    n, first = 2048, 2**35 - 1000 - 3
    seed, row, stream, step = 0x1234_5678_9ABC, 3, 5, 9
    x = _low_halves(n, 2)
    out = torch.empty(n, dtype=torch.bfloat16)
    _stochastic_kernel[(triton.cdiv(n, 512),)](x, out, n, first, seed, row, stream, step, BLOCK=512)
    want = stochastic_round_list([x], seed, [row], stream, torch.tensor(float(step)), [first])[0]
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# 8-bit moments (fp16kit/kernels/state8/)


def _hp(kind: str) -> torch.Tensor:
    step, one = torch.tensor([3.0]), torch.ones((), dtype=torch.float64)
    if kind == "adam":
        return FN.adam_hparams(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, bias_correction=True,
                               step=step, inv_scale64=one, device=CPU)
    return FN.lamb_hparams(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                           grad_averaging=True, step=step, inv_scale64=one, clip64=one, device=CPU)


def _update(kind: str, ps, gs, ms, vs, models) -> None:
    if kind == "adam":
        adam_update(ps, gs, ms, vs, models, _hp(kind), torch.zeros(1), weight_decay=0.01, adam_w_mode=True,
                    state_bits=8)
    else:
        lamb_update(ps, gs, ms, vs, models, _hp(kind), torch.zeros(1), weight_decay=0.01, adam_w_mode=True,
                    use_nvlamb=False, state_bits=8)


def _problem(sizes, seed: int = 0, model_dtype=None):
    """Params, grads, moments (8-bit from the threshold up) and model copies (``model_dtype`` for the rows marked
    True in ``sizes``' second field)."""
    g = torch.Generator().manual_seed(seed)
    ps, gs, ms, vs, models = [], [], [], [], []
    for n, has_model in sizes:
        p = torch.randn(n, generator=g)
        ps.append(p)
        gs.append(torch.randn(n, generator=g))
        m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
        ms.append(to_state8(m, True) if s8.uses_state8(p) else m)
        vs.append(to_state8(v, False) if s8.uses_state8(p) else v)
        models.append(p.to(model_dtype) if has_model else None)
    return ps, gs, ms, vs, models


def _state_bytes(m: torch.Tensor) -> torch.Tensor:
    """An 8-bit moment's codes, padding and absmax, as bytes (a copy)."""
    n = m.numel()
    return m.as_strided((s8._align16(n) + 4 * s8.num_blocks(n),), (1,), m.storage_offset()).clone()


def _masked(masked: bool):
    """The masked sequence (the torch implementation off the CPU) or, on the CPU, its chunked 8-bit path."""
    return masked_commits() if masked else contextlib.nullcontext()


def _copy(x):
    if x is None:
        return None
    if x.dtype != torch.uint8:
        return x.clone()
    out = to_state8(torch.zeros(x.shape), True)
    out.copy_(x)
    state8_absmax(out).copy_(state8_absmax(x))
    return out


# fp16kit/kernels/optim_fallback_state8.py:206:20:index_plus1 [state8/fallback.py] (_chunk: a row's flat view
# decided by whether the *next* row's tensor is None). The CPU path of the 8-bit torch implementation equals the
# masked sequence with an 8-bit row last in its list (alone, too) and with a model copy on some rows only.
@pytest.mark.parametrize("kind", ["adam", "lamb"])
@pytest.mark.parametrize("rows", [[(4352, True)], [(4352, True), (4096, False), (300, False)]],
                         ids=["one-row", "mixed-model-copies"])
def test_the_cpu_8bit_path_steps_a_last_row_and_rows_without_model_copies(kind, rows):
    base = _problem(rows, seed=4, model_dtype=torch.bfloat16)
    out = {}
    for masked in (False, True):
        ps, gs, ms, vs, models = ([_copy(x) for x in xs] for xs in base)
        with use_backend("torch"), _masked(masked):
            _update(kind, ps, gs, ms, vs, models)
        out[masked] = (ps, ms, vs, models)
    for got, want in zip(out[False], out[True]):
        for a, b in zip(got, want):
            if a is None:
                assert b is None
            elif a.dtype == torch.uint8:
                assert torch.equal(_state_bytes(a), _state_bytes(b))
            else:
                assert torch.equal(a, b)
    for model, p, before in zip(out[False][3], out[False][0], base[0]):
        if model is not None:  # the model copy was written (it is the new param, rounded)
            assert not torch.equal(p, before) and torch.equal(model, p.to(model.dtype))


def test_fused_adam_steps_a_lone_8bit_param_on_the_cpu_path():
    """The user's path to the same: one big param, so its 8-bit row is the last of its list."""
    out = []
    for masked in (False, True):
        p = torch.nn.Parameter(torch.randn(4352, generator=torch.Generator().manual_seed(5)))
        opt = FusedAdam([p], lr=1e-2, state_bits=8)
        for step in range(2):
            p.grad = torch.full_like(p, 0.5 - step)
            with use_backend("torch"), _masked(masked):
                opt.step()
        out.append((p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]))
    assert out[0][1].dtype == torch.uint8
    assert torch.equal(out[0][0], out[1][0])
    for a, b in zip(out[0][1:], out[1][1:]):
        assert torch.equal(_state_bytes(a), _state_bytes(b))


def _in_a_larger_buffer(m: torch.Tensor, tail: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit moment equal to ``m`` whose storage runs on past its absmax (``check_room`` accepts it, as it
    accepts any view with room), the bytes after it a sentinel: ``(moment, the tail)``."""
    need = s8._align16(m.numel()) + 4 * s8.num_blocks(m.numel())
    buf = torch.full((need + tail,), 0xA5, dtype=torch.uint8)
    buf[:need].copy_(_state_bytes(m))
    return buf[: m.numel()].view(m.shape), buf[need:]


# fp16kit/kernels/_state8.py:75:14:cmp_boundary_Lt [state8/triton.py] (_block_span: an absmax one past a
# tensor's blocks stored when its size is a multiple of the block and a chunk runs past its end). The kernels write
# a moment's codes and absmax and nothing after them: here the bytes after the absmax are another tensor's.
@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_the_kernels_write_nothing_past_an_8bit_moments_absmax(kind):
    n = 17 * s8.QBLOCK  # whole blocks; the CPU step chunk (4096) runs past its end
    base = _problem([(n, False)], seed=6)
    out = {}
    for backend in ("torch", "auto"):
        ps, gs, ms, vs, models = ([_copy(x) for x in xs] for xs in base)
        (m, m_tail), (v, v_tail) = _in_a_larger_buffer(ms[0]), _in_a_larger_buffer(vs[0])
        with use_backend(backend):
            _update(kind, ps, gs, [m], [v], models)
        assert bool((m_tail == 0xA5).all()) and bool((v_tail == 0xA5).all()), backend
        out[backend] = (ps[0], _state_bytes(m), _state_bytes(v))
    (tp, tm, tv), (kp, km, kv) = out["torch"], out["auto"]
    assert torch.equal(tm, km) and torch.equal(tv, kv)  # codes and absmax bit for bit (docs/optim.md)
    torch.testing.assert_close(kp, tp, rtol=2**-18, atol=2**-30)
    assert np.any(tm.numpy() != _state_bytes(base[2][0]).numpy())  # the step wrote the moment


# ---------------------------------------------------------------------------------------------------------------
# Seen while judging the entries above: on today's files fp16kit/kernels/bf16_weights/modes.py:197:52:const_bool
# (_split_bits: the high half cast to bf16 as a value, `bitcast=True` -> `False`) survives its target's tests. The
# interpreter keeps bf16 as its 16 bits, so only a GPU sees the value conversion; the sm_90 PTX, compiled without a
# GPU, has none.

_SPLIT_PTX = r'''
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fp16kit.kernels.bf16_weights.modes import _split_bits


@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    hi, lo = _split_bits(tl.load(x_ptr + offs, mask=mask))
    tl.store(hi_ptr + offs, hi, mask=mask)
    tl.store(lo_ptr + offs, lo, mask=mask)


sig = {"x_ptr": "*fp32", "hi_ptr": "*bf16", "lo_ptr": "*i16", "n": "i32", "BLOCK": "constexpr"}
src = ASTSource(fn=_split_kernel, signature=sig, constexprs={"BLOCK": 1024})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
code = "\n".join(line.split("//")[0] for line in ptx.splitlines())
print(len(re.findall(r"cvt(?:\.\w+)*\.bf16\.[us](?:8|16|32|64)\b", code)),
      len(re.findall(r"st\.global(?:\.\w+)*\.b16", code)))
'''


@pytest.mark.slow
def test_the_split_high_half_is_a_bit_pattern_in_the_sm90_ptx(tmp_path):
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton with its NVIDIA backend is not installed")
    script = tmp_path / "split_ptx.py"  # a file: triton.jit reads the kernel's source
    script.write_text(_SPLIT_PTX)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    int_to_bf16, b16_stores = map(int, out.stdout.split())
    assert b16_stores > 0 and int_to_bf16 == 0
