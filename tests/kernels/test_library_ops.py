"""The fp16kit:: dispatcher ops (fp16kit/kernels/library.py): schemas, fake implementations, results.

``torch.library.opcheck`` runs each op under its schema check (declared mutations and nothing else), against
its fake implementation, and through AOT dispatch (what ``torch.compile`` traces); the op's results equal the
eager functions' bit for bit (one implementation behind both), on the torch fallback and, for tests marked
``interpreter``, the Triton kernels; and the profiler names the ops.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from fp16kit.kernels import copy_, l2norm, library, new_found_inf, unscale_and_check
from fp16kit.numerics import assert_bitwise_equal
from fp16kit.numerics import strategies as fst
from fp16kit.optim import functional as F

LOW = [torch.float16, torch.bfloat16, torch.float32]


def _lists(dtype, seed=0, sizes=(3, 17, 1, 40)):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=gen) * 4).to(dtype) for n in sizes]


def _inf_list(dtype):
    xs = _lists(dtype)
    xs[1][5] = float("inf")
    return xs


def _opt_args(dtype, kind, master=True, seed=1):
    """Arguments of a LAMB/Adam update: params (fp32 masters when ``master``), grads, moments, model copies."""
    gen = torch.Generator().manual_seed(seed)
    sizes = (5, 33, 2)
    if master:
        params = [torch.randn(n, generator=gen) for n in sizes]
        models = [p.to(dtype) for p in params]
        models[1] = None  # an optional entry: only some params have a low-precision copy
    else:
        params = [torch.randn(n, generator=gen).to(dtype) for n in sizes]
        models = [None] * len(sizes)
    math = torch.float64 if params[0].dtype == torch.float64 else torch.float32
    grads = [torch.randn(n, generator=gen).to(dtype) * 8 for n in sizes]
    m = [torch.randn(n, generator=gen).to(math) * 0.1 for n in sizes]
    v = [torch.rand(n, generator=gen).to(math) * 0.01 for n in sizes]
    step = torch.ones(1)
    inv = torch.full((1,), 0.125, dtype=torch.float64)
    common = {"lr": 1e-2, "betas": (0.9, 0.999), "weight_decay": 0.01, "bias_correction": True, "step": step,
              "inv_scale64": inv, "device": torch.device("cpu")}  # fmt: skip
    if kind == "lamb":
        clip64 = torch.full((1,), 1.5, dtype=torch.float64)
        hp = F.lamb_hparams(eps=1e-6, grad_averaging=True, clip64=clip64, **common)
    else:
        hp = F.adam_hparams(eps=1e-8, **common)
    return params, grads, m, v, models, hp, step


def _op_args(kind, args, found_inf):
    params, grads, m, v, models, hp, step = args
    present, rows = library.split_models(models)
    common = (params, grads, m, v, present, rows, hp, found_inf, 0.01, True)
    return (*common, False, step) if kind == "lamb" else (*common, step)


def _all_op_cases(dtype):
    xs = _lists(dtype)
    flag = new_found_inf("cpu")
    yield torch.ops.fp16kit.unscale_and_check.default, (_inf_list(dtype), torch.full((1,), 0.5), flag, None)
    yield (
        torch.ops.fp16kit.unscale_and_check.default,
        (xs, torch.full((1,), 2.0), flag, torch.zeros(1, dtype=torch.float64)),
    )
    outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    yield torch.ops.fp16kit.unscale_and_check_out.default, (xs, torch.full((1,), 0.25), flag, outs, None)
    yield torch.ops.fp16kit.l2norm.default, (xs, torch.full((1,), 0.5), flag)
    yield torch.ops.fp16kit.l2norm.default, (xs, torch.ones(1), None)
    yield torch.ops.fp16kit.copy_.default, ([torch.empty_like(x, dtype=torch.float32) for x in xs], xs)
    yield torch.ops.fp16kit.check_and_norm.default, (_inf_list(dtype), torch.ones(1, dtype=torch.float64), flag)
    for kind in ("lamb", "adam"):
        op = getattr(torch.ops.fp16kit, f"{kind}_update").default
        yield op, _op_args(kind, _opt_args(dtype, kind, master=dtype != torch.float32), new_found_inf("cpu"))


def _case_ids():
    return [op.name() for op, _ in _all_op_cases(torch.float32)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # bf16: the interpreter test below
def test_opcheck_every_op(dtype):
    """Schema (mutations declared, nothing else written), fake implementation, AOT dispatch: for every op."""
    names = set()
    for op, args in _all_op_cases(dtype):
        torch.library.opcheck(op, args)
        names.add(op.name())
    assert names == set(library.OP_NAMES)


@pytest.mark.interpreter
def test_opcheck_on_triton_interpreter():
    """With the Triton kernels (interpreter) behind the ops, which write through raw pointers: the declared
    mutations are exactly the writes (schema check), and the fake agrees with the real outputs. (AOT dispatch
    and autograd registration do not depend on the backend: the test above runs them.)"""
    for op, args in _all_op_cases(torch.bfloat16):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_opcheck_float64_updates():
    for kind in ("lamb", "adam"):
        op = getattr(torch.ops.fp16kit, f"{kind}_update").default
        torch.library.opcheck(op, _op_args(kind, _opt_args(torch.float64, kind, master=False), new_found_inf("cpu")))


def _clone(xs):
    return [None if x is None else x.clone() for x in xs]


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
def test_ops_equal_eager_functions(backend):
    """Each op through the dispatcher gives the eager function's bits (one implementation behind both)."""
    from fp16kit.kernels import use_backend

    with use_backend(backend):
        for dtype in LOW if backend == "torch" else [torch.bfloat16]:  # the interpreter: one dtype (time)
            a, b = _inf_list(dtype), _inf_list(dtype)
            fa, fb = new_found_inf("cpu"), new_found_inf("cpu")
            sa, sb = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
            unscale_and_check(a, 0.5, fa, sq_norm=sa)
            library.unscale_and_check(b, 0.5, fb, sq_norm=sb)
            assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(fa, fb) and torch.equal(sa, sb)
            assert fa.item() == 1.0

            xs = _lists(dtype)
            oa = [torch.empty_like(x, dtype=torch.float32) for x in xs]
            ob = [torch.empty_like(x, dtype=torch.float32) for x in xs]
            unscale_and_check(xs, 3.0, new_found_inf("cpu"), out=oa)
            library.unscale_and_check(xs, 3.0, new_found_inf("cpu"), out=ob)
            assert all(torch.equal(x, y) for x, y in zip(oa, ob))

            ta, ea = l2norm(xs, per_tensor=True, pre_scale=0.5)
            tb, eb = library.l2norm(xs, per_tensor=True, pre_scale=0.5)
            assert torch.equal(ta, tb) and torch.equal(ea, eb) and tb.shape == () and eb.shape == (len(xs),)

            da = [torch.empty_like(x, dtype=torch.float16) for x in xs]
            db = [torch.empty_like(x, dtype=torch.float16) for x in xs]
            copy_(da, xs)
            library.copy_(db, xs)
            assert all(torch.equal(x, y) for x, y in zip(da, db))

            inv = torch.full((1,), 0.25, dtype=torch.float64)
            fa, fb = new_found_inf("cpu"), new_found_inf("cpu")
            assert torch.equal(F.check_and_norm(xs, inv, fa), library.check_and_norm(xs, inv, fb))
            assert torch.equal(fa, fb)

            for kind in ("lamb", "adam"):
                args = _opt_args(dtype, kind, master=dtype != torch.float32)
                params, grads, m, v, models, hp, step = args
                eager = (_clone(params), _clone(m), _clone(v), _clone(models))
                via_op = (_clone(params), _clone(m), _clone(v), _clone(models))
                modes = {"weight_decay": 0.01, "adam_w_mode": True}
                if kind == "lamb":
                    modes["use_nvlamb"] = False
                eager_fn = getattr(F, f"{kind}_update")
                op_fn = getattr(library, f"{kind}_update")
                eager_fn(eager[0], grads, eager[1], eager[2], eager[3], hp, new_found_inf("cpu"), **modes, step=step)
                op_fn(via_op[0], grads, via_op[1], via_op[2], via_op[3], hp, new_found_inf("cpu"), **modes, step=step)
                for xs_e, xs_o in zip(eager, via_op):
                    for x, y in zip(xs_e, xs_o):
                        assert (x is None and y is None) or torch.equal(x, y), (kind, dtype)
                assert not torch.equal(eager[0][0], params[0])  # the update did run


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
@settings(max_examples=10, deadline=None)
@given(case=fst.unscale_cases(max_size=3, max_numel=40))
def test_ops_equal_eager_on_edge_values(backend, case):
    """Hypothesis, edge values (+-0, subnormals, max finite, inf, NaN, overflow after scaling or cast): the
    unscale, l2norm and copy ops give the eager functions' bits and flags (the float64 reference of those
    functions is tested in test_unscale.py, test_l2norm.py, test_copy.py)."""
    from fp16kit.kernels import use_backend

    tensors, inv_scale, out_dtypes = case
    with use_backend(backend):
        flags = [new_found_inf("cpu") for _ in range(4)]
        sums = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        if out_dtypes is None:
            a, b = _clone(tensors), _clone(tensors)
            unscale_and_check(a, inv_scale, flags[0], sq_norm=sums[0])
            library.unscale_and_check(b, inv_scale, flags[1], sq_norm=sums[1])
        else:
            a = [torch.empty(t.shape, dtype=d) for t, d in zip(tensors, out_dtypes)]
            b = [torch.empty(t.shape, dtype=d) for t, d in zip(tensors, out_dtypes)]
            unscale_and_check(tensors, inv_scale, flags[0], out=a, sq_norm=sums[0])
            library.unscale_and_check(tensors, inv_scale, flags[1], out=b, sq_norm=sums[1])
        for x, y in zip(a, b):
            assert_bitwise_equal(y, x, what="unscale op vs eager")
        assert_bitwise_equal(flags[1], flags[0], what="found_inf")
        assert_bitwise_equal(sums[1], sums[0], what="sq_norm")

        ta, ea = l2norm(tensors, per_tensor=True, pre_scale=inv_scale, found_inf=flags[2])
        tb, eb = library.l2norm(tensors, per_tensor=True, pre_scale=inv_scale, found_inf=flags[3])
        assert_bitwise_equal(tb, ta, what="global norm")
        assert_bitwise_equal(eb, ea, what="per-tensor norms")
        assert_bitwise_equal(flags[3], flags[2], what="l2norm found_inf")

        da = [torch.empty_like(t, dtype=torch.float16) for t in tensors]
        db = [torch.empty_like(t, dtype=torch.float16) for t in tensors]
        copy_(da, tensors)
        library.copy_(db, tensors)
        for x, y in zip(da, db):
            assert_bitwise_equal(y, x, what="copy op vs eager")


def test_update_op_skips_on_found_inf():
    """A raised flag makes the update op a no-op (the skip lives on the device, inside the op)."""
    args = _opt_args(torch.bfloat16, "adam")
    params, grads, m, v, models, hp, _step = args
    before = [_clone(params), _clone(m), _clone(v), _clone(models)]
    library.adam_update(params, grads, m, v, models, hp, torch.ones(1), weight_decay=0.0, adam_w_mode=True)
    for xs, ys in zip(before, (params, m, v, models)):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(xs, ys))


def test_bad_model_rows_rejected():
    params, grads, m, v, models, hp, step = _opt_args(torch.float16, "adam")
    present, _ = library.split_models(models)
    with pytest.raises(ValueError, match="model_rows"):
        torch.ops.fp16kit.adam_update(params, grads, m, v, present, [0, 0], hp, new_found_inf("cpu"), 0.0, True, step)


def test_empty_l2norm_answers_on_pre_scale_device():
    total, each = torch.ops.fp16kit.l2norm([], torch.ones(1), None)
    assert total.shape == () and each.shape == (0,) and total.item() == 0.0


def test_profiler_names_the_ops():
    xs = _lists(torch.float32)
    args = _opt_args(torch.bfloat16, "lamb")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flag = new_found_inf("cpu")
        library.unscale_and_check(xs, 0.5, flag)
        library.unscale_and_check(xs, 0.5, flag, out=[torch.empty_like(x) for x in xs])
        library.l2norm(xs)
        library.copy_([torch.empty_like(x) for x in xs], xs)
        library.check_and_norm(xs, torch.ones(1, dtype=torch.float64), flag)
        params, grads, m, v, models, hp, _step = args
        library.lamb_update(
            params, grads, m, v, models, hp, flag, weight_decay=0.01, adam_w_mode=True, use_nvlamb=False
        )
        library.adam_update(params, grads, m, v, models, hp, flag, weight_decay=0.0, adam_w_mode=True)
    seen = {e.key for e in prof.key_averages()}
    assert set(library.OP_NAMES) <= seen, sorted(k for k in seen if "fp16kit" in k)
