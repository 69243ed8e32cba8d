"""The fast default CPU path of FusedLAMB/FusedAdam (issue 10, item 5; ``fp16kit/kernels/fallback/step.py``).

On the torch backend, CPU rows of contiguous fp32/fp64 params and moments run Adam's elementwise math (and LAMB's
stage 1) in torch's fused CPU Adam kernel. These tests check that the path is taken where its math is ours and
only there, that its results stay inside the float64-reference budgets of ``optim_helpers.py`` (loss scale,
clipping, bf16 grads with masters, non-contiguous grads, several batches), that the grads are never written
(torch's kernel writes unscaled grads back when given ``grad_scale``; we never give it one), and that the
one-read global norm (``fallback/l2norm.py``, ``_max_norms``)
decides the flag and the norm exactly as the two-read one did,
edge values included; the CPU check-and-norm (BLAS dot sums of squares, host-side verdicts, float64 repair) and
the trust-ratio norms against the float64 references.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from optim_helpers import adam_step_and_check, lamb_step_and_check, make_params, set_grads

from fp16kit.kernels import use_backend
from fp16kit.kernels.fallback import adam as fb_adam
from fp16kit.kernels.fallback import l2norm as fb_l2norm
from fp16kit.kernels.fallback import lamb_native as _cpu_native
from fp16kit.kernels.fallback import scratch as fb_scratch
from fp16kit.kernels.fallback import step as fb_step
from fp16kit.numerics import reference
from fp16kit.numerics.formats import gamma
from fp16kit.optim import FusedAdam, FusedLAMB
from fp16kit.optim import functional as F

SHAPES = st.lists(st.sampled_from([(1,), (9,), (4, 4), (2, 3, 5), (64,), (300,)]), min_size=1, max_size=4)


@pytest.fixture(autouse=True)
def _torch_backend():
    with use_backend("torch"):
        yield


@contextlib.contextmanager
def kernel_calls():
    """Count the calls of torch's fused Adam kernels (the fast path's only entry points)."""
    calls: list[str] = []
    originals = {name: getattr(torch, name) for name in ("_fused_adam_", "_fused_adamw_")}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(torch, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)


def two_groups(params, **group_opts):
    return [{"params": params[:1], "weight_decay": 0.01, **group_opts}, {"params": params[1:], "weight_decay": 0.0}]


@pytest.mark.parametrize("cls", [FusedLAMB, FusedAdam])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fast_path_is_taken(cls, adam_w_mode):
    """Fails on the foreach-only fallback: every group of a plain fp32 step goes through torch's kernel."""
    params = make_params([(8,), (3, 4)], torch.float32, 0)
    opt = cls(two_groups(params), adam_w_mode=adam_w_mode)
    with kernel_calls() as calls:
        opt.step()
        opt.step()
    if cls is FusedLAMB and not adam_w_mode:  # L2 mode with decay: the kernel would decay its stand-in param
        assert calls == ["_fused_adam_", "_fused_adam_"]  # only the group without decay
    else:
        assert len(calls) == 4


@pytest.mark.parametrize(
    "opts",
    [{"bias_correction": False}, {"grad_averaging": False}],
    ids=["no-bias-correction", "no-grad-averaging"],
)
def test_fast_path_not_taken_where_math_differs(opts):
    """The kernel always bias-corrects and always averages (beta3 = 1 - beta1): such groups use foreach ops."""
    params = make_params([(8,), (3, 4)], torch.float32, 1)
    opt = FusedLAMB([{"params": params, **opts}])
    with kernel_calls() as calls:
        lamb_step_and_check(opt)
    assert calls == []


# the monkeypatched values are the same for every example: nothing to reset between them
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    shapes=SHAPES,
    seed=st.integers(0, 2**16),
    master=st.booleans(),
    inv_scale=st.sampled_from([1.0, 2.0**-10, 1 / 3000.0]),
    grad_scale=st.sampled_from([1e-3, 1.0, 100.0]),
    adam_w_mode=st.booleans(),
    transposed=st.booleans(),
)
def test_matches_reference_through_the_fast_path(
    shapes, seed, master, inv_scale, grad_scale, adam_w_mode, transposed, monkeypatch
):
    """LAMB and Adam through the kernel, within the float64-reference budgets: loss scale (not a power of two
    too), clipping active (grad_scale 100) or not, bf16 grads of fp32 masters, non-contiguous grads, and
    batches of a few elements so that lists span several batches and scratch views."""
    monkeypatch.setattr(fb_scratch, "_BATCH", 128)
    dtype = torch.bfloat16 if master else torch.float32
    for cls in (FusedLAMB, FusedAdam):
        params = make_params(shapes, dtype, seed)
        set_grads(params, seed + 1, scale=grad_scale / inv_scale)
        if transposed:
            for p in params:
                p.grad = p.grad.t().contiguous().t() if p.grad.dim() == 2 else p.grad
        opt = cls(two_groups(params), adam_w_mode=adam_w_mode, master_weights=master)
        for k in range(2):
            opt.grad_scale = torch.full((), 1 / inv_scale)
            opt.found_inf = torch.zeros(())
            grads = [p.grad.clone() for p in params]
            with kernel_calls() as calls:
                if cls is FusedLAMB:
                    lamb_step_and_check(opt, inv_scale=inv_scale)
                else:
                    adam_step_and_check(opt, adam_w_mode=adam_w_mode, inv_scale=inv_scale)
            # LAMB's L2 mode with decay stays on foreach ops (test_fast_path_is_taken); the other group goes fast
            assert calls or (cls is FusedLAMB and not adam_w_mode and len(params) == 1), "fast path not taken"
            assert all(torch.equal(p.grad, g) for p, g in zip(params, grads)), "a grad was written"
            set_grads(params, seed + 2 + k, scale=grad_scale / inv_scale)


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("cls", [FusedLAMB, FusedAdam])
def test_tensors_split_into_batches_with_hostile_layouts(cls, master, monkeypatch):
    """Tensors larger than a batch run in flat pieces (stage 1 piece by piece, LAMB's update once the last
    piece is in): with non-contiguous grads and model params (transposed), within the float64-reference budgets,
    model copies bit for bit ``round(master)``; and through the kernel."""
    monkeypatch.setattr(fb_scratch, "_BATCH", 128)
    dtype = torch.bfloat16 if master else torch.float32
    params = make_params([(300,), (40, 9), (7,), (130,)], dtype, 11)
    params[1] = torch.nn.Parameter(params[1].detach().t().contiguous().t())  # non-contiguous model param
    for k, p in enumerate(params):
        g = torch.randn(p.shape[::-1], generator=torch.Generator().manual_seed(20 + k)).to(dtype)
        p.grad = g.t() if p.dim() == 2 else g  # a non-contiguous grad for the 2-D param
    opt = cls(two_groups(params), master_weights=master)
    for _ in range(2):
        with kernel_calls() as calls:
            if cls is FusedLAMB:
                lamb_step_and_check(opt)
            else:
                adam_step_and_check(opt, adam_w_mode=True)
        assert calls, "fast path not taken"
        for i, p in enumerate(params):  # adam_step_and_check does not look at the model copies
            master = opt.state[p].get("master")
            assert master is None or torch.equal(p.detach(), master.to(p.dtype)), f"model copy {i} != round(master)"


def fast_and_foreach(dtype: torch.dtype, steps: int, *, scale: float, grad_scale: float) -> list[list[torch.Tensor]]:
    """The params after the same LAMB steps through the kernel and through the foreach sequence."""
    results = []
    for block in (contextlib.nullcontext, fb_step.foreach_only):
        params = make_params([(64,), (16, 16), (7,)], dtype, 5, scale=scale)
        set_grads(params, 6, scale=grad_scale)
        opt = FusedLAMB(two_groups(params))
        with block(), kernel_calls() as calls:
            for _ in range(steps):
                opt.step()
        assert bool(calls) == (block is contextlib.nullcontext)
        results.append([p.detach().clone() for p in params])
    return results


def test_fast_path_and_foreach_path_agree():
    """The same LAMB steps through the kernel and through the foreach sequence: a few fp32 roundings apart."""
    for a, b in zip(*fast_and_foreach(torch.float32, 3, scale=1.0, grad_scale=50.0)):  # clipping active
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("scale", [1.0, 1e40])
def test_float64_lamb_trust_ratio_has_float64_norms(scale):
    """float64 params through the kernel: the trust ratio's norms are float64 (fp32 norms of params around
    1e40 would be inf, and lose float64's precision at any scale), so the fast path agrees with the float64
    foreach sequence to float64 rounding."""
    for fast, slow in zip(*fast_and_foreach(torch.float64, 2, scale=scale, grad_scale=0.01)):
        assert torch.isfinite(fast).all()
        torch.testing.assert_close(fast, slow, rtol=1e-13, atol=0)


def test_found_inf_skips_before_the_kernel():
    params = make_params([(8,), (3, 4)], torch.float32, 2)
    opt = FusedLAMB(two_groups(params))
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.ones(())
    with kernel_calls() as calls:
        opt.step()
    assert calls == []
    assert all(torch.equal(p, b) for p, b in zip(params, before))


EDGE = [0.0, -0.0, 1e-45, 2.0**-130, 1e-30, 2.0**-61, 1.0, 3.0e19, 1.0e30, 3.4e38, math.inf, -math.inf, math.nan]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lists=st.lists(st.lists(st.sampled_from(EDGE), min_size=1, max_size=6), min_size=1, max_size=4),
    inv=st.sampled_from([1.0, 2.0**-16, 4.0, 1 / 3.0]),
)
def test_one_read_norm_equals_two_read_norm(lists, inv, monkeypatch):
    """``_max_norms`` reads a tensor's max-norm only where it may matter; the norm and the flag must be bit for
    bit those of the two-read computation (true max-norms everywhere), inf/NaN, overflow and tiny values in."""
    grads = [torch.tensor(values, dtype=torch.float32) for values in lists]
    inv64 = torch.tensor([inv], dtype=torch.float64)
    flag_one = torch.zeros(1)
    norm_one = F.check_and_norm(grads, inv64, flag_one)

    def true_max(chosen, norms, inv):
        return torch.stack(torch._foreach_norm(list(chosen), float("inf"))).tolist()

    monkeypatch.setattr(fb_l2norm, "_max_norms", true_max)
    flag_two = torch.zeros(1)
    norm_two = F.check_and_norm(grads, inv64, flag_two)
    assert torch.equal(flag_one, flag_two)
    if not bool(flag_two):
        assert torch.equal(norm_one, norm_two), (norm_one, norm_two)


EDGE_FINITE = [v for v in EDGE if math.isfinite(v)]


@contextlib.contextmanager
def dot_threshold(elements: int, batch: int | None = None):
    """``fb_scratch._DOT_MIN`` (and ``_BATCH``) set for the block: 1 sends every contiguous fp32/fp16/bf16
    tensor to ``torch.dot``; a small batch converts low-precision tensors in several pieces."""
    old = fb_scratch._DOT_MIN, fb_scratch._BATCH
    fb_scratch._DOT_MIN = elements
    fb_scratch._BATCH = batch or old[1]
    try:
        yield
    finally:
        fb_scratch._DOT_MIN, fb_scratch._BATCH = old


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    edges=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(EDGE)), max_size=4),
    exponent=st.integers(-130, 120),
    inv=st.sampled_from([1.0, 2.0**-16, 2.0**20, 1 / 3.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    dot_min=st.sampled_from([1, 1 << 30]),
    batch=st.sampled_from([64, None]),
    seed=st.integers(0, 2**16),
)
def test_cpu_check_and_norm_matches_float64_reference(sizes, edges, exponent, inv, dtype, dot_min, batch, seed):
    """The CPU check-and-norm (``torch.dot`` sums of squares of fp32 tensors and of bf16 tensors converted in
    scratch pieces of ``_BATCH`` elements, ``_foreach_norm`` below ``_DOT_MIN`` elements) against the float64
    reference ``fp16kit.numerics.reference.l2norm``: the flag exactly (inf/NaN, and finite grads that overflow
    only once scaled), the norm within ``gamma(n)`` plus the final roundings, at any magnitude (the fp32 sums of
    squares over- or underflow from ~1e19 and ~1e-19 on; those tensors are repaired in float64)."""
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=gen, dtype=torch.float64) * 2.0**exponent).to(dtype) for n in sizes]
    for i, value in edges:
        g = grads[i % len(grads)]
        g.view(-1)[seed % g.numel()] = value
    found = torch.zeros(1)
    with dot_threshold(dot_min, batch):
        norm = float(F.check_and_norm(grads, torch.tensor([inv], dtype=torch.float64), found))
    want, _, want_found = reference.l2norm(grads, inv)
    assert bool(found) == want_found
    if want_found:
        return
    n = sum(g.numel() for g in grads)
    budget = gamma(n, torch.float32) + 3 * 2.0**-24
    if want * (1 - budget) > torch.finfo(torch.float32).max:  # the fp32 result overflows
        assert norm == math.inf
        return
    # scaled elements that are subnormal in the reference carry an absolute error of up to 2**-150 each
    assert abs(norm - want) <= budget * want + math.sqrt(n) * 2.0**-149, (norm, want)


@settings(max_examples=20, deadline=None)
@given(
    values=st.lists(st.sampled_from([*EDGE_FINITE, 0.5, -2.0, 7.0]), min_size=1, max_size=40),
    scale_exp=st.integers(-60, 60),
)
def test_sumsq32_is_an_fp32_sum_of_squares(values, scale_exp):
    """``_sumsq32`` (``torch.dot`` for fp32, ``_foreach_norm`` for small or other-dtype tensors) is a sum of squares
    with fp32 accumulation: within gamma(n) of the float64 sum where fp32 can hold it, inf (or beyond fp32's range)
    where it overflows fp32 (``_max_norms``/``_repair_fp32_norms`` redo such tensors in float64), NaN propagated."""
    x = torch.tensor(values, dtype=torch.float64) * 2.0**scale_exp
    xs = [x.float(), torch.stack([x.float(), x.float()], 1)[:, 0], x.to(torch.bfloat16)]  # strided: not dot
    for t, dot_min in itertools.product(xs, [1, 1 << 30]):
        with dot_threshold(dot_min):
            got = fb_scratch._sumsq32([t])[0]
        exact = math.fsum(v * v for v in t.to(torch.float64).tolist())
        if exact > 3.0e38:
            assert got == math.inf or got >= 3.0e38
        elif exact >= 2.0**-100:
            assert abs(got - exact) <= (gamma(t.numel(), torch.float32) + 2.0**-24) * exact + t.numel() * 2.0**-149
    nan = torch.tensor([*values, math.nan], dtype=torch.float32)
    for dot_min in (1, 1 << 30):
        with dot_threshold(dot_min):
            assert math.isnan(fb_scratch._sumsq32([nan])[0])


def test_native_build_never_stalls_a_step(monkeypatch):
    """FP16KIT_CPU_NATIVE=1 (enabled, not built): steps take the torch path while the build runs in a thread."""
    release = threading.Event()
    started = threading.Event()

    def slow_compile():
        started.set()
        release.wait(30)
        _cpu_native._build["error"] = RuntimeError("no compiler in this test")

    monkeypatch.setattr(_cpu_native, "_compile", slow_compile)
    monkeypatch.setattr(_cpu_native, "_module", None)
    monkeypatch.setattr(_cpu_native, "_state", {"enabled": True})
    monkeypatch.setattr(_cpu_native, "_build", {"thread": None, "error": None})
    params = make_params([(8,), (3, 4)], torch.float32, 3)
    opt = FusedLAMB(two_groups(params))
    try:
        with kernel_calls() as calls:
            lamb_step_and_check(opt)  # would block here if the build ran in the caller's thread
        assert started.wait(10) and calls, "the step did not go on on the torch path during the build"
    finally:
        release.set()
        _cpu_native._build["thread"].join(30)
    with pytest.warns(UserWarning, match="native CPU LAMB unavailable"):
        assert not _cpu_native.enabled()


def test_native_build_name_is_keyed_by_cpu_features(monkeypatch):
    name = _cpu_native.build_name()
    monkeypatch.setattr(_cpu_native, "cpu_features", lambda: "x86_64|other cpu|avx avx2 avx512f")
    assert _cpu_native.build_name() != name
    assert _cpu_native.build_name().startswith("fp16kit_cpu_lamb_v")


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("master", [False, True])
def test_adam_reads_the_caller_grads_in_one_kernel_call(scaled, master, monkeypatch):
    """FusedAdam's fast path calls torch's kernel once per group when it reads the caller's grads as they are
    and writes no model copies (batches would only add host work); with a scaled-grad copy or model copies to
    write from cache it goes batch by batch. Within the float64-reference budgets either way."""
    monkeypatch.setattr(fb_scratch, "_BATCH", 128)
    dtype = torch.bfloat16 if master else torch.float32
    params = make_params([(300,), (40, 9), (7,), (130,), (200,)], dtype, 3)
    set_grads(params, 4)
    opt = FusedAdam(two_groups(params), master_weights=master)
    for k in range(2):
        if scaled:
            opt.grad_scale = torch.full((), 3.0)
            opt.found_inf = torch.zeros(())
        with kernel_calls() as calls:
            adam_step_and_check(opt, adam_w_mode=True, inv_scale=1 / 3.0 if scaled else 1.0)
        assert len(calls) == 2 if not (scaled or master) else len(calls) > 2
        set_grads(params, 5 + k)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([1, 5, 64, 300]), min_size=1, max_size=5),
    src_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    factor=st.sampled_from([1.0, -0.01, 2.0**-10, 1 / 3000.0, 0.3]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_scaled_scratch_copies_round_once(sizes, src_dtype, factor, transposed, seed):
    """``_scaled_into`` (the scaled grads and LAMB's ``-wd p`` in scratch, one op per lone tensor, one copy and
    one multiply for a batch of many): bit for bit ``fp32(src) * fp32(factor)`` rounded once, whichever way ran."""
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(n, 2, generator=gen).to(src_dtype) for n in sizes]
    if transposed:
        srcs = [s.t().contiguous().t() for s in srcs]
    flat, out = fb_scratch._scratch_views("test_scaled", [torch.empty(s.shape) for s in srcs])
    fb_scratch._scaled_into(flat, out, srcs, factor)
    f32 = torch.tensor(factor, dtype=torch.float32).double()
    for o, s in zip(out, srcs):
        assert torch.equal(o, (s.double() * f32).float()), "not one rounding of the exact product"


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 3, 64, 257]), min_size=1, max_size=12),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    scale_exp=st.integers(-70, 60),
    edge=st.sampled_from([None, math.inf, math.nan, 3.0e38]),
    tiled=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sumsq32_of_many_small_tensors(sizes, dtype, scale_exp, edge, tiled, seed):
    """Many small tensors (the gathered, segment-summed path of ``_sumsq32``): each tensor's sum equals its own
    fp32 sum of squares within gamma(n) (an empty one: 0), inf where it overflows fp32, NaN propagated; the same
    whether the tensors are gathered or already tile a buffer (``tiled``)."""
    gen = torch.Generator().manual_seed(seed)
    ts = [(torch.randn(n, generator=gen, dtype=torch.float64) * 2.0**scale_exp).to(dtype) for n in sizes]
    if edge is not None and ts[-1].numel():
        ts[-1][0] = edge
    flat = None
    if tiled and dtype is torch.float32:
        flat = torch.cat([t.reshape(-1) for t in ts])
        ts = list(flat.split(sizes))
    got = fb_scratch._sumsq32(ts, tiled=flat)
    assert len(got) == len(ts)
    for t, value in zip(ts, got):
        x = t.to(torch.float64)
        if bool(torch.isnan(x).any()):
            assert math.isnan(value)
            continue
        exact = float((x.float().double() ** 2).sum())  # the squares of the fp32 values, summed exactly-ish
        if not math.isfinite(exact) or exact > 3.4e38:
            assert value == math.inf
        else:
            squares = [v * v for v in x.tolist()]
            tol = gamma(max(t.numel(), 1), torch.float32) * math.fsum(squares) + (t.numel() + 1) * 2.0**-149
            assert abs(value - math.fsum(squares)) <= tol + 2.0**-24 * math.fsum(squares), (value, exact)


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 5, 64]), min_size=8, max_size=20),
    seed=st.integers(0, 2**16),
)
def test_add_scaled_is_the_per_tensor_add_within_one_rounding(sizes, seed):
    """``_add_scaled`` (many small tensors: one multiply by per-element factors, one ``_foreach_add_``) against a
    per-tensor ``p + alpha * buf`` in float64: within one rounding of the product and one of the sum."""
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=gen) for n in sizes]
    flat = torch.randn(sum(sizes), generator=gen)
    buf = list(flat.split(sizes))
    exponents = torch.randint(-6, 2, (len(sizes),), generator=gen).tolist()
    alphas = [float(torch.rand((), generator=gen)) * 10.0**e for e in exponents]
    want = [q.double() + a * b.double() for q, b, a in zip(p, buf, alphas)]
    scale = [b.double().abs() * abs(a) for b, a in zip(buf, alphas)]
    fb_scratch._add_scaled(p, buf, flat, alphas)
    for q, w, s in zip(p, want, scale):
        bound = 2.0**-24 * (w.abs() + 2 * s) + 2.0**-149
        assert bool(((q.double() - w).abs() <= bound).all())


def test_layout_verdicts_follow_the_plan(monkeypatch):
    """The fused path's layout verdicts are kept per plan group: a grad swapped for a non-contiguous view of the
    same memory (same address: only the metadata guard notices) is read as it is, not as the contiguous grad
    before it; the step still equals a fresh optimizer's on the same inputs."""
    params = make_params([(4, 6), (5,)], torch.float32, 7)
    twin = [p.detach().clone().requires_grad_() for p in params]
    opt, ref = FusedAdam(params), FusedAdam(twin)
    for q, t in zip(params, twin):
        q.grad = torch.full_like(q, 0.01)
        t.grad = q.grad.clone()
    for _ in range(2):
        opt.step()
        ref.step()
    old = params[0].grad
    old.copy_(torch.randn(4, 6))
    params[0].grad = old.view(6, 4).t()  # the same memory and shape, other strides
    assert params[0].grad.data_ptr() == old.data_ptr() and not params[0].grad.is_contiguous()
    twin[0].grad = params[0].grad.contiguous()
    calls = []
    original = fb_scratch._reads_grads_as_they_are
    monkeypatch.setattr(fb_adam, "_reads_grads_as_they_are", lambda *a: calls.append(1) or original(*a))
    opt.step()
    ref.step()
    assert calls, "the new grad layout was not looked at"
    for q, t in zip(params, twin):
        assert torch.equal(q.detach(), t.detach())
