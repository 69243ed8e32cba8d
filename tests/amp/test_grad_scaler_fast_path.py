"""GradScaler's CPU fast path (``fp16kit/amp/grad_scaler.py``: ``_fast_grads``): same numerics, never a stale plan.

On the CPU with the torch fallback, ``unscale_`` calls torch's ``_amp_foreach_non_finite_check_and_unscale_``
itself for dense fp32/fp16/bf16 gradients when ``|inv_scale| <= 1``, after checks made once per parameter set
and once per set of gradients. These tests pin down:

* numerics: bit for bit what the general path (``fp16kit.kernels.unscale_and_check``) writes and flags, for
  mixed dtypes and edge values (+-0, subnormals, max finite, inf, NaN), and for scales below 1 (where finite
  values overflow after unscaling: the fast path must hand over to the general path);
* the plan is re-checked whenever a gradient changes identity, dtype, device or storage, or the parameter set
  changes; what the checks reject goes through the general path (and its errors);
* the fast path is really taken (one torch op call per ``unscale_``, no ``unscale_and_check``).
"""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fp16kit.amp.grad_scaler as gs_module
from fp16kit.amp import GradScaler
from fp16kit.numerics.assertions import assert_bitwise_equal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
OP = "_amp_foreach_non_finite_check_and_unscale_"


def edge_values(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    return [0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny / 4, fi.smallest_normal * 0.5, fi.max, -fi.max, 1.0, -3.0,
            math.inf, -math.inf, math.nan, fi.eps, 12345.678]  # fmt: skip


@st.composite
def grad_lists(draw):
    """1-5 gradients of mixed dtypes, each 1-9 values drawn from the edge values and random finite ones."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        pool = edge_values(dtype)
        vals = draw(st.lists(st.one_of(st.sampled_from(pool), st.floats(-1e4, 1e4, width=32)), min_size=1, max_size=9))
        out.append(torch.tensor(vals, dtype=torch.float32).to(dtype))
    return out


def scaler_at(scale: float) -> GradScaler:
    scaler = GradScaler("cpu", init_scale=scale, warn_after_skips=None)
    scaler.scale(torch.ones(()))
    return scaler


def unscale_with(grads, scale, *, fast):
    """Unscale copies of ``grads`` through a GradScaler, on the fast path or forced onto the general one."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = scaler_at(scale)
    with pytest.MonkeyPatch.context() as m:
        if not fast:
            m.setattr(gs_module, "_fast_path_grads", lambda grads, pset: False)
        scaler.unscale_(opt)
    flag = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][torch.device("cpu")]
    return [p.grad for p in params], flag


@settings(max_examples=60, deadline=None)
@given(grads=grad_lists(), scale=st.sampled_from([1.0, 2.0**16, 3.0, 1000.0 / 3.0, 2.0**100, 0.25, 2.0**-20]))
def test_fast_path_is_bitwise_the_general_path(grads, scale):
    fast, fast_flag = unscale_with(grads, scale, fast=True)
    slow, slow_flag = unscale_with(grads, scale, fast=False)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype
        assert_bitwise_equal(a, b)
    assert_bitwise_equal(fast_flag, slow_flag)


def test_torch_op_is_unscale_and_check_on_edge_values():
    """The fact the fast path rests on, directly: torch's op with |inv| <= 1 writes and flags what fp16kit's
    ``unscale_and_check`` does, per dtype (one rounding of the fp32 product), mixed in one call."""
    from fp16kit.kernels import unscale_and_check

    for inv in (1.0, 2.0**-16, 1 / 3, 0.75, 2.0**-126):
        grads = [torch.tensor(edge_values(d), dtype=torch.float32).to(d) for d in DTYPES]
        ours = [g.clone() for g in grads]
        theirs = [g.clone() for g in grads]
        inv_t = torch.tensor([inv], dtype=torch.float32)
        f1, f2 = torch.zeros(1), torch.zeros(1)
        unscale_and_check(ours, inv_t, f1)
        getattr(torch, OP)(theirs, f2, inv_t)
        for a, b in zip(ours, theirs):
            assert_bitwise_equal(a, b)
        assert f1.item() == f2.item() == 1.0


def test_scale_below_one_flags_values_that_overflow_after_unscaling():
    # 60000 * 16 overflows fp16: fp16kit flags the written inf; torch's op alone (it checks inputs) would not.
    grads = [torch.tensor([60000.0, 1.0], dtype=torch.float16), torch.tensor([2.0])]
    out, flag = unscale_with(grads, 2.0**-4, fast=True)
    assert flag.item() == 1.0 and out[0][0].item() == math.inf


# ----------------------------------------------------------------------------- the fast path is taken
class Spy:
    """Counts torch's op calls, general-path calls and checks of new gradients: a full check
    (``_fast_path_grads``, also counted in ``full``) or a guard re-check of new addresses that passed
    (``_ParamSet.refit``; the same addresses as last time are no re-check)."""

    def __init__(self, monkeypatch):
        self.op_calls, self.general_calls, self.checks, self.full = 0, 0, 0, 0
        real_op, real_general, real_check = getattr(torch, OP), gs_module.unscale_and_check, gs_module._fast_path_grads
        real_refit = gs_module._ParamSet.refit

        def op(*args, **kw):
            self.op_calls += 1
            return real_op(*args, **kw)

        def general(*args, **kw):
            self.general_calls += 1
            return real_general(*args, **kw)

        def check(grads, pset):
            self.checks += 1
            self.full += 1
            return real_check(grads, pset)

        def refit(pset, grads):
            before = pset.ptrs
            ok = real_refit(pset, grads)
            self.checks += ok and pset.ptrs is not before  # new addresses passed the span test (a re-check)
            return ok

        monkeypatch.setattr(torch, OP, op)
        monkeypatch.setattr(gs_module, "unscale_and_check", general)
        monkeypatch.setattr(gs_module, "_fast_path_grads", check)
        monkeypatch.setattr(gs_module._ParamSet, "refit", refit)

    def counts(self):
        out = (self.op_calls, self.general_calls, self.checks)
        self.op_calls = self.general_calls = self.checks = 0
        return out


def setup(n=4, dtype=torch.float32):
    params = [torch.nn.Parameter(torch.randn(3, 2).to(dtype)) for _ in range(n)]
    for p in params:
        p.grad = torch.full_like(p, 8.0)
    opt = torch.optim.SGD(params, lr=0.1)
    return params, opt, scaler_at(8.0)


def unscale(scaler, opt):
    scaler.unscale_(opt)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    scaler._per_optimizer_states.clear()
    return found


def test_fast_path_checks_once_then_reuses_the_plan(monkeypatch):
    params, opt, scaler = setup()
    spy = Spy(monkeypatch)
    unscale(scaler, opt)
    assert spy.counts() == (1, 0, 1)  # one torch op call, full checks once
    unscale(scaler, opt)
    assert spy.counts() == (1, 0, 0)  # same gradients: no re-check
    assert all(torch.equal(p.grad, torch.full_like(p, 0.125)) for p in params)


def test_new_gradients_are_checked_and_stay_on_the_fast_path(monkeypatch):
    """New gradients of the kinds that passed the full checks are re-checked by the guard (metadata in one call,
    plus the no-shared-byte test on the new pointers), not property by property."""
    params, opt, scaler = setup()
    unscale(scaler, opt)  # the first gradients get the full checks
    spy = Spy(monkeypatch)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)  # new gradient tensors each iteration
        for p in params:
            p.grad = torch.full_like(p, 8.0)
        unscale(scaler, opt)
        assert spy.full == 0
        assert spy.counts() == (1, 0, 1)
    assert all(bool((p.grad == 1.0).all()) for p in params)


@pytest.mark.parametrize("kind", ["alias", "partial", "dtype", "subclass", "neg"])
def test_new_gradients_of_another_kind_get_the_full_check(monkeypatch, kind):
    """After guard re-checks of new gradients, new ones that share memory (exactly or partly), have another dtype,
    are a tensor subclass or a negative-bit view are not let through by the guard: the full check runs, and what
    it rejects goes to the general path (with its error)."""
    params, opt, scaler = setup()
    for _ in range(2):
        for p in params:
            p.grad = torch.full_like(p, 8.0)
        unscale(scaler, opt)
    spy = Spy(monkeypatch)
    grads = [torch.full_like(p, 8.0) for p in params]
    if kind == "alias":
        grads[1] = grads[0]
    elif kind == "partial":  # same shape and strides, one element shared
        buf = torch.full((grads[0].numel() * 2,), 8.0)
        grads[0], grads[1] = buf[: grads[0].numel()].view_as(grads[0]), buf[1 : grads[0].numel() + 1].view_as(grads[0])
    elif kind == "subclass":
        grads[0] = torch.nn.Parameter(grads[0], requires_grad=False)
    elif kind == "neg":
        grads[0] = torch.zeros(grads[0].shape, dtype=torch.complex64).conj().imag
    for p, g in zip(params, grads):
        p.grad = g
    if kind == "dtype":  # (torch refuses a grad of another dtype by assignment, not through .data)
        params[0].grad.data = grads[0].double()
    if kind in ("alias", "partial", "neg"):
        with pytest.raises(ValueError, match=r"same memory|overlap|negative-bit"):
            unscale(scaler, opt)
    else:
        unscale(scaler, opt)
        assert all(bool((p.grad == 1.0).all()) for p in params)
    assert spy.full == 1  # (the negative bit is left to torch's op, which refuses it: then the general path)


@pytest.mark.parametrize("change", ["dtype", "storage", "device", "strides", "alias", "expanded", "param_set"])
def test_plan_is_invalidated(monkeypatch, change):
    params, opt, scaler = setup()
    unscale(scaler, opt)  # plan made
    for p in params:
        p.grad.fill_(8.0)
    spy = Spy(monkeypatch)
    g0 = params[0].grad
    if change == "dtype":  # same tensor object, now float64: float64 math on the general path
        g0.data = torch.full(g0.shape, 8.0, dtype=torch.float64)
    elif change == "storage":
        g0.data = torch.full_like(g0, 8.0)
    elif change == "device":  # `.data =` cannot move a tensor to another device; a module's .to() swaps params
        meta = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
        meta.grad = torch.empty(3, 2, device="meta")
        opt.param_groups[0]["params"][0] = meta
    elif change == "strides":
        g0.data = torch.full((2, 3), 8.0).t()
    elif change == "alias":  # two gradients in one memory: unscaling in place would divide twice
        params[1].grad.data = g0
    elif change == "expanded":  # internal overlap
        g0.data = torch.full((1, 2), 8.0).expand(3, 2)
    elif change == "param_set":
        extra = torch.nn.Parameter(torch.ones(2))
        extra.grad = torch.full((2,), 8.0)
        opt.add_param_group({"params": [extra]})
    expect_error = change in ("alias", "expanded")
    if expect_error:
        with pytest.raises(ValueError, match=r"same memory|overlap"):
            unscale(scaler, opt)
        assert spy.general_calls == 1  # the re-check sent it to the general path, whose check raised
        return
    if change == "device":
        assert scaler._fast_grads(opt) is None  # meta is not the CPU: the general path's business
        return
    unscale(scaler, opt)
    op_calls, general_calls, checks = spy.counts()
    if change in ("dtype", "strides"):  # float64 / not contiguous: re-checked, then the general path
        assert general_calls == 1 and checks == 1
    else:
        assert (op_calls, general_calls, checks) == (1, 0, 1)
    grads = [p.grad for g in opt.param_groups for p in g["params"]]
    assert all(bool((g == 1.0).all()) for g in grads)


def test_general_path_cases_still_work(monkeypatch):
    _, opt, scaler = setup()
    spy = Spy(monkeypatch)
    # a sparse gradient: coalesced and unscaled by the general path
    emb = torch.nn.Embedding(4, 2, sparse=True)
    emb.weight.grad = torch.sparse_coo_tensor([[0, 0]], torch.full((2, 2), 8.0), (4, 2))
    opt.add_param_group({"params": [emb.weight]})
    unscale(scaler, opt)
    assert spy.counts()[1] == 1
    assert emb.weight.grad.is_coalesced() and torch.equal(emb.weight.grad.to_dense()[0], torch.full((2,), 2.0))
    # a negative-bit gradient: the general path's error
    params2, opt2, scaler2 = setup(1)
    z = torch.zeros(3, 2, dtype=torch.complex64)
    params2[0].grad.data = z.conj().imag
    with pytest.raises(ValueError, match="negative-bit"):
        unscale(scaler2, opt2)


def test_no_gradients_keeps_torch_error():
    params, opt, scaler = setup()
    for p in params:
        p.grad = None
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)


def test_fused_step_check_uses_fast_path_and_pickle_drops_the_plans(monkeypatch):
    params, _, scaler = setup()
    opt = torch.optim.Adam(params, lr=0.1, fused=True)
    params[0].grad[0, 0] = math.inf
    before = [p.detach().clone() for p in params]
    spy = Spy(monkeypatch)
    scaler.step(opt)  # check only (inv_scale 1): a found inf skips the fused step
    assert spy.counts()[:2] == (1, 0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    scaler.update()
    assert scaler.get_scale() == 4.0
    clone = pickle.loads(pickle.dumps(scaler))
    assert len(clone._param_sets) == 0 and clone.get_scale() == 4.0


def test_plans_do_not_keep_dropped_optimizers_alive():
    import gc
    import weakref

    _, opt, scaler = setup()
    unscale(scaler, opt)
    assert len(scaler._param_sets) == 1
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None and len(scaler._param_sets) == 0


# ----------------------------------------------------------------------------- the gradient checks themselves
@settings(max_examples=80, deadline=None)
@given(
    spans=st.lists(
        st.tuples(st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 24), st.integers(0, 6)),
        min_size=1,
        max_size=6,
    ),
    separate=st.lists(st.integers(1, 5), max_size=3),
)
def test_disjointness_check_equals_pairwise_overlap(spans, separate):
    """``_fast_path_grads``'s sorted-starts/sorted-ends test against the pairwise definition, on views of one buffer
    (fp32 views and bf16 views of the same bytes: overlaps down to 2 bytes, spans that only touch) and separate
    tensors. Empty gradients are refused (an empty span has no place to compare)."""
    buf = torch.zeros(32)
    grads = [
        buf[off : off + n] if dt is torch.float32 else buf.view(torch.bfloat16)[off : off + n] for dt, off, n in spans
    ]
    grads += [torch.zeros(n) for n in separate]
    byte_spans = [(g.data_ptr(), g.data_ptr() + g.nbytes) for g in grads]
    pairwise_disjoint = all(
        not (a0 < b1 and b0 < a1) for i, (a0, a1) in enumerate(byte_spans) for b0, b1 in byte_spans[i + 1 :]
    )
    expected = pairwise_disjoint and all(g.numel() for g in grads)
    pset = gs_module._ParamSet([])
    assert gs_module._fast_path_grads(grads, pset) is expected
    if expected:  # recorded for the next call, which then needs no full check
        assert pset.unchanged(grads) and pset.saw_fp16 is False


@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "mkldnn", "meta", "float64", "int_view", "empty"])
def test_gradients_the_fast_path_refuses(kind):
    """Each of these goes to the general path (``_fast_grads`` is None), including the layouts that are refused only
    because ``data_ptr()`` raises for a tensor without storage, and a meta gradient (torch's op would silently run
    its meta kernel on the whole list, unscaling nothing)."""
    ok = torch.ones(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sparse CSR's "beta" warning
        bad = {
            "sparse_coo": lambda: ok.to_sparse(),
            "sparse_csr": lambda: ok.to_sparse_csr(),
            "mkldnn": lambda: ok.to_mkldnn(),
            "meta": lambda: torch.ones(4, 2, device="meta"),
            "float64": lambda: ok.double(),
            "int_view": lambda: ok.view(torch.int32),
            "empty": lambda: torch.ones(0),
        }[kind]()
    grads = [torch.ones(3), bad]
    pset = gs_module._ParamSet([])
    try:
        verdict = gs_module._fast_path_grads(grads, pset)
    except RuntimeError:  # no storage: _fast_grads takes this as "not fast"
        verdict = False
    assert verdict is False and pset.grad_ids == []


def test_negative_bit_is_refused_by_torch_before_any_write(monkeypatch):
    """The fast checks leave the negative bit to torch's op: it must refuse the list before writing anything (the
    scaler then takes the general path, whose error names the problem). If a torch release wrote first, the
    gradient before the negative-bit one would change here."""
    first = torch.full((3,), 8.0)
    neg = torch.full((3,), -8.0)._neg_view()
    with pytest.raises(RuntimeError):
        getattr(torch, OP)([first, neg], torch.zeros(1), torch.full((1,), 0.5))
    assert torch.equal(first, torch.full((3,), 8.0))

