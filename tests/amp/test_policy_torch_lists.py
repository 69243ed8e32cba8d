"""The cast policy covers torch's own CUDA autocast lists, derived at test time from the installed torch.

torch ships the ops and arguments its CUDA autocast tests use in ``torch.testing._internal.autocast_test_lists``
(``AutocastTestLists``). Every op of those lists must get the CUDA list's dtype under fp16kit, in fp16 and bf16,
on the CPU: fp16 lists -> the region's low dtype, fp32 lists -> fp32, "need autocast promote" -> the widest input
dtype, banned -> an error. Both the table (the rule each callable resolves to) and a real call (the output
dtype) are checked. Deliberate differences are listed in ``DIFFERENCES`` with the reason (docs/autocast.md).
"""

from __future__ import annotations

import pytest
import torch
from _torch_autocast_lists import autocast_lists_module

from fp16kit.amp import Rule, autocast
from fp16kit.amp import _torch_lists as TL
from fp16kit.amp import policy as P

LOW = (torch.float16, torch.bfloat16)
IDS = ["fp16", "bf16"]

#: (list, op) -> reason. Ops of torch's CUDA lists that cannot be *called* here (the rule is still checked).
NOT_CALLABLE_ON_CPU = {
    ("torch_fp16", "cudnn_convolution"): "cuDNN only",
    ("torch_fp16", "cudnn_convolution_transpose"): "cuDNN only",
    # torch's entry is ("einsum", equation, 2-D matrices) that do not fit the 4-D equation; torch's own test reads
    # the third element as its skip flag and never calls it. Called with fitting inputs in test_policy.py.
    ("torch_fp16", "einsum"): "torch's list entry is not callable as given",
}
#: (list, op) -> reason. Deliberate differences between fp16kit's policy and torch's CUDA lists (none today).
DIFFERENCES: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def lists():
    return autocast_lists_module().AutocastTestLists(torch.device("cpu"))


def _namespace(attr: str):
    spelling = TL.LIST_RULES[attr][1]
    return {"torch": torch, "nn": torch._C._nn, "linalg": torch._C._linalg, "method": torch.Tensor}[spelling]


def _entries(lists):
    for attr in TL.LIST_RULES:
        for entry in getattr(lists, attr, []):
            yield attr, entry


def test_lists_are_derived_from_the_installed_torch(lists):
    """The library's parse of the file and torch's own objects name the same ops (and there are many)."""
    parsed = TL.torch_cuda_lists()
    for attr in TL.LIST_RULES:
        assert parsed.get(attr, []) == list(dict.fromkeys(e[0] for e in getattr(lists, attr, []))), attr
    assert sum(len(v) for v in parsed.values()) > 80
    assert "layer_norm" in parsed["torch_fp32"]
    # rms_norm joined torch's list in 2.13 (2.11's has none): fp16kit's own table has it FP32 on every torch
    assert P.RESOLVED[torch.rms_norm][0] is Rule.FP32


def test_every_op_of_torchs_cuda_lists_has_the_lists_rule(lists):
    missing = []
    for attr, entry in _entries(lists):
        op = entry[0]
        if (attr, op) in DIFFERENCES:
            continue
        fn = getattr(entry[2], op) if attr == "banned" else getattr(_namespace(attr), op)
        want = Rule[TL.LIST_RULES[attr][0]]
        got = P.RESOLVED.get(fn, (None,))[0]
        if got is not want:
            missing.append(f"{attr}:{op} is {got}, torch's CUDA list says {want}")
    assert not missing, "\n".join(missing)


def _to_low(obj, low):
    if isinstance(obj, torch.Tensor):
        return obj.to(low) if obj.dtype is torch.float16 else obj.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_low(x, low) for x in obj)
    return obj


def _first_tensor(out):
    while isinstance(out, (tuple, list)):
        out = out[0]
    return out


@pytest.mark.parametrize("low", LOW, ids=IDS)
def test_every_op_of_torchs_cuda_lists_runs_in_the_lists_dtype(lists, low):
    wrong = []
    for attr, entry in _entries(lists):
        op = entry[0]
        if (attr, op) in DIFFERENCES or (attr, op) in NOT_CALLABLE_ON_CPU:
            continue
        if attr == "banned":
            args, fn = _to_low(entry[1], low), getattr(entry[2], op)
            with autocast(dtype=low), pytest.raises(RuntimeError, match="unsafe under autocast"):
                fn(*(a.to(low) for a in args))
            continue
        args = _to_low(entry[1], low)
        kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
        if len(entry) > 2 and entry[2] is True:
            continue  # torch's skip flag (TEST_WITH_ROCM) set
        ns = _namespace(attr)
        if attr.startswith("methods"):
            with autocast(dtype=low):
                out = getattr(args[0], op)(*args[1:], **kwargs)
        else:
            with autocast(dtype=low):
                out = getattr(ns, op)(*args, **kwargs)
        rule = TL.LIST_RULES[attr][0]
        want = low if rule == "LOW" else torch.float32
        got = _first_tensor(out).dtype
        if got is not want:
            wrong.append(f"{attr}:{op} returned {got}, torch's CUDA list gives {want}")
    assert not wrong, "\n".join(wrong)
