"""Layouts the kernels must get right or reject, the same way on both backends (issue 9, items 1, 2, 3, 5).

Every test here runs on the Triton interpreter and the torch fallback. The rules (docs/kernels.md, "Memory
layouts"): an output may share memory only with its own input as the identical view (in place); repeated or
partially overlapping outputs, outputs with internal overlap and negative-bit outputs raise ``ValueError``;
negative-bit inputs are resolved; every written tensor's ``_version`` is bumped.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp16kit.kernels import copy_, l2norm, unscale_and_check
from fp16kit.kernels.engine import table as _table
from fp16kit.numerics import assert_bitwise_equal, reference
from fp16kit.numerics import strategies as fst

BACKENDS = [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def neg_view(values: torch.Tensor) -> torch.Tensor:
    """A real tensor with the negative bit whose logical values are ``values`` (as ``complex.conj().imag``)."""
    c = torch.complex(torch.zeros_like(values), -values)
    view = c.conj().imag
    assert view.is_neg() and torch.equal(view, values)
    return view


# --- item 1: in place decided per pair -------------------------------------------------------------------------


def test_mixed_in_place_and_out_of_place_pairs(backend):
    """Issue 9: ``unscale_and_check([a, b], s, f, out=[a, c])`` unscales ``a`` in place AND writes ``b * s`` into
    ``c`` (the fallback used to decide "in place" from the first pair and left ``c`` unscaled garbage)."""
    a = torch.full((5000,), 8.0)
    b = torch.arange(6000, dtype=torch.float32)
    c = torch.full((6000,), 1.5e19)  # stale contents must not survive
    found = torch.zeros(1)
    unscale_and_check([a, b], 0.25, found, out=[a, c])
    assert torch.equal(a, torch.full((5000,), 2.0))
    assert torch.equal(c, b * 0.25)
    assert torch.equal(b, torch.arange(6000, dtype=torch.float32))  # the out-of-place input is only read
    assert not bool(found)


def test_mixed_pairs_with_fp16_grads_into_fp32_masters_and_norm(backend):
    """The O1/O2 shape: some grads unscaled in place, some into masters of another dtype, with the norm."""
    g16 = torch.linspace(-3, 3, 4097).half()
    g32 = torch.linspace(-1, 1, 300)
    m32 = torch.full((4097,), float("nan"))
    sq = torch.zeros(1, dtype=torch.float64)
    found = torch.zeros(1)
    ref = reference.unscale_and_check([g16, g32], 0.5, [torch.float32, torch.float32])
    unscale_and_check([g16, g32], 0.5, found, out=[m32, g32], sq_norm=sq)
    assert_bitwise_equal(m32, ref.outputs[0])
    assert_bitwise_equal(g32, ref.outputs[1])
    assert abs(float(sq) - ref.sq_norm) <= 1e-12 * ref.sq_norm and not bool(found)


# --- item 2: overlap rules ---------------------------------------------------------------------------------------


def test_repeated_tensor_in_an_in_place_list_is_rejected(backend):
    """Issue 9: a repeated in-place tensor was multiplied twice on one backend and once on the other."""
    a = torch.ones(10)
    with pytest.raises(ValueError, match=r"tensors\[0\] is the same memory as tensors\[1\].*written once"):
        unscale_and_check([a, a], 0.5, torch.zeros(1))
    assert torch.equal(a, torch.ones(10))  # rejected before anything was written


def test_repeated_output_is_rejected(backend):
    c = torch.empty(10)
    with pytest.raises(ValueError, match=r"out\[0\] is the same memory as out\[1\]"):
        unscale_and_check([torch.ones(10), torch.ones(10)], 0.5, torch.zeros(1), out=[c, c])
    with pytest.raises(ValueError, match=r"dst\[0\] is the same memory as dst\[1\]"):
        copy_([c, c], [torch.ones(10), torch.ones(10)])


@pytest.mark.parametrize("shift", [1, 4095, 4096, 4097])
def test_partial_overlap_of_output_and_input_is_rejected(backend, shift):
    """Issue 9: out/input (and copy_ dst/src) overlapping by a shift were silently wrong at the chunk boundary on
    the Triton path (the fallback raised a RuntimeError); now both raise the same ValueError."""
    buf = torch.arange(20000, dtype=torch.float32)
    src, dst = buf[:8000], buf[shift : shift + 8000]
    with pytest.raises(ValueError, match=r"out\[0\] partially overlaps tensors\[0\]"):
        unscale_and_check([src], 0.5, torch.zeros(1), out=[dst])
    with pytest.raises(ValueError, match=r"dst\[0\] partially overlaps src\[0\]"):
        copy_([dst], [src])
    assert torch.equal(buf, torch.arange(20000, dtype=torch.float32))


def test_output_that_is_another_pairs_input_is_rejected(backend):
    a, b, c = torch.ones(10), torch.ones(10), torch.ones(10)
    with pytest.raises(ValueError, match=r"out\[0\] is tensors\[1\] in memory"):
        unscale_and_check([a, b], 0.5, torch.zeros(1), out=[b, c])
    with pytest.raises(ValueError, match=r"dst\[1\] overlaps src\[0\]"):
        copy_([c, a[2:]], [a, b[2:]])
    # mixed dtypes of one storage: an fp16 output over the bytes of an fp32 input is a partial overlap
    raw = torch.zeros(4000)
    with pytest.raises(ValueError, match="partially overlaps"):
        copy_([raw.view(torch.float16)[:4000]], [raw])


def test_outputs_with_internal_overlap_are_rejected(backend):
    expanded = torch.zeros(1, 8).expand(4, 8)
    with pytest.raises(ValueError, match=r"tensors\[0\] has internal overlap.*expanded"):
        unscale_and_check([expanded], 0.5, torch.zeros(1))
    with pytest.raises(ValueError, match=r"out\[0\] has internal overlap"):
        unscale_and_check([torch.ones(4, 8)], 0.5, torch.zeros(1), out=[expanded])
    with pytest.raises(ValueError, match=r"dst\[0\] has internal overlap"):
        copy_([expanded], [torch.ones(4, 8)])
    weird = torch.zeros(20).as_strided((4, 4), (2, 1))  # overlapping rows without a stride 0
    with pytest.raises(ValueError, match="internal overlap"):
        copy_([weird], [torch.ones(4, 4)])


def test_allowed_sharing(backend):
    """Reads may share memory; the identical view is in place; disjoint interleaved views are fine."""
    x = torch.linspace(-2, 2, 5000)
    # l2norm and copy_ read the same input twice
    _, per = l2norm([x, x], per_tensor=True)
    assert torch.equal(per[0], per[1])
    d1, d2 = torch.empty(5000, dtype=torch.float16), torch.empty(5000)
    copy_([d1, d2], [x, x])
    assert_bitwise_equal(d1, x.half()) and assert_bitwise_equal(d2, x)
    # the identical view is in place, for unscale and for copy_
    y = x.clone()
    unscale_and_check([y], 2.0, torch.zeros(1), out=[y])
    assert torch.equal(y, x * 2)
    copy_([y], [y])
    assert torch.equal(y, x * 2)
    # even and odd elements of one buffer: the spans overlap but no element is shared
    buf = torch.empty(10000)
    unscale_and_check([x, -x], 0.5, torch.zeros(1), out=[buf[0::2], buf[1::2]])
    assert torch.equal(buf[0::2], x * 0.5) and torch.equal(buf[1::2], -x * 0.5)
    # an expanded *input* is only read
    row = torch.arange(8.0)
    out = torch.empty(4, 8)
    unscale_and_check([row.expand(4, 8)], 0.5, torch.zeros(1), out=[out])
    assert torch.equal(out, row.expand(4, 8) * 0.5)


# --- neg / conj bits ---------------------------------------------------------------------------------------------


def test_negative_bit_inputs_are_resolved(backend):
    """Issue 9: ``t.conj().imag`` was read as raw memory by the Triton path and lost its sign."""
    values = torch.linspace(-5, 5, 4100)
    view = neg_view(values)
    out = torch.empty(4100)
    unscale_and_check([view], 0.5, torch.zeros(1), out=[out])
    assert torch.equal(out, values * 0.5)
    dst = torch.empty(4100, dtype=torch.float16)
    copy_([dst], [view])
    assert torch.equal(dst, values.half())
    total = l2norm([view])  # squares: the sign does not matter, raw memory is fine
    assert torch.equal(total, l2norm([values]))


def test_negative_bit_outputs_are_rejected(backend):
    view = neg_view(torch.ones(4100))
    with pytest.raises(ValueError, match=r"tensors\[0\] is a negative-bit view"):
        unscale_and_check([view], 0.5, torch.zeros(1))
    with pytest.raises(ValueError, match=r"out\[0\] is a negative-bit view"):
        unscale_and_check([torch.ones(4100)], 0.5, torch.zeros(1), out=[view])
    with pytest.raises(ValueError, match=r"dst\[0\] is a negative-bit view"):
        copy_([view], [torch.ones(4100)])
    assert torch.equal(view, torch.ones(4100))


# --- item 5: version counters ------------------------------------------------------------------------------------


def test_every_write_bumps_the_version(backend):
    """Issue 9: Triton writes did not bump ``_version`` (the torch backend did): autograd could not see a modified
    saved tensor and autocast's weight cache served stale casts."""
    grads = [torch.randn(5000), torch.randn(10).half()]
    found = torch.zeros(1)
    before = [g._version for g in grads] + [found._version]
    unscale_and_check(grads, 0.5, found)
    assert all(g._version > v for g, v in zip([*grads, found], before))
    masters = [torch.empty(5000), torch.empty(10)]
    sq = torch.zeros(1)
    before = [m._version for m in masters] + [sq._version]
    unscale_and_check(grads, 0.5, found, out=masters, sq_norm=sq)
    assert all(t._version > v for t, v in zip([*masters, sq], before))
    model = [torch.empty(5000, dtype=torch.bfloat16), torch.empty(10, dtype=torch.float16)]
    before = [m._version for m in model]
    copy_(model, masters)
    assert all(m._version > v for m, v in zip(model, before))
    before = found._version
    l2norm(grads, found_inf=found)
    assert found._version > before


def test_autograd_sees_a_kernel_write_to_a_saved_tensor(backend):
    w = torch.randn(64, requires_grad=True)
    x = torch.randn(64)
    y = (w * x).sum()  # saves x for the backward
    with torch.no_grad():
        copy_([x], [torch.zeros(64)])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_autocast_weight_cache_sees_a_master_copy_into_the_weights(backend):
    """Inside an ``fp16kit.amp.autocast`` region the fp16 cast of a weight is cached per ``_version``: a
    ``copy_`` of new values into the weight (the O2 master -> model copy) must invalidate it."""
    from fp16kit.amp import autocast

    w = torch.nn.Parameter(torch.ones(16, 16))
    x = torch.ones(2, 16)
    with autocast(torch.float16):
        before = torch.nn.functional.linear(x, w)
        with torch.no_grad():
            copy_([w], [torch.full((16, 16), 2.0)])
        after = torch.nn.functional.linear(x, w)
    assert float(before[0, 0]) == 16.0 and float(after[0, 0]) == 32.0


@pytest.mark.parametrize(
    "backend", [pytest.param("interpreter", marks=pytest.mark.interpreter), "torch"]
)
def test_autocast_weight_cache_sees_an_optimizer_step(backend):
    """The issue's scenario: ``optimizer.step()`` inside an autocast region must not leave the cache serving
    pre-step weights (FusedAdam writes with its own kernel; the version bump there belongs to fp16kit.optim)."""
    from fp16kit.amp import autocast
    from fp16kit.optim import FusedAdam

    w = torch.nn.Parameter(torch.ones(16, 16))
    opt = FusedAdam([w], lr=0.5)
    x = torch.ones(2, 16)
    with autocast(torch.float16):
        y = torch.nn.functional.linear(x, w)
        y.float().sum().backward()
        opt.step()
        after = torch.nn.functional.linear(x, w)
    expected = torch.nn.functional.linear(x.half(), w.detach().half())
    assert torch.equal(after, expected), "autocast served the pre-step weights"


# --- item 3: the address table verifies what it relies on --------------------------------------------------------


def test_address_table_rejects_rows_that_would_leave_a_tensor():
    """Issue 9: a truncated ``exp_avg`` overwrote neighbouring memory, an empty one segfaulted: the table (used by
    every launcher, the optimizer kernels included) now refuses rows whose sizes, dtypes or layouts differ."""
    p = [torch.zeros(100), torch.zeros(5000)]
    with pytest.raises(ValueError, match=r"list 1, tensor 1 has 10 elements but list 0's tensor has 5000"):
        _table.chunk_table([p, [torch.zeros(100), torch.zeros(10)]])
    with pytest.raises(ValueError, match=r"list 1, tensor 0 has 0 elements"):
        _table.chunk_table([p, [torch.zeros(0), torch.zeros(5000)]])
    with pytest.raises(ValueError, match=r"list 1, tensor 1 has dtype torch.float16"):
        _table.chunk_table([p, [torch.zeros(100), torch.zeros(5000, dtype=torch.float16)]])
    with pytest.raises(ValueError, match=r"list 0, tensor 0 is not contiguous"):
        _table.chunk_table([[torch.zeros(20, 10).t()], [torch.zeros(200)]])
    with pytest.raises(ValueError, match="list 1 has 1 tensors but list 0 has 2"):
        _table.chunk_table([p, [torch.zeros(100)]])


@pytest.mark.interpreter
def test_adam_launcher_with_a_truncated_moment_raises_instead_of_writing_past_it():
    """The raw-address optimizer kernels go through the same table: a short ``exp_avg`` is an error, not a write
    past its end (the optimizer's own load_state_dict checks are fp16kit.optim's; this is the last line)."""
    from fp16kit.kernels.triton.adam import launch_adam

    p, g, v = torch.zeros(5000), torch.ones(5000), torch.zeros(5000)
    guard = torch.zeros(6000)
    m = guard[:4000]  # truncated, inside a larger buffer: the tail must stay untouched
    hp = torch.zeros(16)
    with pytest.raises(ValueError, match=r"list 2, tensor 0 has 4000 elements"):
        launch_adam([p], [g], [m], [v], None, hp, torch.zeros(1), l2_mode=False, decoupled=True)
    assert torch.equal(guard, torch.zeros(6000))


# --- item 4: float64 tensors are unscaled in float64 ------------------------------------------------------------


@pytest.mark.parametrize("inv_scale", [0.1, 1 / 3, 1 / 65536.0 * 1.1, 3.0e-5])
def test_float64_unscale_uses_the_float64_scale(backend, inv_scale):
    """Issue 9: float64 tensors were multiplied by the scale rounded to fp32, which disagrees with fp16kit's own
    float64 reference for every scale that is not a power of two."""
    torch.manual_seed(5)
    x = torch.randn(3000, dtype=torch.float64) * 1000
    ref = reference.unscale_and_check([x], inv_scale)
    got = x.clone()
    unscale_and_check([got], inv_scale, torch.zeros(1))
    assert_bitwise_equal(got, ref.outputs[0])
    assert_bitwise_equal(got, x * inv_scale)
    out = torch.empty(3000, dtype=torch.float64)
    unscale_and_check([x], inv_scale, torch.zeros(1), out=[out])
    assert_bitwise_equal(out, ref.outputs[0])
    # fp32 tensors keep the fp32 scale (one fp32 multiply, the kernel contract)
    x32 = x.float()
    ref32 = reference.unscale_and_check([x32], inv_scale)
    unscale_and_check([x32], inv_scale, torch.zeros(1))
    assert_bitwise_equal(x32, ref32.outputs[0])


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), inv_scale=fst.scales(min_exp=-24, max_exp=8))
def test_float64_unscale_matches_reference_for_any_scale(backend, data, inv_scale):
    """Hypothesis: float64 tensors with edge values, any scale, in place or into any float dtype: bit-exact."""
    out_dtype = data.draw(st.sampled_from([None, torch.float64, torch.float32, torch.float16, torch.bfloat16]))
    x = data.draw(fst.float_tensors(torch.float64, edges=fst.EDGE_CLASSES, scale=inv_scale, cast_to=out_dtype,
                                    exponent_range=(-60, 60)))
    ref = reference.unscale_and_check([x], inv_scale, None if out_dtype is None else [out_dtype])
    found = torch.zeros(1)
    got = x.clone() if out_dtype is None else torch.empty(x.shape, dtype=out_dtype)
    unscale_and_check([got] if out_dtype is None else [x], inv_scale, found, out=None if out_dtype is None else [got])
    assert_bitwise_equal(got, ref.outputs[0])
    assert bool(found) == ref.found_inf


def test_float64_narrows_to_fp16_and_bf16_with_one_rounding(backend):
    """float64 -> fp16/bf16 rounds once (the reference), not twice through fp32 as ``Tensor.copy_`` does: e.g.
    ``1 + 2^-11 + 2^-40`` is above the fp16 tie, so it rounds up to ``1 + 2^-10`` (torch's cast gives 1.0)."""
    x = torch.tensor([1 + 2**-11 + 2**-40, -(1 + 2**-8 + 2**-41), 65519.999, 1e300, -1e-300, 2.0**-25 + 2**-60],
                     dtype=torch.float64)
    for dtype in (torch.float16, torch.bfloat16):
        want = reference.copy([x], [dtype])[0]
        dst = torch.empty(x.shape, dtype=dtype)
        copy_([dst], [x])
        assert_bitwise_equal(dst, want, what=f"copy_ float64 -> {dtype}")
        out = torch.empty(x.shape, dtype=dtype)
        unscale_and_check([x], 1.0, torch.zeros(1), out=[out])
        assert_bitwise_equal(out, want, what=f"unscale float64 -> {dtype}")
    assert float(reference.copy([x], [torch.float16])[0][0]) == 1 + 2**-10 != float(x[:1].half())
    assert float(reference.copy([x], [torch.bfloat16])[0][1]) == -(1 + 2**-7) != float(x[1:2].bfloat16())


def test_in_place_pair_of_another_dtype_with_the_same_width(backend):
    """``out[i]`` may be ``tensors[i]``'s memory viewed as another dtype of the same width (fp16 grads written back
    as bf16): every element is read before it is written, on both backends."""
    torch.manual_seed(6)
    x = torch.randn(5000).half()
    expected = reference.unscale_and_check([x.clone()], 0.5, [torch.bfloat16]).outputs[0]
    unscale_and_check([x], 0.5, torch.zeros(1), out=[x.view(torch.bfloat16)])
    assert_bitwise_equal(x.view(torch.bfloat16), expected)
    y = torch.randn(5000).half()
    expected = reference.copy([y.clone()], [torch.bfloat16])[0]
    copy_([y.view(torch.bfloat16)], [y])
    assert_bitwise_equal(y.view(torch.bfloat16), expected)


def test_the_reported_violation_does_not_depend_on_addresses(backend):
    """Several violations: the one with the smallest indices is reported, wherever the allocator put the tensors
    (so both backends, and every run, give the same message)."""
    buf = torch.zeros(100)
    high, low = buf[50:60], buf[0:10]  # the second pair lies first in memory
    with pytest.raises(ValueError, match=r"tensors\[0\] is the same memory as tensors\[1\]"):
        unscale_and_check([high, high, low, low], 0.5, torch.zeros(1))
    with pytest.raises(ValueError, match=r"dst\[0\] is src\[1\] in memory"):
        copy_([high, low, torch.zeros(10)], [low, high, low])
