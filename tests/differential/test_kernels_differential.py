"""Backend-differential tests of the kernel layer (issue 9, item 1): torch fallback vs Triton interpreter.

Hypothesis draws a *scenario*: a few raw byte buffers and tensors carved out of them with ``as_strided``, in
every float dtype (fp64 included) and adversarial layouts: contiguous slices at any offset (16-byte aligned or
not), transposed, strided, stride-0 expanded, channels_last, 0-size, negative-bit views; outputs that are their
own input (in place, also read as the other 16-bit format), another output, another input, or a partially
overlapping or interleaved piece of the same buffer, in dtypes that reinterpret each other's bytes. The scenario
is built afresh for each backend and the operation (``unscale_and_check``, ``copy_``, ``l2norm``) runs on both.
Then:

- both raise, with the same error class and message, and leave every buffer untouched; or both succeed, with
  bit-identical outputs, the same ``found_inf``, and every byte outside the outputs untouched;
- whether it raises is decided by an independent oracle built from the byte addresses of every element
  (docs/kernels.md, "Memory layouts"): so the backends agree *and* the rule is the documented one;
- successful results match the float64 reference: unscale and copy bit for bit, norms within 1 ulp (fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fp16kit.kernels import (
    Backend,
    check_and_norm,
    copy_,
    l2norm,
    select_backend,
    unscale_and_check,
    use_backend,
)
from fp16kit.numerics import assert_bitwise_equal, assert_ulp_close, reference

pytestmark = pytest.mark.interpreter

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
LAYOUTS = ("flat",) * 5 + ("transposed", "strided", "expanded", "channels_last", "empty")
HALF_WIDTH = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- scenarios ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """How to carve one tensor: which buffer, dtype, layout, shape, element offset, negative bit."""

    buffer: int
    dtype: torch.dtype
    layout: str
    shape: tuple[int, ...]
    offset: int
    neg: bool = False


def _strides(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == "transposed":  # a (r, c) tensor stored column-major: dense, not contiguous
        return (1, shape[0])
    if layout == "strided":  # every other element: not dense
        return (2,)
    if layout == "expanded":  # row 0 repeated: internal overlap when r > 1
        return (0, 1)
    if layout == "channels_last":
        _, c, h, w = shape
        return (h * w * c, 1, w * c, c)
    return torch.empty(shape, device="meta").stride()


def _extent(shape, strides) -> int:
    return 0 if math.prod(shape) == 0 else 1 + sum((n - 1) * s for n, s in zip(shape, strides))


@st.composite
def shapes_for(draw, layout: str) -> tuple[int, ...]:
    small = st.integers(1, 9)
    if layout == "empty":
        return (0,) if draw(st.booleans()) else (3, 0)
    if layout in ("transposed", "expanded"):
        return (draw(small), draw(small))
    if layout == "channels_last":
        return (1, draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    return (draw(st.sampled_from([1, 2, 7, 33, 64, 130])),)


BUFFER_BYTES = 8 * 8 * 260  # room for the largest layout (130 fp64 elements, strided) four times: overlaps happen


@st.composite
def carve(draw, n_buffers: int, shape: tuple[int, ...] | None = None, layout: str | None = None) -> Spec:
    """A tensor spec: a new shape, or (for an output) the shape of its input with any layout that fits it."""
    if layout is None:
        if shape is None:
            layout = draw(st.sampled_from(LAYOUTS))
        else:  # layouts that give this shape
            options = ["flat", "flat"] + (["transposed", "expanded"] if len(shape) == 2 else [])
            options += ["channels_last"] if len(shape) == 4 else []
            options += ["strided"] if len(shape) == 1 else []
            layout = draw(st.sampled_from(options))
    if shape is None:
        shape = draw(shapes_for(layout))
    dtype = draw(st.sampled_from(DTYPES))
    elems = BUFFER_BYTES // dtype.itemsize
    extent = _extent(shape, _strides(layout, shape))
    offset = draw(st.integers(0, elems - extent))
    return Spec(draw(st.integers(0, n_buffers - 1)), dtype, layout, shape, offset, neg=draw(st.integers(0, 24)) == 0)


@dataclass
class Scenario:
    seed: int
    n_buffers: int
    inputs: list[Spec]
    outputs: list[Spec | int | tuple[str, int]] | None  # Spec, ("in", i) = tensors[i], ("out", j) = out[j]


@st.composite
def scenarios(draw, *, with_outputs: bool | None = None) -> Scenario:
    """Inputs carved from 1-3 buffers (so they overlap at random); outputs carved likewise with their input's
    shape, or chosen to be an input (in place, or another pair's) or an earlier output (repeated)."""
    n_buffers = draw(st.integers(1, 3))
    n = draw(st.integers(1, 4))
    inputs = []
    for _ in range(n):
        if inputs and draw(st.integers(0, 7)) == 0:
            inputs.append(draw(st.sampled_from(inputs)))  # the same input twice
        else:
            inputs.append(draw(carve(n_buffers)))
    if with_outputs is None:
        with_outputs = draw(st.booleans())
    outputs = None
    if with_outputs:
        outputs = []
        for i, spec in enumerate(inputs):
            kind = draw(st.sampled_from(["new"] * 5 + ["in_place"] * 3 + ["other_input", "repeat", "reinterpret"]))
            same_shape = [j for j, s in enumerate(inputs) if s.shape == spec.shape]
            if kind == "reinterpret" and spec.dtype in HALF_WIDTH:  # in place, read as the other 16-bit format
                outputs.append(Spec(spec.buffer, HALF_WIDTH[spec.dtype], spec.layout, spec.shape, spec.offset))
            elif kind == "in_place":
                outputs.append(("in", i))
            elif kind == "other_input" and len(same_shape) > 1:
                outputs.append(("in", draw(st.sampled_from([j for j in same_shape if j != i]))))
            elif kind == "repeat" and any(inputs[j].shape == spec.shape for j in range(i)):
                outputs.append(("out", draw(st.sampled_from([j for j in range(i) if inputs[j].shape == spec.shape]))))
            else:
                outputs.append(draw(carve(n_buffers, shape=spec.shape)))
    return Scenario(draw(st.integers(0, 2**31 - 1)), n_buffers, inputs, outputs)


_POOL: list[torch.Tensor] = []


def _pool() -> torch.Tensor:
    """Random fp32 values over 2^-20..2^20 with inf, NaN, +-0 and 3e38 sprinkled in, made once per session:
    scenarios take their bytes from a seed-chosen window of it (cheap, and the same bytes on every build)."""
    if not _POOL:
        gen = torch.Generator().manual_seed(0)
        n = 2 * BUFFER_BYTES // 4
        values = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-20, 20, (n,), generator=gen).float())
        edges = torch.randint(0, n, (12,), generator=gen)
        values[edges] = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 3e38] * 2)
        _POOL.append(values.view(torch.uint8))
    return _POOL[0]


class Built:
    """A scenario's tensors, built afresh (same bytes every time)."""

    def __init__(self, sc: Scenario):
        pool = _pool()
        self.buffers = []
        for k in range(sc.n_buffers):
            start = (sc.seed + 7919 * k) % (BUFFER_BYTES // 4) * 4
            self.buffers.append(pool[start : start + BUFFER_BYTES].clone())
        self.inputs = [self.make(s) for s in sc.inputs]
        self.outputs = None
        if sc.outputs is not None:
            self.outputs = []
            for o in sc.outputs:
                if isinstance(o, Spec):
                    self.outputs.append(self.make(o))
                else:
                    self.outputs.append(self.inputs[o[1]] if o[0] == "in" else self.outputs[o[1]])
        self.snapshot = [b.clone() for b in self.buffers]

    def make(self, spec: Spec) -> torch.Tensor:
        base = self.buffers[spec.buffer].view(spec.dtype)
        t = base.as_strided(spec.shape, _strides(spec.layout, spec.shape), spec.offset)
        return torch._neg_view(t) if spec.neg else t


# --- the oracle: byte addresses of every element -----------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The address of every byte of every element of ``t`` (with repeats, for overlapping layouts)."""
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    idx = torch.arange(_extent(t.shape, t.stride())).as_strided(t.shape, t.stride()).reshape(-1, 1)
    size = t.element_size()
    return (t.data_ptr() + idx * size + torch.arange(size)).reshape(-1)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.element_size(), a.shape, a.stride()) == (b.data_ptr(), b.element_size(), b.shape,
                                                                      b.stride())


def expect_layout_error(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> bool:
    """docs/kernels.md's rules, by brute force: outputs own their elements (no internal overlap, no neg bit),
    share no byte with another output, and share bytes with an input only as that input's own identical view."""
    out_bytes = []
    for t in outputs:
        b = _bytes(t)
        if (t.numel() and t.is_neg()) or b.unique().numel() != b.numel():
            return True
        out_bytes.append(b)
    for i in range(len(outputs)):
        for j in range(i + 1, len(outputs)):
            if torch.isin(out_bytes[i], out_bytes[j]).any():
                return True
    for i, ob in enumerate(out_bytes):
        for j, x in enumerate(inputs):
            if i == j and _same_view(x, outputs[i]):
                continue
            if torch.isin(ob, _bytes(x)).any():
                return True
    return False


# --- running both backends ---------------------------------------------------------------------------------------


def run_both(sc: Scenario, call):
    """``call(built)`` on the torch fallback and on the interpreter, each on a fresh build of the scenario."""
    results = []
    for name in ("torch", "auto"):
        built = Built(sc)
        with use_backend(name):
            expected = Backend.TORCH if name == "torch" else Backend.INTERPRETER
            assert select_backend(torch.device("cpu")).backend is expected
            try:
                value = call(built)
                error = None
            except (ValueError, RuntimeError, TypeError) as exc:
                value, error = None, exc
        results.append((built, value, error))
    (b_torch, _, e_torch), (b_interp, _, e_interp) = results
    assert (type(e_torch), str(e_torch)) == (type(e_interp), str(e_interp)), (e_torch, e_interp)
    if e_torch is not None:
        for b in (b_torch, b_interp):  # rejected before anything was written
            for now, before in zip(b.buffers, b.snapshot):
                assert torch.equal(now, before), "a rejected call wrote memory"
    return results


def assert_untouched_outside(built: Built, written: list[torch.Tensor]) -> None:
    """Every buffer byte that is not part of an output is unchanged (no stray writes; inputs only read)."""
    for k, (now, before) in enumerate(zip(built.buffers, built.snapshot)):
        base = now.data_ptr()
        keep = torch.ones(now.numel(), dtype=torch.bool)
        for t in written:
            if t.numel() and base <= t.data_ptr() < base + now.numel():
                keep[_bytes(t) - base] = False
        assert torch.equal(now[keep], before[keep]), f"buffer {k}: bytes outside the outputs changed"


def values(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_neg().clone()


# --- the three operations ----------------------------------------------------------------------------------------


@SETTINGS
@given(
    sc=scenarios(),
    inv_scale=st.sampled_from([0.5, 2.0**-14, 0.1, 3.0, 1 / 3]),
    with_norm=st.booleans(),
    scale_as_tensor=st.booleans(),
)
def test_unscale_and_check(sc, inv_scale, with_norm, scale_as_tensor):
    probe = Built(sc)
    outs = probe.outputs if probe.outputs is not None else probe.inputs
    in_values = [values(x) for x in probe.inputs]
    should_raise = expect_layout_error(probe.inputs if probe.outputs is not None else [], outs)

    def call(b: Built):
        found = torch.zeros(1)
        sq = torch.zeros(1, dtype=torch.float64) if with_norm else None
        scale = torch.tensor([inv_scale], dtype=torch.float64) if scale_as_tensor else inv_scale
        unscale_and_check(b.inputs, scale, found, out=b.outputs, sq_norm=sq)
        return found, sq

    (bt, vt, et), (bi, vi, _) = run_both(sc, call)
    assert (et is not None) == should_raise, f"expected an error: {should_raise}, got {et!r}"
    event(f"rejected: {str(et).split(' ')[1:3]}" if et is not None else "ran")
    if et is not None:
        return
    out_t = bt.outputs if bt.outputs is not None else bt.inputs
    out_i = bi.outputs if bi.outputs is not None else bi.inputs
    ref = reference.unscale_and_check(in_values, inv_scale, [o.dtype for o in out_t])
    for k, (a, b, r) in enumerate(zip(out_t, out_i, ref.outputs)):
        assert_bitwise_equal(values(a), values(b), what=f"output {k}: torch vs interpreter")
        assert_bitwise_equal(values(a), r.reshape(a.shape), what=f"output {k}: vs reference")
    assert float(vt[0]) == float(vi[0]) == float(ref.found_inf)
    if with_norm and not ref.found_inf:
        for sq in (vt[1], vi[1]):
            assert math.isclose(float(sq), ref.sq_norm, rel_tol=1e-12, abs_tol=1e-300)
    assert_untouched_outside(bt, out_t)
    assert_untouched_outside(bi, out_i)


@SETTINGS
@given(sc=scenarios(with_outputs=True))
def test_copy(sc):
    probe = Built(sc)
    should_raise = expect_layout_error(probe.inputs, probe.outputs)
    src_values = [values(x) for x in probe.inputs]

    (bt, _, et), (bi, _, _) = run_both(sc, lambda b: copy_(b.outputs, b.inputs))
    assert (et is not None) == should_raise, f"expected an error: {should_raise}, got {et!r}"
    event(f"rejected: {str(et).split(' ')[1:3]}" if et is not None else "ran")
    if et is not None:
        return
    expected = reference.copy(src_values, [d.dtype for d in bt.outputs])
    for k, (a, b, r) in enumerate(zip(bt.outputs, bi.outputs, expected)):
        assert_bitwise_equal(values(a), values(b), what=f"dst {k}: torch vs interpreter")
        assert_bitwise_equal(values(a), r, what=f"dst {k}: vs reference")
    assert_untouched_outside(bt, bt.outputs)
    assert_untouched_outside(bi, bi.outputs)


@SETTINGS
@given(sc=scenarios(with_outputs=False), pre_scale=st.sampled_from([1.0, 2.0**-10, 0.3, 2.0**30]))
def test_l2norm(sc, pre_scale):
    def call(b: Built):
        found = torch.zeros(1)
        total, per = l2norm(b.inputs, per_tensor=True, pre_scale=pre_scale, found_inf=found)
        return torch.cat([total.reshape(1), per]), found

    (bt, vt, et), (bi, vi, _) = run_both(sc, call)
    assert et is None, "l2norm only reads: no layout is an error"
    ref_total, ref_per, ref_found = reference.l2norm([values(x) for x in bt.inputs], pre_scale)
    want = reference.round_to_format(torch.tensor([ref_total, *ref_per], dtype=torch.float64), torch.float32)
    for v in (vt, vi):
        assert_ulp_close(v[0], want, 1, dtype=torch.float32, what="norms vs reference")
        assert float(v[1]) == float(ref_found)
    assert_ulp_close(vt[0], vi[0].double(), 1, dtype=torch.float32, what="norms: torch vs interpreter")
    assert_untouched_outside(bt, [])
    assert_untouched_outside(bi, [])


@SETTINGS
@given(sc=scenarios(with_outputs=False), pre_scale=st.sampled_from([1.0, 2.0**-10, 0.3, 2.0**30]))
def test_exact_check_and_norm(sc, pre_scale):
    """The optimizers' check pass with ``exact=True`` (the torch backend in the kernels' arithmetic, as the 8-bit
    moments need: ``fb_l2norm.check_and_norm_exact``) against the float64 reference and the interpreter's kernels:
    the same flag, norms within 1 ulp of the reference and of each other, no byte written."""
    def call(b: Built):
        found = torch.zeros(1)
        return check_and_norm(b.inputs, torch.tensor([pre_scale], dtype=torch.float64), found, exact=True), found

    (bt, vt, et), (bi, vi, _) = run_both(sc, call)
    assert et is None, "the check pass only reads: no layout is an error"
    ref_total, _, ref_found = reference.l2norm([values(x) for x in bt.inputs], pre_scale)
    for norm, found in (vt, vi):
        assert float(found) == float(ref_found)
        if not ref_found:
            want = reference.round_to_format(torch.tensor([ref_total], dtype=torch.float64), torch.float32)
            assert_ulp_close(norm.reshape(1), want, 1, dtype=torch.float32, what="norm vs reference")
    if not ref_found:
        assert_ulp_close(vt[0].reshape(1), vi[0].double().reshape(1), 1, dtype=torch.float32,
                         what="norms: torch vs interpreter")
    assert_untouched_outside(bt, [])
    assert_untouched_outside(bi, [])
