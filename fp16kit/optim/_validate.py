"""Hyper-parameter, parameter and state checks shared by FusedLAMB, FusedAdam and the functional API.

Every error names the offending value (and, for an optimizer, the group index and key) and says what is
allowed. The per-step row check (:func:`check_row`) is what makes the raw-address kernels safe: a kernel
reads and writes ``numel(param)`` elements of every tensor of a row, so every grad and state tensor must
have the param's shape (the torch fallback would broadcast a wrong shape silently), the dtype the kernels
read it as, the param's device, and (state tensors) a contiguous layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from numbers import Real
from typing import Any

import torch

__all__ = [
    "EPS_MIN",
    "FP32_MAX",
    "check_hyperparams",
    "check_param_tensor",
    "check_row",
    "check_sparse_grad",
    "check_state_tensor",
    "check_step_value",
    "naming_group",
    "refuse_amsgrad",
    "state_dtype",
]

#: The smallest eps accepted: the smallest normal fp32 number, so that eps stays non-zero in fp32 math.
#: eps = 0 is rejected although torch accepts it: a gradient that is exactly 0 (a frozen embedding row,
#: a zero-initialised bias with no signal yet) makes ``m / (sqrt(v) + eps)`` a 0/0, and a gradient
#: whose square underflows (|g| < 1e-19 in fp32) an ``m / 0``: NaN or inf would be written into the weights.
EPS_MIN = float(torch.finfo(torch.float32).tiny)

#: The largest float32: the kernels compute in float32, so a host hyper-parameter above it (or a step size formed
#: from them, :func:`check_hyperparams`) would round to inf there and write inf/NaN into the weights.
FP32_MAX = float(torch.finfo(torch.float32).max)
_FP32_TOP = "float32's maximum 3.4028235e+38"

_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_F32, _F64, _STRIDED = torch.float32, torch.float64, torch.strided

# The group being checked, for messages from subclasses' ``_check_group`` (which do not take an index).
_GROUP: ContextVar[int | None] = ContextVar("fp16kit_optim_group", default=None)


@contextlib.contextmanager
def naming_group(index: int) -> Iterator[None]:
    """Within the block, :func:`check_hyperparams` names ``param_groups[index][key]`` in its messages (not while
    ``torch.compile`` traces: Dynamo cannot trace a ContextVar; see :func:`check_hyperparams`)."""
    if torch.compiler.is_compiling():
        yield
        return
    token = _GROUP.set(index)
    try:
        yield
    finally:
        _GROUP.reset(token)


def _label(group: int | None, key: str) -> str:
    return key if group is None else f"param_groups[{group}][{key!r}]"


def _number(fn: str, name: str, value: Any) -> float | None:
    """The value as a float, or None for a tensor (its value lives on the device: not checked, no sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"{fn}: {name} must be a number or a one-element floating tensor, got {value!r}.")
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{fn}: {name} must be a real number, got {type(value).__name__} {value!r}.")
    return float(value)


def check_hyperparams(
    fn: str,
    *,
    lr: Any,
    betas: Any,
    eps: Any,
    weight_decay: Any,
    max_grad_norm: Any = None,
    group: int | None = None,
) -> None:
    """lr >= 0, 0 <= beta1, beta2 < 1, eps >= EPS_MIN, weight_decay >= 0, max_grad_norm >= 0, each at most
    float32's maximum (:data:`FP32_MAX`: the kernels compute in float32, where a larger value is inf), and so are
    the step sizes the updates form from them: ``lr / (1 - beta1)`` (Adam's bias-corrected step size at its first
    step, its largest) and ``lr * weight_decay`` (the decoupled decay ``p * (1 - lr * wd)``). Beyond them a step would
    write inf or NaN into the weights; a ValueError names the value and the bound instead.

    ``group`` (an index into ``param_groups``) makes the messages name ``param_groups[i]['key']``: the check
    runs at construction, in ``add_param_group`` and at every step (values edited by hand or by a scheduler).
    A tensor ``lr`` is accepted here unchecked: reading it would sync a GPU with the host; the step checks
    it on the device instead (a non-finite or negative tensor lr skips the step). In a step that
    ``torch.compile`` traces the group comes only from ``group`` (the raise makes Dynamo run the step eagerly,
    where the message names the group again).
    """
    if group is None and not torch.compiler.is_compiling():  # Dynamo cannot trace ContextVar.get
        group = _GROUP.get()
    name = lambda key: _label(group, key)
    lr_value = _bounded(fn, name("lr"), lr, tensor_ok=True, what="learning rate ")
    if not isinstance(betas, Sequence) or isinstance(betas, str) or len(betas) != 2:
        raise ValueError(f"{fn}: {name('betas')} must be a pair (beta1, beta2), got {betas!r}.")
    for i, beta in enumerate(betas):
        value = _number(fn, f"{name('betas')}[{i}]", beta)
        if value is None or not (0.0 <= value < 1.0):
            raise ValueError(
                f"{fn}: invalid beta{i + 1}={beta!r} in {name('betas')}={tuple(betas)!r}; each must lie in [0, 1)."
            )
    _bounded(
        fn, name("eps"), eps, low=EPS_MIN, low_note=" (e.g. 1e-8 for Adam, 1e-6 for LAMB)",
        note=". eps = 0 is not allowed: a zero gradient would divide 0/0 and write NaN into the weights.",
    )
    wd_value = _bounded(fn, name("weight_decay"), weight_decay)
    if max_grad_norm is not None:
        _bounded(fn, name("max_grad_norm"), max_grad_norm, low_note=" (0 disables clipping)", note=".")
    if lr_value is not None:
        _check_step_sizes(fn, name, lr_value, float(betas[0]), wd_value)


def _bounded(
    fn: str, label: str, raw: Any, *, low: float = 0.0, tensor_ok: bool = False, what: str = "", low_note: str = "",
    note: str = " (the kernels compute in float32).",
) -> Any:
    """``raw`` as a float in ``[low, FP32_MAX]`` (None for a tensor where ``tensor_ok``: checked on the device), else
    a ValueError naming ``label`` and the range (``low_note`` after the lower bound, ``note`` at the end)."""
    value = _number(fn, label, raw)
    if (value is None and not tensor_ok) or (value is not None and not (low <= value <= FP32_MAX)):
        raise ValueError(
            f"{fn}: invalid {what}{label}={raw!r}; it must be a finite number >= {low:.3g}{low_note} and <= "
            f"{_FP32_TOP}{note}"
        )
    return value


def _check_step_sizes(fn: str, name: Any, lr: float, beta1: float, wd: float) -> None:
    """The step sizes formed from valid host values, within float32 (:func:`check_hyperparams`)."""
    for what, value, fix in (
        (f"lr / (1 - beta1) with {name('betas')}[0]={beta1!r} (the bias-corrected step size of the first step)",
         lr / (1.0 - beta1), f"a learning rate of at most {FP32_MAX * (1.0 - beta1):.4g}"),
        (f"lr * weight_decay with {name('weight_decay')}={wd!r} (the decoupled decay p * (1 - lr * weight_decay))",
         lr * wd, "a smaller learning rate or weight decay"),
    ):
        if value > FP32_MAX:
            raise ValueError(
                f"{fn}: {name('lr')}={lr!r} makes {what} = {value:.4g}, beyond {_FP32_TOP}: the kernels compute in "
                f"float32, where it is inf, and the step would write inf or NaN into the weights. Use {fix}."
            )


def refuse_amsgrad(fn: str, amsgrad: bool) -> None:
    """apex's RuntimeError for ``amsgrad=True`` (FusedAdam, FusedLAMB, FusedNovoGrad have no AMSGrad variant)."""
    if amsgrad:
        raise RuntimeError(f"{fn} does not support the AMSGrad variant (amsgrad=True); use amsgrad=False.")


def check_step_value(fn: str, group: int, value: float) -> None:
    """A step counter read from a checkpoint or set by hand: finite and >= 0."""
    if not (0.0 <= value < float("inf")):
        raise ValueError(
            f"{fn}: invalid step counter param_groups[{group}]['step']={value!r}; it must be a finite number >= 0 "
            f"(the number of steps taken). A NaN step would turn the bias corrections, and then the weights, NaN."
        )


def check_param_tensor(fn: str, index: int, p: torch.Tensor, group: int | None = None) -> None:
    """A dense real floating tensor (fp16, bf16, fp32, fp64)."""
    where = f"params[{index}]" if group is None else f"param_groups[{group}]['params'][{index}]"
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{fn}: {where} is a {type(p).__name__}, not a torch.Tensor.")
    if p.is_sparse or p.layout != torch.strided:
        raise TypeError(
            f"{fn}: {where} has layout {p.layout}; only dense (strided) parameters are supported. "
            f"Use torch.optim.SparseAdam for sparse parameters."
        )
    if p.is_complex():
        raise TypeError(
            f"{fn}: {where} is complex ({p.dtype}); complex parameters are not supported. "
            f"Optimize torch.view_as_real(p) instead."
        )
    if p.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {where} has dtype {p.dtype}; expected float16, bfloat16, float32 or float64.")


def check_sparse_grad(fn: str, index: int, g: torch.Tensor) -> None:
    """Sparse gradients (e.g. from ``nn.Embedding(sparse=True)``) cannot be used."""
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(
            f"{fn}: the gradient of params[{index}] is sparse ({g.layout}); {fn} needs dense gradients. "
            f"Use nn.Embedding(sparse=False), or torch.optim.SparseAdam for that parameter."
        )


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of optimizer state (moments) for a param: float64 for float64 params, else float32."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _state_problem(t: Any, p: torch.Tensor, dtype: torch.dtype) -> str | None:
    """What is wrong with state tensor ``t`` for param ``p`` (None when nothing is)."""
    if not isinstance(t, torch.Tensor):
        return f"is a {type(t).__name__}, not a tensor"
    if t.shape != p.shape:
        return f"has shape {tuple(t.shape)} but the param has shape {tuple(p.shape)}"
    if t.dtype != dtype:
        return f"has dtype {t.dtype}; it must be {dtype} for a {p.dtype} param"
    if t.device != p.device:
        return f"is on {t.device} but the param is on {p.device}"
    if t.layout != torch.strided or not t.is_contiguous():
        return "is not a contiguous dense tensor"
    return None


def check_state_tensor(fn: str, group: int, index: int, key: str, t: Any, p: torch.Tensor, dtype: torch.dtype) -> None:
    """One state tensor (moment or master) against its param; raises ValueError naming group, index and key."""
    problem = _state_problem(t, p, dtype)
    if problem is not None:
        raise ValueError(
            f"{fn}: state[{key!r}] of param_groups[{group}]['params'][{index}] {problem}. The optimizer state does "
            f"not belong to this parameter (a checkpoint of another model, or state edited by hand): load a "
            f"matching checkpoint, or delete optimizer.state[param] to start that parameter's state afresh."
        )


def check_row(
    fn: str,
    group: int,
    index: int,
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, Any],
    moment_keys: Sequence[str],
    *,
    state8: bool = False,
) -> None:
    """The per-step check of one param's row: its grad and its state (moments, master) against the param.
    ``state8``: the moments are 8-bit (uint8 codes, ``fp16kit.kernels.to_state8``).

    Runs for every param with a grad at every step, so its fast test reads only what memory safety needs and
    is cheap to read: the element count (``numel``, ~0.1 us; a ``shape`` comparison costs ~0.6 us), the
    dtype, the device and (state) contiguity. Any mismatch goes to the full check, which names the problem
    (shape included). A state tensor reshaped by hand to the same number of elements passes here (the
    kernels then treat it as the flat tensor it is); ``load_state_dict`` compares exact shapes. The grad's
    device is checked with every other tensor's by the step itself (``common_device``).
    """
    n = p.numel()
    if g.numel() != n or g.dtype not in _FLOATS or g.layout is not _STRIDED:
        _grad_error(fn, group, index, p, g)
    device = p.device
    dtype = torch.uint8 if state8 else _F64 if p.dtype is _F64 else _F32
    for key in moment_keys:
        t = state.get(key)
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype is dtype
            and t.numel() == n
            and t.device == device
            and t.is_contiguous()
        ):
            check_state_tensor(fn, group, index, key, t, p, dtype)
    master = state.get("master")
    if master is not None and not (
        isinstance(master, torch.Tensor)
        and master.dtype is _F32
        and master.numel() == n
        and master.device == device
        and master.is_contiguous()
    ):
        check_state_tensor(fn, group, index, "master", master, p, _F32)
    low = state.get("master_low")
    if low is not None and not (
        isinstance(low, torch.Tensor)
        and low.dtype is torch.int16
        and p.dtype is torch.bfloat16
        and low.numel() == n
        and low.device == device
        and low.is_contiguous()
    ):
        if p.dtype is not torch.bfloat16:
            raise ValueError(
                f"{fn}: state['master_low'] of param_groups[{group}]['params'][{index}] belongs to a bf16 param, but "
                f"the param has dtype {p.dtype}. Cast the model back to torch.bfloat16, or delete the state entry."
            )
        check_state_tensor(fn, group, index, "master_low", low, p, torch.int16)


def _grad_error(fn: str, group: int, index: int, p: torch.Tensor, g: torch.Tensor) -> None:
    if g.layout != torch.strided:
        check_sparse_grad(fn, index, g)
    problem = (
        f"has shape {tuple(g.shape)} but the param has shape {tuple(p.shape)}"
        if g.numel() != p.numel()
        else f"is on {g.device} but the param is on {p.device}"
        if g.device != p.device
        else f"has dtype {g.dtype}; expected a floating dtype"
    )
    raise ValueError(
        f"{fn}: the gradient of param_groups[{group}]['params'][{index}] {problem}. A gradient must match its "
        f"parameter (was p.grad or p.grad.data assigned by hand?)."
    )
