"""The worked example of docs/numerics.md, verbatim: the documentation must not lie."""

import torch
from hypothesis import given, settings

from fp16kit.numerics import assert_bitwise_equal, reference
from fp16kit.numerics import strategies as fst


def my_scale_to_half(x: torch.Tensor, s: float) -> tuple[torch.Tensor, bool]:
    y = (x.float() * s).half()
    return y, not bool(torch.isfinite(y).all())


@settings(max_examples=200, deadline=None)
@given(x=fst.float_tensors(torch.float32, edges=fst.EDGE_CLASSES, cast_to=torch.float16), s=fst.scales())
def test_my_scale_to_half(x, s):
    got, overflow = my_scale_to_half(x, s)
    ref = reference.unscale_and_check([x], s, [torch.float16])  # the float64 spec of exactly this op
    assert_bitwise_equal(got, ref.outputs[0])
    assert overflow == ref.found_inf
