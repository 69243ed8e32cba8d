"""The op-level cast policy table (docs/specs/cast-policy.md): op -> rule, as data.

One global table backs both ``fp16kit.amp.autocast`` and the apex-style O1 mode. A *row* names an op the
way the spec does (``"exp"``, ``"linalg.vector_norm"``, ``"Tensor.__matmul__"``) and carries a :class:`Rule`;
each row resolves to the concrete callables that ``__torch_function__`` reports for it: ``torch.exp``,
``torch.Tensor.exp``, the in-place ``torch.Tensor.exp_``, ``torch.nn.functional.softmax``, operator
dunders such as ``torch.Tensor.__iadd__`` for the arithmetic rows, and so on.

The resolved form, :data:`RESOLVED` (callable -> ``(rule, inplace, row name)``), is what autocast reads on
every op; it is rebuilt in place whenever a row changes, so the hot path is one dict lookup.

The table has two parts: :data:`DEFAULT_TABLE` (the spec's rows) and :data:`TORCH_CUDA_TABLE`, the rows of the
installed torch's own CUDA autocast lists that the spec does not name (read by ``_torch_lists``), so an op torch
adds to its lists gets torch's CUDA dtype here too.

This module is data plus a listener hook (:func:`add_listener`): it imports nothing else of ``fp16kit.amp``
(only ``_torch_lists``, a parser). The mechanism that applies the table is ``autocast_mode``; the user-facing
``register_*_function`` (which may wrap a plain Python function) live in ``functions``.

Precedence (later wins): torch's CUDA-list rows, then the spec's default rows, then registrations
(``register_*_function``, in call order: :func:`register_row`), then the innermost active :func:`policy_override`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

import torch
import torch.nn.functional as F

from . import _torch_lists

__all__ = [
    "DEFAULT_TABLE",
    "RESOLVED",
    "TORCH_CUDA_TABLE",
    "Rule",
    "add_listener",
    "display_name",
    "overridable",
    "policy_override",
    "policy_table",
    "print_policy",
    "register_row",
    "registration_row",
]


class Rule(enum.Enum):
    """What autocast does to the eligible (floating, non-float64) tensor inputs of an op."""

    LOW = "low"  #: cast to the region's low-precision dtype (fp16 or bf16)
    FP32 = "fp32"  #: cast to float32
    PROMOTE = "promote"  #: if eligible inputs mix dtypes, cast all to the widest; else leave them
    BANNED = "banned"  #: raise (with the fix) when an input is low precision


_L, _F, _P, _B = Rule.LOW, Rule.FP32, Rule.PROMOTE, Rule.BANNED

def _rows(names: str, rule: Rule) -> dict[str, Rule]:
    return dict.fromkeys(names.split(), rule)


# The default table of docs/specs/cast-policy.md, verbatim names. Order is the spec's.
DEFAULT_TABLE: dict[str, Rule] = {
    **_rows(
        "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc linear prelu "
        "addmm addmv addr matmul mm mv bmm baddbmm addbmm einsum chain_matmul linalg.multi_dot linalg.vecdot "
        "Tensor.__matmul__ scaled_dot_product_attention lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell",
        _L,
    ),
    **_rows(
        # pointwise with range risk
        "acos asin cosh sinh tan erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt pow "
        "Tensor.__pow__ Tensor.__rpow__ Tensor.__ipow__ softplus "
        # softmax family
        "softmax log_softmax softmin "
        # reductions
        "sum prod cumsum cumprod mean norm dist renorm std var logsumexp linalg.vector_norm linalg.matrix_norm "
        # normalisation
        "layer_norm rms_norm group_norm local_response_norm normalize "
        # losses
        "cross_entropy nll_loss kl_div l1_loss mse_loss smooth_l1_loss huber_loss poisson_nll_loss "
        "cosine_embedding_loss hinge_embedding_loss margin_ranking_loss multilabel_margin_loss "
        "multilabel_soft_margin_loss multi_margin_loss soft_margin_loss triplet_margin_loss "
        "binary_cross_entropy_with_logits ctc_loss cosine_similarity "
        # others. Not gelu, which the spec lists here: neither apex O1 nor torch.autocast casts it; torch's
        # fp16/bf16 kernels compute it in fp32 and round once, so in bf16 the row changed no bit of an MLP
        # (gelu -> linear, forward and backward: tests/amp/test_policy.py::test_gelu_runs_as_called_by_default) and
        # cost two casts a call (1.15x torch.autocast on the GELU MLP; docs/autocast.md, "Where the default table
        # differs from torch.autocast")
        "interpolate grid_sample cdist pdist",
        _F,
    ),
    # The arithmetic/comparison operators (add sub mul div eq ne lt le gt ge, their dunders, reflected and in-place
    # forms) are absent on purpose: torch's native type promotion already handles mixed dtypes, and following it
    # exactly is the contract (a 0-dim tensor or a Python scalar does not widen a dimensioned tensor:
    # x_bf16 * torch.tensor(2.0) stays bf16, as under torch.autocast; in-place forms keep the destination's dtype).
    **_rows("addcdiv addcmul atan2 cross bilinear dot vdot tensordot index_put scatter_add cat stack", _P),
    "binary_cross_entropy": _B,
}

# Operator rows also cover their dunder forms (docs/specs/cast-policy.md: "with their Tensor.__op__, __rop__ and
# __iop__").
_DUNDERS: dict[str, tuple[str, ...]] = {
    "add": ("__add__", "__radd__", "__iadd__"),
    "sub": ("__sub__", "__rsub__", "__isub__"),
    "mul": ("__mul__", "__rmul__", "__imul__"),
    "div": ("__truediv__", "__rtruediv__", "__itruediv__", "__div__", "__rdiv__", "__idiv__"),
    "eq": ("__eq__",),
    "ne": ("__ne__",),
    "lt": ("__lt__",),
    "le": ("__le__",),
    "gt": ("__gt__",),
    "ge": ("__ge__",),
}

# name -> (module object, printable module path) searched for a bare spec name, in this order.
_NAMESPACES: tuple[tuple[Any, str], ...] = (
    (torch, "torch"),
    (torch.Tensor, "torch.Tensor"),
    (F, "torch.nn.functional"),
    (torch._C._nn, "torch._C._nn"),  # the C bindings behind F (F.l1_loss wraps torch._C._nn.l1_loss)
)


def _is_inplace(attr: str) -> bool:
    """``exp_`` and ``__iadd__`` are in-place; ``__add__`` and ``exp`` are not."""
    if attr.startswith("__") and attr.endswith("__"):
        return attr.startswith("__i") and attr not in ("__init__", "__index__", "__int__", "__invert__", "__iter__")
    return attr.endswith("_") and not attr.endswith("__")


def _resolve_row(name: str) -> list[tuple[str, Callable[..., Any]]]:
    """The (qualified name, callable) targets of a spec row name; each callable once (aliases collapse)."""
    found: list[tuple[str, Callable[..., Any]]] = []
    seen: set[int] = set()

    def add(owner: Any, path: str, attr: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is not None and callable(fn) and id(fn) not in seen:
            seen.add(id(fn))
            found.append((f"{path}.{attr}", fn))

    if name.startswith("Tensor."):
        add(torch.Tensor, "torch.Tensor", name[len("Tensor."):])
    elif name.startswith("linalg."):
        add(torch.linalg, "torch.linalg", name[len("linalg."):])
    else:
        for owner, path in _NAMESPACES:
            add(owner, path, name)
        for owner, path in _NAMESPACES[:2]:  # in-place variants: torch.exp_, Tensor.exp_
            add(owner, path, name + "_")
        for dunder in _DUNDERS.get(name, ()):
            add(torch.Tensor, "torch.Tensor", dunder)
    return found


@functools.cache
def overridable() -> frozenset[Any]:
    """Callables that dispatch ``__torch_function__`` (so the autocast mode sees them without patching)."""
    out: set[Any] = set()
    for fns in torch.overrides.get_overridable_functions().values():
        out.update(fns)
    return frozenset(out)


def _qualname(fn: Callable[..., Any]) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    return f"{mod}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


# ----------------------------------------------------------------------------------------------------------------
# State. _ROWS: row name -> (rule or None, source, targets). None means "absent" (run as called).
# ----------------------------------------------------------------------------------------------------------------

_Targets = tuple[tuple[str, Callable[..., Any]], ...]
_ROWS: dict[str, tuple[Rule | None, str, _Targets]] = {}
_REGISTERED: dict[str, tuple[Rule | None, _Targets]] = {}  # in registration order (dicts keep order)
_OVERRIDES: list[dict[str, tuple[Rule | None, _Targets]]] = []

#: callable -> (rule, inplace, row name). Read on every op by autocast; rebuilt in place by :func:`_rebuild`.
RESOLVED: dict[Callable[..., Any], tuple[Rule, bool, str]] = {}
#: callable -> qualified display name, for every callable that has (or had) a row.
_NAMES: dict[Callable[..., Any], str] = {}
#: listeners called after every rebuild (autocast rebuilds its dispatch dict); see :func:`add_listener`.
_LISTENERS: list[Callable[[], None]] = []


def add_listener(listener: Callable[[], None]) -> None:
    """Call ``listener()`` now and after every change of the table (a registration, an override entering or
    leaving). This is how the mechanism that applies the table (``autocast_mode``) learns of changes: the table
    is data and never calls into the mechanism by name."""
    _LISTENERS.append(listener)
    listener()


def display_name(fn: Callable[..., Any], default: str) -> str:
    """The qualified name the table shows for ``fn`` (``torch.nn.functional.softmax``), or ``default``."""
    return _NAMES.get(fn, default)


def _effective_rows() -> dict[str, tuple[Rule | None, str, _Targets]]:
    rows: dict[str, tuple[Rule | None, str, _Targets]] = {
        name: (rule, "torch", _DEFAULT_TARGETS[name]) for name, rule in TORCH_CUDA_TABLE.items()
    }
    rows.update((name, (rule, "default", _DEFAULT_TARGETS[name])) for name, rule in DEFAULT_TABLE.items())
    for name, (rule, targets) in _REGISTERED.items():
        rows.pop(name, None)  # re-insert at the end so later rows win on shared targets
        rows[name] = (rule, "registered", targets)
    for layer in _OVERRIDES:
        for name, (rule, targets) in layer.items():
            rows.pop(name, None)
            rows[name] = (rule, "override", targets)
    return rows


def _rebuild() -> None:
    rows = _effective_rows()
    resolved: dict[Callable[..., Any], tuple[Rule, bool, str]] = {}
    for name, (rule, _source, targets) in rows.items():
        for qual, fn in targets:
            _NAMES.setdefault(fn, qual)
            if rule is None:
                resolved.pop(fn, None)
            else:
                inplace = qual.startswith("torch.") and _is_inplace(qual.rsplit(".", 1)[-1])
                resolved[fn] = (rule, inplace, name)
    _ROWS.clear()
    _ROWS.update(rows)
    RESOLVED.clear()
    RESOLVED.update(resolved)
    for listener in _LISTENERS:
        listener()


def _torch_cuda_table() -> dict[str, Rule]:
    """Rows of torch's CUDA lists that the spec's table does not name and that resolve to a callable."""
    out: dict[str, Rule] = {}
    for attr, ops in _torch_lists.torch_cuda_lists().items():
        if attr not in _torch_lists.LIST_RULES:
            continue  # e.g. torch_expect_builtin_promote: ops that promote natively (absent here too)
        rule, spelling = _torch_lists.LIST_RULES[attr]
        for op in ops:
            row = _torch_lists.row_name(op, spelling)
            if row not in DEFAULT_TABLE and row not in out and _resolve_row(row):
                out[row] = Rule[rule]
    return out


#: rows from the installed torch's CUDA autocast lists that DEFAULT_TABLE does not name (see ``_torch_lists``)
TORCH_CUDA_TABLE: dict[str, Rule] = _torch_cuda_table()

_DEFAULT_TARGETS: dict[str, _Targets] = {
    name: tuple(_resolve_row(name)) for name in (*TORCH_CUDA_TABLE, *DEFAULT_TABLE)
}


# ----------------------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------------------


def registration_row(module: Any, name: str) -> str:
    """The row name a registration of ``module.name`` gets: ``torch.tanh``, ``usermod.scale``."""
    if isinstance(module, types.ModuleType):
        owner = module.__name__
    elif isinstance(module, type):
        owner = f"{module.__module__}.{module.__qualname__}"
    else:
        owner = type(module).__name__
    return f"{owner}.{name}"


def register_row(row: str, fn: Callable[..., Any], rule: Rule) -> None:
    """Add (or replace, moving it last so it wins) the registered row ``row`` -> ``rule`` for the callable ``fn``.

    Data only: the user-facing ``fp16kit.amp.register_*_function`` (in ``functions``) checks the name and, for a
    function that never reaches ``__torch_function__``, installs the wrapper that applies the row.
    """
    _REGISTERED.pop(row, None)
    _REGISTERED[row] = (rule, ((row, fn),))
    _rebuild()


# ----------------------------------------------------------------------------------------------------------------
# Scoped override
# ----------------------------------------------------------------------------------------------------------------


def _as_rule(rule: Rule | str | None) -> Rule | None:
    if rule is None or isinstance(rule, Rule):
        return rule
    try:
        return Rule[str(rule).upper()]
    except KeyError:
        raise ValueError(f"Unknown rule {rule!r}: use one of {[r.name for r in Rule]} or None (absent).") from None


def _override_targets(key: str | Callable[..., Any]) -> tuple[str, _Targets]:
    if not isinstance(key, str):
        fn = getattr(key, "__fp16kit_wrapped__", key)
        if fn not in overridable() and fn not in _NAMES:
            raise ValueError(
                f"{_qualname(fn)} does not dispatch __torch_function__, so autocast cannot see it; register it "
                f"first (fp16kit.amp.register_float_function(module, name)) or decorate it (@float_function)."
            )
        qual = _NAMES.get(fn, _qualname(fn))
        return qual, ((qual, fn),)
    if key in DEFAULT_TABLE or key in TORCH_CUDA_TABLE:
        return key, _DEFAULT_TARGETS[key]
    if key in _REGISTERED:
        return key, _REGISTERED[key][1]
    # a dotted path: "torch.tanh", "torch.nn.functional.silu", "torch.Tensor.tanh_"
    obj: Any = None
    if key.startswith("torch."):
        obj = torch
        for part in key.split(".")[1:]:
            obj = getattr(obj, part, None)
            if obj is None:
                break
    if obj is None or not callable(obj):
        raise ValueError(
            f"policy_override: {key!r} is neither a row of the table (see fp16kit.amp.print_policy()) nor a "
            f"torch callable path such as 'torch.tanh' or 'torch.nn.functional.silu'."
        )
    return _override_targets(obj)


@contextlib.contextmanager
def policy_override(
    rules: Mapping[str | Callable[..., Any], Rule | str | None] | None = None, /, **by_name: Rule | str | None
) -> Iterator[None]:
    """Change rows of the global table for the duration of a ``with`` block (nestable; restored on exit).

    Scope: the process, not the thread. The table is one for every thread (as ``register_*_function``'s rows are),
    so regions running on other threads during the block see the override too; an override entered on one thread
    and left on it is removed whatever other threads did meanwhile (each block removes its own layer). For rows that
    must differ between threads, run those threads' code in separate processes or apply the rows outside the threads'
    regions (docs/autocast.md, "Registering your own functions").

    Keys are row names of the table (``"softmax"``: all its callables), dotted torch paths (``"torch.tanh"``)
    or callables (``torch.nn.functional.gelu``). Values are a :class:`Rule`, its name (``"fp32"``) or ``None``
    to make the op absent (run as called)::

        with policy_override({"softmax": Rule.LOW, torch.tanh: "fp32"}), autocast():
            ...
    """
    layer: dict[str, tuple[Rule | None, _Targets]] = {}
    for key, rule in {**(rules or {}), **by_name}.items():
        row, targets = _override_targets(key)
        layer[row] = (_as_rule(rule), targets)
    _OVERRIDES.append(layer)
    _rebuild()
    try:
        yield
    finally:
        _OVERRIDES.remove(layer)
        _rebuild()


# ----------------------------------------------------------------------------------------------------------------
# Export / print
# ----------------------------------------------------------------------------------------------------------------


def policy_table() -> dict[str, dict[str, Any]]:
    """The active table as data: ``{qualified callable name: {"rule", "row", "source"}}``.

    ``rule`` is a :class:`Rule`, ``row`` the table row it comes from (``"softmax"``), ``source`` one of
    ``"torch"`` (torch's CUDA lists), ``"default"``, ``"registered"``, ``"override"``. Callables whose row was
    made absent are not listed.
    """
    out: dict[str, dict[str, Any]] = {}
    for fn, (rule, _inplace, row) in RESOLVED.items():
        out[_NAMES.get(fn, _qualname(fn))] = {"rule": rule, "row": row, "source": _ROWS[row][1]}
    return dict(sorted(out.items()))


def print_policy(file: TextIO | None = None, *, rule: Rule | str | None = None) -> None:
    """Print the active table grouped by rule: each row, where it comes from, and the callables it covers.

    ``rule=`` restricts the listing to one rule (``print_policy(rule="fp32")`` answers "why did this run in fp32?").
    """
    file = file if file is not None else sys.stdout
    only = _as_rule(rule)
    for r in Rule:
        if only is not None and r is not only:
            continue
        rows = [(name, src, tg) for name, (rr, src, tg) in _ROWS.items() if rr is r]
        print(f"{r.name} ({len(rows)} rows)", file=file)
        for name, src, targets in rows:
            live = [q for q, fn in targets if RESOLVED.get(fn, (None,))[0] is r]
            tag = "" if src == "default" else f" [{src}]"
            print(f"  {name:<32}{tag} {' '.join(live)}", file=file)


_rebuild()
