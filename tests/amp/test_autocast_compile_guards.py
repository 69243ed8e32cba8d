"""Under torch.compile, autocast's table lookups add no per-key dict guards, and a table change still recompiles.

``fp16kit/amp/autocast_mode.py`` answers the by-name lookups made while Dynamo traces (``_compiled_row``,
``_compiled_redirect``) from generated code whose keys are constants, instead of reading ``_BY_NAME`` /
``_REDIRECTS`` (Dynamo guarded those key by key, ``DICT_KEYS_MATCH`` on 137 keys included, and evaluated every
guard on every compiled call), and tests castability by dtype properties instead of a set. The generated functions
are replaced on every table change, so a compiled function traced under the old table must not be reused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp16kit.amp.autocast_mode as am
from fp16kit.amp import autocast, policy_override

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_no_guards_on_the_lookup_tables():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def fn(x):
        h = model(x)
        return h.exp() + h.softmax(-1) + (h @ h.t()).sum()  # by-name lookups: methods and operators on intermediates

    with autocast(dtype=torch.bfloat16):
        explained = torch._dynamo.explain(fn)(torch.randn(4, 8))
    assert explained.graph_break_count == 0
    names = [g.name for g in explained.out_guards]
    for table in ("_BY_NAME", "_REDIRECTS", "_CASTABLE"):
        assert not [n for n in names if table in n], f"guards on {table}"


def test_generated_lookups_follow_table_changes():
    before = am._compiled_row("exp")
    with policy_override(exp="low"):
        assert am._compiled_row("exp") == am._BY_NAME["exp"] != before
    assert am._compiled_row("exp") == before == am._BY_NAME["exp"]


def test_table_change_recompiles():
    def fn(x):
        return (x * 2).exp()  # exp on an intermediate: found by name while compiling

    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    x = torch.randn(4, dtype=torch.bfloat16)
    with autocast(dtype=torch.bfloat16):
        assert fn(x).dtype == compiled(x).dtype == torch.float32  # exp: FP32 row
        with policy_override(exp="low"):
            assert fn(x).dtype == compiled(x).dtype == torch.bfloat16
        assert compiled(x).dtype == torch.float32


def test_generated_lookups_match_the_tables():
    for name, row in am._BY_NAME.items():
        assert am._compiled_row(name) == row
    for name, target in am._REDIRECTS.items():
        assert am._compiled_redirect(name) is target
    for missing in ("no_such_op", None, 3, "__add__x"):
        assert am._compiled_row(missing) is None or missing in am._BY_NAME
        assert am._compiled_redirect(missing) is None
