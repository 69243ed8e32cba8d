"""The default cast policy table, op by op (cast-policy.md "Behaviour users rely on"), plus registration,
scoped overrides and the export/print of the active table.

The per-op contract: under ``autocast`` every callable of every row returns exactly (dtype and bits) what
casting its inputs by hand and calling it with casting disabled returns. Inputs are made so a cast is always
needed: fp32 inputs for LOW rows, fp16/bf16 inputs for FP32 rows, fp32 + low mixed for PROMOTE rows, and for
in-place forms an fp32 ``self`` with low-precision other arguments (which must be cast to ``self``'s dtype).
"""

from __future__ import annotations

import io
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _op_inputs import INPUTS, TARGET_INPUTS

from fp16kit.amp import (
    Rule,
    autocast,
    autocast_mode,
    disable_casts,
    policy_override,
    policy_table,
    print_policy,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from fp16kit.amp import policy as P
from fp16kit.numerics.assertions import assert_bitwise_equal

LOW = (torch.float16, torch.bfloat16)

# (qualified callable, low dtype) -> why it cannot be checked on CPU (a missing CPU kernel for a LOW op; FP32 ops
# always run in fp32 and cannot have one). Empty with torch 2.13: every callable of the table runs on CPU in fp16
# and bf16. An entry skips with its reason, and fails once the op starts working, so the list cannot go stale.
CPU_UNSUPPORTED: dict[tuple[str, torch.dtype], str] = {
    (f"torch.{op}", low): "cuDNN only"
    for op in ("cudnn_convolution", "cudnn_convolution_transpose")
    for low in (torch.float16, torch.bfloat16)
}


def _targets() -> list[tuple[str, str, Any]]:
    out = []
    for row in (*P.DEFAULT_TABLE, *P.TORCH_CUDA_TABLE):  # the spec's rows and those from torch's own CUDA lists
        for qual, fn in P._DEFAULT_TARGETS[row]:
            out.append((row, qual, fn))
    return out


TARGETS = _targets()


def _inplace(qual: str) -> bool:
    return P._is_inplace(qual.rsplit(".", 1)[-1])


def _input_dtypes(rule: Rule, inplace: bool, low: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(dtype of the first floating input, dtype of the others): chosen so that the rule must cast."""
    if inplace:
        return torch.float32, low  # others are cast up to self's fp32
    if rule is Rule.LOW:
        return torch.float32, torch.float32
    if rule is Rule.PROMOTE:
        return torch.float32, low
    return low, low  # FP32 and BANNED


def _make_inputs(
    row: str, qual: str, first: torch.dtype, rest: torch.dtype, device: str = "cpu"
) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(7)
    calls = [0]

    def mk(*shape: int, lo: float = -1.0, hi: float = 1.0) -> torch.Tensor:
        dtype = first if calls[0] == 0 else rest
        calls[0] += 1
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(dtype)

    return _to(TARGET_INPUTS.get(qual, INPUTS[row])(mk), device)


def _cast_by_hand(a: Any, to: torch.dtype, skip_first: bool = False) -> Any:
    if isinstance(a, torch.Tensor):
        if a.dtype.is_floating_point and a.dtype != torch.float64:
            return a.to(to)
        return a
    if isinstance(a, (list, tuple)):
        return type(a)(_cast_by_hand(x, to) for x in a)
    if isinstance(a, dict):
        return {k: _cast_by_hand(v, to) for k, v in a.items()}
    return a


def _assert_same(out: Any, ref: Any, what: str) -> None:
    if isinstance(ref, torch.Tensor):
        assert isinstance(out, torch.Tensor), what
        assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{out.shape} vs {ref.dtype}"
        if ref.dtype.is_floating_point:
            assert_bitwise_equal(out, ref, what=what)
        else:
            assert torch.equal(out, ref), what
    elif isinstance(ref, (tuple, list)):
        assert len(out) == len(ref), what
        for i, (o, r) in enumerate(zip(out, ref)):
            _assert_same(o, r, f"{what}[{i}]")
    else:
        assert out == ref, what


def _floats(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.dtype.is_floating_point else []
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _floats(v)]
    return []


def test_default_table_matches_spec_names():
    """Every spec name resolves to at least one callable; the rules are the spec's."""
    for row in P.DEFAULT_TABLE:
        assert P._DEFAULT_TARGETS[row], f"{row} resolves to no torch callable"
    assert P.DEFAULT_TABLE["linear"] is Rule.LOW
    assert P.DEFAULT_TABLE["softmax"] is Rule.FP32
    assert P.DEFAULT_TABLE["cat"] is Rule.PROMOTE
    assert P.DEFAULT_TABLE["binary_cross_entropy"] is Rule.BANNED
    assert "batch_norm" not in P.DEFAULT_TABLE  # absent on purpose (cast-policy.md)
    assert len(P.DEFAULT_TABLE) == 28 + 63 + 12 + 1  # the spec's rows but gelu (docs/autocast.md)
    assert "gelu" not in P.DEFAULT_TABLE
    for op in ("add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge"):  # torch's native promotion
        assert op not in P.DEFAULT_TABLE
    names = {q for row in P.DEFAULT_TABLE for q, _ in P._DEFAULT_TARGETS[row]}
    for q in ("torch.nn.functional.linear", "torch.Tensor.__matmul__", "torch.Tensor.__ipow__",
              "torch.Tensor.__rpow__", "torch.Tensor.exp_", "torch.linalg.vector_norm", "torch.lstm_cell",
              "torch.nn.functional.softmax", "torch.softmax", "torch.Tensor.softmax", "torch.cat"):
        assert q in names, q


def _to(obj: Any, device: str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@pytest.mark.parametrize("low", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize(("row", "qual", "fn"), TARGETS, ids=[q for _, q, _ in TARGETS])
def test_every_op_matches_manual_cast(row, qual, fn, low):
    _check_op(row, qual, fn, low, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("low", LOW, ids=["fp16", "bf16"])
def test_every_op_matches_manual_cast_cuda(low):
    for row, qual, fn in TARGETS:
        _check_op(row, qual, fn, low, "cuda")


def _as_reached(qual: str, fn: Any) -> Any:
    """``fn`` as user code reaches it now, through its qualified name: the dispatcher engine wraps some attributes of
    ``torch.nn.functional`` while installed (``_dispatch.wrapped_functions()``), and ``nn`` modules call them so."""
    obj: Any = torch
    for part in qual.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj if getattr(obj, "__fp16kit_wrapped__", None) is fn else fn


def _check_op(row: str, qual: str, fn: Any, low: torch.dtype, device: str) -> None:
    rule = P.DEFAULT_TABLE.get(row) or P.TORCH_CUDA_TABLE[row]
    fn = _as_reached(qual, fn)
    if rule is Rule.BANNED:  # low-precision inputs raise; fp32 inputs run as called
        args, kwargs = _make_inputs(row, qual, low, low, device)
        with autocast(dtype=low), pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            fn(*args, **kwargs)
        args, kwargs = _make_inputs(row, qual, torch.float32, torch.float32, device)
        with autocast(dtype=low):
            out = fn(*args, **kwargs)
        _assert_same(out, fn(*args, **kwargs), qual)
        return
    inplace = _inplace(qual)
    first, rest = _input_dtypes(rule, inplace, low)
    expect = first if inplace else {Rule.LOW: low, Rule.FP32: torch.float32, Rule.PROMOTE: torch.float32}[rule]
    reason = CPU_UNSUPPORTED.get((qual, low)) if device == "cpu" else None

    args, kwargs = _make_inputs(row, qual, first, rest, device)
    ref_args, ref_kwargs = _make_inputs(row, qual, first, rest, device)
    if inplace:
        ref_args = (ref_args[0], *_cast_by_hand(ref_args[1:], expect))
        ref_kwargs = _cast_by_hand(ref_kwargs, expect)
    else:
        ref_args, ref_kwargs = _cast_by_hand(ref_args, expect), _cast_by_hand(ref_kwargs, expect)
    floats_in = _floats((args, list(kwargs.values())))
    if not (inplace and len(floats_in) == 1):  # a unary in-place op on fp32 self has nothing to cast
        assert any(t.dtype != expect for t in floats_in), "inputs must need a cast"

    try:
        with autocast(dtype=low):
            out = fn(*args, **kwargs)
            with disable_casts():
                ref = fn(*ref_args, **ref_kwargs)
    except RuntimeError as e:
        if reason is not None and ("not implemented" in str(e) or "cuDNN" in str(e) or "CUDA" in str(e)):
            pytest.skip(f"{qual} in {low} on CPU: {reason}")
        raise
    assert reason is None, f"{qual} in {low} now runs on CPU: remove it from CPU_UNSUPPORTED"
    _assert_same(out, ref, f"{qual} under autocast({low})")
    floats = _floats(out)
    if floats and not inplace:
        assert all(t.dtype == expect for t in floats), f"{qual}: {[t.dtype for t in floats]} != {expect}"
    if inplace:
        assert args[0].dtype == first and out is args[0]


@pytest.mark.parametrize("low", LOW, ids=["fp16", "bf16"])
def test_promote_leaves_agreeing_dtypes_alone(low):
    a, b = torch.randn(3, 4).to(low), torch.randn(3, 4).to(low)
    with autocast(dtype=low):
        assert torch.cat([a, b]).dtype == low
        assert (a + b).dtype == low
        assert torch.add(a, b).dtype == low
        # fp32 beats low precision, everywhere in a nested container
        assert torch.stack([a, b.float()]).dtype == torch.float32
        assert torch.cat((a, b, b.float())).dtype == torch.float32


def test_promote_fp16_with_bf16_meets_in_fp32():
    a, b = torch.randn(4).half(), torch.randn(4).bfloat16()
    with autocast(dtype=torch.float16):
        out = torch.cat([a, b])
    assert out.dtype == torch.float32
    assert_bitwise_equal(out, torch.cat([a.float(), b.float()]))


def test_registration_of_torch_function():
    x = torch.randn(3, 4)
    try:
        register_half_function(torch, "tanh")
        with autocast(dtype=torch.bfloat16):
            assert torch.tanh(x).dtype == torch.bfloat16
            # the Tensor method is another callable to the mode engine; the dispatcher engine applies rows per aten op
            # (docs/autocast.md, "Two engines, one table")
            per_op = autocast_mode.engine() == "dispatch"
            assert torch.Tensor.tanh(x).dtype == (torch.bfloat16 if per_op else torch.float32)
        assert policy_table()["torch.tanh"] == {"rule": Rule.LOW, "row": "torch.tanh", "source": "registered"}
        register_float_function(torch, "tanh")  # a later registration replaces the row
        with autocast(dtype=torch.bfloat16):
            assert torch.tanh(x.bfloat16()).dtype == torch.float32
        register_promote_function(torch, "tanh")
        assert policy_table()["torch.tanh"]["rule"] is Rule.PROMOTE
    finally:
        P._REGISTERED.pop("torch.tanh", None)
        P._rebuild()
    assert "torch.tanh" not in policy_table()


def test_registration_overrides_a_default_row():
    p, y = torch.rand(4).bfloat16(), torch.rand(4).bfloat16()
    try:
        register_float_function(F, "binary_cross_entropy")  # the fix the banned message recommends
        with autocast(dtype=torch.bfloat16):
            out = F.binary_cross_entropy(p, y)
        assert_bitwise_equal(out, F.binary_cross_entropy(p.float(), y.float()))
    finally:
        P._REGISTERED.pop("torch.nn.functional.binary_cross_entropy", None)
        P._rebuild()
    with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"), autocast(dtype=torch.bfloat16):
        F.binary_cross_entropy(p, y)


def test_registration_of_user_function_patches_module():
    mod = types.ModuleType("usermod")

    def scale(x, w):
        return x * w

    mod.scale = scale
    x, w = torch.randn(3), torch.randn(3)
    try:
        register_half_function(mod, "scale")
        assert mod.scale is not scale and mod.scale.__fp16kit_wrapped__ is scale
        with autocast(dtype=torch.float16):
            out = mod.scale(x, w)
        assert out.dtype == torch.float16
        assert_bitwise_equal(out, x.half() * w.half())
        assert mod.scale(x, w).dtype == torch.float32  # outside a region: run as called
        with autocast(dtype=torch.float16), policy_override({scale: Rule.FP32}):  # the table is read per call
            assert mod.scale(x.half(), w).dtype == torch.float32
        register_float_function(mod, "scale")  # re-registering re-targets, never double-wraps
        assert mod.scale.__fp16kit_wrapped__ is scale
        with autocast(dtype=torch.float16):
            assert mod.scale(x.half(), w.half()).dtype == torch.float32
    finally:
        P._REGISTERED.pop("usermod.scale", None)
        P._rebuild()


@pytest.mark.parametrize("register", [register_half_function, register_float_function, register_promote_function])
def test_registration_missing_name_raises_exact_message(register):
    with pytest.raises(ValueError) as e:
        register(torch, "no_such_fn")
    assert str(e.value) == f"No function named no_such_fn in module {torch}."


def test_policy_override_is_scoped_and_nestable():
    x = torch.randn(4, 6)
    with autocast(dtype=torch.bfloat16):
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.float32
        with policy_override({"softmax": Rule.LOW}):
            assert torch.softmax(x, -1).dtype == torch.bfloat16
            assert F.softmax(x, -1).dtype == torch.bfloat16  # a row covers all its callables
            assert policy_table()["torch.softmax"]["source"] == "override"
            with policy_override({"torch.softmax": None}, linear="fp32"):
                # absent: run as called (fp32 in); the dispatcher engine keeps the aten op's other callables' row
                per_op = autocast_mode.engine() == "dispatch"
                assert torch.softmax(x, -1).dtype == (torch.bfloat16 if per_op else torch.float32)
                assert F.softmax(x, -1).dtype == torch.bfloat16  # the rest of the row still LOW
                assert F.linear(x.bfloat16(), x.bfloat16()).dtype == torch.float32
            assert torch.softmax(x, -1).dtype == torch.bfloat16
            assert F.linear(x, x).dtype == torch.bfloat16
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.float32
    assert policy_table()["torch.softmax"]["source"] == "default"


def test_policy_override_restores_on_error():
    before = policy_table()
    with pytest.raises(KeyError), policy_override({F.gelu: "low"}):
        assert policy_table()["torch.nn.functional.gelu"]["rule"] is Rule.LOW
        raise KeyError
    assert policy_table() == before


def test_policy_override_rejects_unknown_keys_and_rules():
    with pytest.raises(ValueError, match="neither a row"), policy_override({"no_such_op": Rule.LOW}):
        pass
    with pytest.raises(ValueError, match="Unknown rule"), policy_override({"exp": "half"}):
        pass
    with pytest.raises(ValueError, match="register it"), policy_override({lambda x: x: Rule.LOW}):
        pass


def test_policy_table_export_and_print():
    table = policy_table()
    assert table["torch.nn.functional.linear"] == {"rule": Rule.LOW, "row": "linear", "source": "default"}
    assert table["torch.Tensor.exp_"]["rule"] is Rule.FP32
    assert table["torch.Tensor.__ipow__"]["row"] == "Tensor.__ipow__"
    assert "torch.Tensor.__iadd__" not in table  # operators follow torch's native promotion
    assert table["torch.nn.functional.binary_cross_entropy"]["rule"] is Rule.BANNED
    buf = io.StringIO()
    print_policy(buf)
    text = buf.getvalue()
    for r in Rule:
        assert f"{r.name} (" in text
    assert "softmax" in text and "torch.nn.functional.softmax" in text
    buf = io.StringIO()
    print_policy(buf, rule="fp32")  # "why did my op run in fp32?"
    text = buf.getvalue()
    n_fp32 = 63 + sum(r is Rule.FP32 for r in P.TORCH_CUDA_TABLE.values())
    assert text.startswith(f"FP32 ({n_fp32} rows)") and "LOW (" not in text and "torch.log_softmax" in text
    with policy_override({"exp": "low"}):
        buf = io.StringIO()
        print_policy(buf, rule=Rule.LOW)
        assert "[override]" in buf.getvalue() and "torch.Tensor.exp_" in buf.getvalue()


def test_gelu_runs_as_called_by_default():
    """gelu has no default row (neither apex O1 nor torch.autocast casts it; docs/autocast.md, "Where the default
    table differs from torch.autocast"): it runs in its input's dtype. The FP32 row it had (still one override away)
    changed no bit in bf16 where a LOW op consumes it, forward or backward (exact and tanh forms), and cost two casts
    per call."""
    assert "torch.nn.functional.gelu" not in policy_table()
    torch.manual_seed(0)
    x0 = (torch.randn(16, 40) * 3).requires_grad_()
    lin = torch.nn.Linear(40, 24)

    def run(approximate: str, fp32_row: bool):
        x = x0.detach().clone().requires_grad_()
        lin.zero_grad()
        rows = {F.gelu: "fp32"} if fp32_row else {}
        with autocast(dtype=torch.bfloat16), policy_override(rows):
            h = F.gelu(lin(x), approximate=approximate)
            assert h.dtype == (torch.float32 if fp32_row else torch.bfloat16)
            out = F.linear(h, lin.weight[:, :24])
        out.float().pow(2).sum().backward()
        return out, x.grad, lin.weight.grad.clone()

    for approximate in ("none", "tanh"):
        for got, ref in zip(run(approximate, False), run(approximate, True)):
            assert_bitwise_equal(got, ref)
