"""``fp16kit.amp.GradScaler``: ``torch.amp.GradScaler``'s API and semantics on fp16kit's fused kernels.

Usage is torch's::

    scaler = GradScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)            # optional, e.g. before clip_grad_norm_
    scaler.step(optimizer)                # skipped when the grads hold inf/NaN
    scaler.update()                       # once per iteration, after every optimizer stepped

What is the same as torch: the methods, keywords, errors (messages included), the per-optimizer stages
(ready / unscaled / stepped), the ``_step_supports_amp_scaling`` hand-over of ``grad_scale`` and
``found_inf`` to fused optimizers (torch's fused Adam/AdamW/SGD included), ``state_dict`` keys, and
with default options the exact scale trajectory (the update is torch's own op; see ``LossScaler``).

What fp16kit adds:

* The scale lives in a :class:`~fp16kit.amp.loss_scaler.LossScaler` (device-side, no host sync in
  ``update``), which brings ``hysteresis``, ``min_scale``/``max_scale`` and a warning when every step
  is being skipped (``warn_after_skips``).
* Gradients are unscaled and checked by ``fp16kit.kernels.unscale_and_check``: one fused pass per
  device for all dtypes (Triton on CUDA), checking the *unscaled* values.
* fp16 gradients are accepted (torch raises "Attempting to unscale FP16 gradients."): each value is
  unscaled in fp32 arithmetic and rounded once; a one-time warning says that values below fp16's
  smallest subnormal (2**-24) flush to zero when written back to fp16.
* fp16kit's own fused optimizers (``_fp16kit_checks_inf = True``) check for inf/NaN in their own first
  pass, so ``step`` hands them a zeroed flag and runs no check pass of its own (see ``step``).

Defaults are torch's: no cap (the scale keeps doubling past 2**24 as torch's does), any scale fp32 can
hold is accepted by the constructor, ``load_state_dict`` and ``update(new_scale)``. ``min_scale`` and
``max_scale``, when set, only limit growth and backoff; they never refuse or move a given scale.

Differences: ``device`` defaults to ``None`` (the device of the first tensor given to ``scale``)
instead of ``"cuda"``; sparse gradients are always coalesced before the check (torch coalesces only fp16
ones), since coalescing adds values and can itself overflow; a scale that fp32 cannot hold
(``init_scale=1e39``, NaN, inf, <= 0; or below 2**-126, whose reciprocal overflows) from the constructor, a
checkpoint or ``update(new_scale)`` is an error instead of a scale that would skip every later step;
backoff stops at fp32's smallest normal 2**-126 (whose reciprocal is still finite) instead of going on to 0,
where torch's scale stays forever (after ~165 overflows in a row from 2**16).
"""

from __future__ import annotations

import inspect
import operator
import warnings
import weakref
from collections import abc, defaultdict
from enum import Enum
from itertools import repeat
from typing import Any, overload

import torch

from ..distributed import is_dtensor
from ..kernels import (
    Backend,
    as_torch_flag,
    checks_inf_itself,
    merge_found_inf,
    metadata_guard,
    new_found_inf,
    select_backend,
    unscale_and_check,
)
from . import _sharded
from .loss_scaler import LossScaler

__all__ = ["GradScaler", "GradScalerDisabledWarning", "OptState"]

_F16 = torch.float16
_CPU = torch.device("cpu")
_TENSOR = torch.Tensor
_STRIDED = torch.strided
#: gradient dtypes whose fp16kit unscale (fp32 math, one rounding, in place) is torch's own CPU op bit for bit
_FAST_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))
_GRAD = operator.attrgetter("grad")


class OptState(Enum):
    """Where an optimizer is in the current iteration (torch's ``torch.amp.grad_scaler.OptState``)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> dict[str, Any]:
    return {"stage": OptState.READY, "found_inf_per_device": {}}


class _PerDevice:
    """Copies of one device tensor on other devices, made once (non-blocking) and cached."""

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self._copies: dict[torch.device, torch.Tensor] = {master.device: master}

    def get(self, device: torch.device) -> torch.Tensor:
        t = self._copies.get(device)
        if t is None:
            t = self._copies[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return t


class _ParamSet:
    """One optimizer's parameters, flattened and checked once: the fast path's plan (``GradScaler._fast_grads``).

    ``fast`` is False when a parameter is not a tensor (the general path raises torch's error) or is a DTensor
    (its gradient is unscaled shard by shard and its flag combined over the mesh: the general path).
    ``grad_ids``, ``ptrs``, ``sizes``, ``dtypes`` describe the last gradients that passed the full gradient checks
    (``_fast_path_grads``): their ``id``, data pointer, byte size and dtype; ``guard``, a guard over their metadata
    (``fp16kit.kernels.metadata_guard``), lets new gradients of the same kinds skip the per-property checks
    (:meth:`refit`). No reference to a gradient is kept (``zero_grad()`` must be able to free them).
    """

    __slots__ = ("dtypes", "fast", "grad_ids", "guard", "params", "ptrs", "saw_fp16", "sizes")

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.fast = all(isinstance(p, _TENSOR) and not is_dtensor(p) for p in params)
        self.grad_ids: list[int] = []
        self.ptrs: list[int] = []
        self.sizes: list[int] = []
        self.dtypes: list[torch.dtype] = []
        self.guard: Any = None
        self.saw_fp16 = False

    def same(self, params: list[Any]) -> bool:
        """Is ``params`` this set (the same tensors, in the same order)?"""
        return len(params) == len(self.params) and all(map(operator.is_, params, self.params))

    def unchanged(self, grads: list[torch.Tensor]) -> bool:
        """Are ``grads`` the gradients that passed the full checks last time, as they were then? (Without a guard
        that tells subclasses apart, ``_exact_guard`` False; otherwise :meth:`refit` answers.)

        Same objects (ids; an id can be reused by a new tensor, so the rest is compared too), same data pointers,
        byte sizes and dtypes, still contiguous: then each occupies exactly the bytes it occupied then, so the
        dtype, layout and no-overlap checks still hold. The device is not compared: a tensor moves to another
        device only with a new allocation, whose pointer is never a live or former CPU heap address (the
        accelerators' unified address space keeps them apart). C-level ``map`` passes: ~0.25 us per gradient.
        """
        ids = self.grad_ids
        if not ids or id(grads[0]) != ids[0]:  # new gradients (the common miss) fail here, before any per-grad pass
            return False
        return (
            list(map(id, grads)) == ids
            and list(map(_DATA_PTR, grads)) == self.ptrs
            and list(map(_NBYTES, grads)) == self.sizes
            and list(map(_DTYPE, grads)) == self.dtypes
            and all(map(_IS_CONTIGUOUS, grads))
        )

    def refit(self, grads: list[torch.Tensor]) -> bool:
        """Do new ``grads`` (``zero_grad()`` and ``backward()`` allocate new ones every iteration) qualify because
        they have, position by position, the metadata of the gradients that passed the full checks last time?

        The guard (torch's C++ tensor guard) compares in one call what ``_fast_path_grads`` reads per property:
        the exact type (a subclass fails it), dtype, device, sizes and strides (so contiguity, non-emptiness and
        the byte sizes), and the dispatch keys (sparse layouts, the negative bit). The one address-dependent fact
        left, that no two gradients share a byte, is the sorted-span test of ``_fast_path_grads`` on the new
        pointers with the pinned byte sizes, skipped when the pointers are those that passed last time (the same
        spans; the gradients' identity does not matter, so the kept gradients of ``zero_grad(set_to_none=False)``
        take this path too, without :meth:`unchanged`'s id pass). ~0.1-0.15 us per gradient against ~0.3 us for
        the full checks.
        """
        guard = self.guard
        if guard is None or len(grads) != len(self.sizes) or not guard.check(*grads):
            return False
        ptrs = list(map(_DATA_PTR, grads))
        if ptrs == self.ptrs:
            return True
        if not _spans_disjoint(ptrs, self.sizes):
            return False  # shared memory: the full checks (then the general path) decide
        self.ptrs = ptrs
        return True


class GradScalerDisabledWarning(UserWarning):
    """``GradScaler("cuda")`` was created where CUDA is not available: it is disabled, as torch's is."""


_NO_CUDA_WARNING = (
    "fp16kit.amp.GradScaler('cuda'): CUDA is not available, so this scaler is disabled, as torch's GradScaler is: "
    "scale() returns the loss unscaled, unscale_() does nothing, step() calls optimizer.step() and update() keeps "
    "no scale. That is right when the forward runs in fp32 or bf16 here (torch.autocast('cuda') and "
    "amp.autocast('cuda') cast nothing without CUDA), but an fp16 forward on CPU tensors (amp.autocast("
    "dtype=torch.float16), amp.initialize O1/O2) then trains unscaled and small gradients underflow to zero. "
    "For fp16 on CPU create the scaler without a device, amp.GradScaler() (it scales on the gradients' devices), or "
    "amp.GradScaler('cpu'). Said once per process."
)
#: one entry once the warning above was given
_WARNED_NO_DEVICE: list[bool] = []

_DATA_PTR = torch.Tensor.data_ptr
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_IS_NEG = torch.Tensor.is_neg
_NBYTES = operator.attrgetter("nbytes")
_DTYPE = operator.attrgetter("dtype")
_IS_CPU = operator.attrgetter("is_cpu")


def _cpu_scalar_at_most_one(t: torch.Tensor) -> bool:
    """``|t| <= 1`` for a one-element CPU tensor: a host read, but of host memory (no device sync; the
    host-read tests in tests/amp/_host_reads.py let this one function through for CPU tensors)."""
    return abs(float(t)) <= 1.0


def _spans_disjoint(ptrs: list[int], sizes: list[int]) -> bool:
    """Are the non-empty byte spans ``[ptrs[i], ptrs[i] + sizes[i])`` pairwise disjoint? Without building pairs: they
    are iff the i-th smallest end is at most the (i+1)-th smallest start for every i (at any address, at most one
    span has started and not ended). C-level passes only."""
    return all(map(operator.le, sorted(map(operator.add, ptrs, sizes)), sorted(ptrs)[1:]))


def _fast_path_grads(grads: list[torch.Tensor], pset: _ParamSet) -> bool:
    """Do the gradients qualify for the fast path? If so, record them in ``pset``. They qualify when they are plain
    strided (see below) CPU tensors of a fast dtype, contiguous (no internal overlap), non-empty, no two sharing a
    byte.

    One C-level ``map`` per property (~0.5 us per gradient in all). Not read here: the layout (a tensor of any
    layout but strided has no storage, so ``data_ptr()`` raises ``RuntimeError``, which the caller takes as "not
    fast"), and the negative bit (torch's op refuses such a list before writing anything, and the caller then takes
    the general path, whose error names it). Disjointness without building pairs: the spans ``[start, end)``
    (non-empty) are pairwise disjoint iff the i-th smallest end is at most the (i+1)-th smallest start for every i
    (:func:`_spans_disjoint`).
    """
    if set(map(type, grads)) != {_TENSOR}:
        return False  # (checked first: a wrapper subclass has no data pointer)
    dtypes = list(map(_DTYPE, grads))
    if not (_FAST_DTYPES.issuperset(dtypes) and all(map(_IS_CPU, grads)) and all(map(_IS_CONTIGUOUS, grads))):
        return False
    ptrs, sizes = list(map(_DATA_PTR, grads)), list(map(_NBYTES, grads))
    if 0 in sizes:
        return False  # an empty tensor has no span to compare (it may sit inside another's): the general path
    if not _spans_disjoint(ptrs, sizes):
        return False  # shared memory: the general path decides (and raises)
    pset.grad_ids, pset.ptrs, pset.sizes, pset.dtypes = list(map(id, grads)), ptrs, sizes, dtypes
    pset.saw_fp16 = _F16 in dtypes
    pset.guard = metadata_guard(grads) if _exact_guard else None
    return True


def _guard_is_exact() -> bool:
    """Does ``metadata_guard`` tell a tensor subclass from a plain tensor (torch's C++ guard does; the portable
    one compares metadata only)? Without that, :meth:`_ParamSet.refit` is not used."""
    probe = torch.zeros(1)
    return not metadata_guard([probe]).check(torch.nn.Parameter(probe))


_exact_guard = _guard_is_exact()


_FP16_GRAD_WARNING = (
    "fp16kit GradScaler: unscaling float16 gradients in place. The unscale runs in fp32 arithmetic and the "
    "inf/NaN check sees the true values, but unscaled values below 2**-24 (fp16's smallest subnormal) flush to "
    "zero when written back to fp16. Keep fp32 master gradients (fp16kit.amp.initialize(..., opt_level='O2')) "
    "where that matters."
)


class GradScaler:
    """Dynamic loss scaling for mixed-precision training, with ``torch.amp.GradScaler``'s interface.

    Args:
        device: device type (``"cuda"``, ``"cpu"``, ...) or ``None`` (default) to follow the first tensor
            passed to :meth:`scale`. ``"cuda"`` without CUDA warns and disables the scaler, as torch does.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in torch.
        hysteresis: consecutive overflows tolerated before backing off (1 = torch's behaviour).
        min_scale: floor for the scale on backoff (``None``: none; backoff still never reaches 0).
        max_scale: cap for the scale on growth (``None``, the default: torch's "only while finite").
            Neither bound refuses or moves a scale given by the user or a checkpoint.
        warn_after_skips: warn when this many steps in a row were skipped (``None``: never); checked on the
            host once every that many updates, never with a per-step sync (see ``LossScaler``).
        process_group: sharded gradients (ZeRO-style, plain tensors): the group whose ranks hold the other
            shards; each ``found_inf`` is all-reduced (MAX) over it before any step decision. FSDP2 DTensor
            gradients need nothing: their device mesh gives the group (``docs/distributed.md``).

    The scale trajectory is the state machine of ``LossScaler``: per update,
    ``S <- max(S * backoff_factor, min_scale)`` after ``hysteresis`` consecutive overflows, and
    ``S <- min(S * growth_factor, max_scale)`` (if finite) after ``growth_interval`` clean steps.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        warn_after_skips: int | None = 50,
        process_group: Any = None,
    ) -> None:
        self._device = None if device is None else torch.device(device).type
        self._process_group = process_group  # sharded grads: found_inf is combined over it (_sharded.py)
        self._enabled = bool(enabled)
        if self._device == "cuda" and self._enabled and not torch.cuda.is_available():
            # torch's GradScaler disables itself here with a one-line warning, and fp16 then trains unscaled: the
            # same decision (drop-in), said once per process with its consequence and the fix
            if not _WARNED_NO_DEVICE:
                _WARNED_NO_DEVICE.append(True)
                warnings.warn(_NO_CUDA_WARNING, GradScalerDisabledWarning, stacklevel=2)
            self._enabled = False
        self._warned_fp16 = False
        self._signature_cache: dict[Any, bool] = {}
        # optimizer -> its checked parameter list (fast path); weak, so a dropped optimizer's params are not kept alive
        self._param_sets: weakref.WeakKeyDictionary[Any, _ParamSet] = weakref.WeakKeyDictionary()
        self._one: torch.Tensor | None = None  # fp32 [1] 1.0 on the CPU: the fast path's check-only scale
        self._scaler: LossScaler | None = None
        self._scale0: torch.Tensor | None = None  # 0-dim view of the scale, for scale() and torch optimizers
        self._options = dict(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            warn_after_skips=warn_after_skips,
            strict_bounds=False,
        )
        if not self._enabled:  # options are kept (getters work) but, as in torch, not validated
            self._pending_state = {
                "scale": init_scale,
                **{
                    k: v
                    for k, v in self._options.items()
                    if k not in ("init_scale", "warn_after_skips", "strict_bounds")
                },
                "growth_tracker": 0,
            }
            return
        if growth_factor <= 1.0:
            raise AssertionError("The growth factor must be > 1.0.")
        if backoff_factor >= 1.0:
            raise AssertionError("The backoff factor must be < 1.0.")
        # Validate every option now (a LossScaler on the CPU), not at the first scale() call.
        self._pending_state = LossScaler(**self._options, device="cpu").state_dict()
        self._init_scale_given = float(init_scale)
        self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)

    # ------------------------------------------------------------------ the scale tensor
    @property
    def loss_scaler(self) -> LossScaler | None:
        """The device-side :class:`LossScaler` (``None`` until the first :meth:`scale` call)."""
        return self._scaler

    def _lazy_init(self, device: torch.device) -> None:
        scaler = LossScaler(**self._current_options(), device=device)
        scaler.load_state_dict(self._pending_state)
        self._scaler = scaler

    def _current_options(self) -> dict[str, Any]:
        """Constructor keywords for a LossScaler in the current state (the scale may have moved since init)."""
        return {**self._options, "init_scale": self._pending_state["scale"]}

    def _check_scale_growth_tracker(self, funcname: str) -> LossScaler:
        if self._scaler is None:
            raise AssertionError(
                f"Attempted {funcname} but _scale is None.  This may indicate your script did not use "
                f"scaler.scale(loss or outputs) earlier in the iteration."
            )
        return self._scaler

    def _scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The current scale as a 0-dim tensor (a view: later updates show through), lazily created."""
        if self._scaler is None:
            self._lazy_init(device)
        scale = self._scaler.scale  # type: ignore[union-attr]
        if self._scale0 is None or self._scale0._base is not scale:
            self._scale0 = scale.view(())
        return self._scale0

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: abc.Iterable[torch.Tensor]) -> abc.Iterable[torch.Tensor]: ...

    def scale(self, outputs: torch.Tensor | abc.Iterable[torch.Tensor]) -> torch.Tensor | abc.Iterable[torch.Tensor]:
        """``outputs * scale`` for a tensor or (nested) lists/tuples/iterables of tensors; identity when disabled.

        The scale is a 0-dim fp32 tensor, so the usual type promotion applies (as in torch): an fp16 loss
        tensor with dimensions stays fp16, a 0-dim fp16 loss becomes fp32.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            device = outputs.device
            scale = self._scale_tensor(device)
            # a same-device ``.to`` returns the tensor itself but costs ~0.6 us: the common case skips it
            return outputs * (scale if scale.device == device else scale.to(device=device, non_blocking=True))

        stash: list[_PerDevice] = []

        def apply_scale(val: Any) -> Any:
            if isinstance(val, torch.Tensor):
                if not stash:
                    stash.append(_PerDevice(self._scale_tensor(val.device)))
                return val * stash[0].get(val.device)
            if isinstance(val, abc.Iterable):
                iterable = map(apply_scale, val)
                if isinstance(val, (list, tuple)):
                    return type(val)(iterable)
                return iterable
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")

        return apply_scale(outputs)

    # ------------------------------------------------------------------ unscaling
    def _grads_per_device(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[torch.device, list[torch.Tensor]], bool]:
        """The optimizer's gradients (dense ones, and the values of coalesced sparse ones) by device, and whether
        one of them is fp16 (checked in this loop: a second pass costs ~1 us per grad). The general path."""
        per_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        saw_fp16 = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not isinstance(param, torch.Tensor):
                    raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    # Duplicate indices are summed by coalesce(); the sum of scaled values can overflow,
                    # so the check must see the coalesced values.
                    if not grad.is_coalesced():
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grad = _sharded.local(grad)  # FSDP2: this rank's shard (flags are combined afterwards)
                if grad.dtype is _F16:
                    saw_fp16 = True
                per_device[grad.device].append(grad)
        return per_device, saw_fp16

    def _fast_grads(self, optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], bool] | None:
        """``(grads, saw_fp16)`` when the fast path applies to ``optimizer`` now, else ``None``.

        The fast path is the general one (``_grads_per_device`` + ``unscale_and_check``) minus the work that
        cannot change its result: on the CPU with the torch fallback, ``unscale_and_check`` of in-place dense
        fp32/fp16/bf16 gradients with ``|inv_scale| <= 1`` runs exactly torch's
        ``_amp_foreach_non_finite_check_and_unscale_`` (fp32 math, one rounding; no finite value can overflow, so
        checking the inputs is checking the outputs). The scaler then calls that op itself, once for all dtypes.

        What is checked when: the parameter list once per parameter set (``_ParamSet``: re-checked whenever the
        optimizer's parameters are not the same tensors in the same order). The gradients fully (``_fast_path_grads``)
        whenever they are not the ones that passed last time (``_ParamSet.unchanged``: same ids, data pointers, byte
        sizes and dtypes, still contiguous), i.e. whenever a gradient changed identity (``zero_grad()`` gives new ones
        each iteration), dtype, layout or storage (``.data =``, ``set_``). A failed check sends the call down the
        general path, which validates everything and raises fp16kit's errors. What torch's op itself refuses before
        writing anything (a negative-bit tensor) is left to it, and its error sends the call down the general path.
        """
        if self._process_group is not None:
            return None
        groups = optimizer.param_groups
        params = groups[0]["params"] if len(groups) == 1 else [p for g in groups for p in g["params"]]
        pset = self._param_sets.get(optimizer)
        if pset is None or not pset.same(params):
            pset = self._param_sets[optimizer] = _ParamSet(list(params))  # a copy: the group's list may be edited
        if not pset.fast or select_backend(_CPU).backend is not Backend.TORCH:
            return None
        grads = list(map(_GRAD, params))
        if any(map(operator.is_, grads, repeat(None))):  # (C-level: no per-param Python when every grad exists)
            grads = [g for g in grads if g is not None]
        if not grads:
            return None  # the general path records no flag, and step() raises torch's error
        try:
            # the gradients checked last time, unchanged; new ones like them; or new ones that pass the full checks
            if pset.refit(grads) or (pset.guard is None and pset.unchanged(grads)) or _fast_path_grads(grads, pset):
                return grads, pset.saw_fp16
        except RuntimeError:  # a gradient without storage (sparse, mkldnn): no data pointer
            pass
        pset.grad_ids, pset.guard = [], None
        return None

    def _warn_fp16(self, saw_fp16: bool) -> None:
        if saw_fp16 and not self._warned_fp16:
            self._warned_fp16 = True
            warnings.warn(_FP16_GRAD_WARNING, UserWarning, stacklevel=5)

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor | float, *, warn_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale (``g = fp32(g) * inv_scale``, rounded to g's dtype) and check; one fused pass per device.

        Returns a fresh overflow flag (fp32 ``[1]``) per device, 1 where a written value is inf/NaN.
        """
        self._check_scale_growth_tracker("unscale_")  # raises when the scaler was never used to scale
        with torch.no_grad():
            fast = self._fast_grads(optimizer)
            if fast is not None:
                if not isinstance(inv_scale, torch.Tensor):  # 1.0: step() checking a fused optimizer's grads
                    if self._one is None:
                        self._one = torch.ones(1)
                    inv = self._one if inv_scale == 1.0 else None
                else:
                    inv = inv_scale if inv_scale.is_cpu and inv_scale.dtype is torch.float32 else None
                    # |inv| > 1 (a scale below 1) can overflow a finite value, which fp16kit flags and torch's op
                    # (it checks its inputs) would not: the general path handles it.
                    if inv is not None and not _cpu_scalar_at_most_one(inv):
                        inv = None
                if inv is not None:
                    grads, saw_fp16 = fast
                    if warn_fp16:
                        self._warn_fp16(saw_fp16)
                    flag = new_found_inf(_CPU)
                    try:
                        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv)
                    except RuntimeError:
                        # torch's negation fallback refuses a negative-bit tensor before its kernel writes anything
                        # (the fast checks leave that bit to it): the general path names the problem.
                        if not any(map(_IS_NEG, grads)):
                            raise
                    else:
                        return {_CPU: flag}
            per_device, saw_fp16 = self._grads_per_device(optimizer)
            if warn_fp16:
                self._warn_fp16(saw_fp16)
            per_inv = _PerDevice(inv_scale) if isinstance(inv_scale, torch.Tensor) else None
            found: dict[torch.device, torch.Tensor] = {}
            for device, grads in per_device.items():
                flag = new_found_inf(device)
                unscale_and_check(grads, per_inv.get(device) if per_inv is not None else inv_scale, flag)
                found[device] = flag
        _sharded.reduce_found_inf(found, _sharded.flag_group(optimizer, self._process_group))
        return found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale in place (one fused pass per device); optional.

        Call it once per optimizer per iteration, after all gradients were accumulated, when the true
        gradients are needed before :meth:`step` (e.g. ``clip_grad_norm_``). No host sync. Sparse gradients
        are coalesced first, replacing ``param.grad``.
        """
        if not self._enabled:
            return
        scaler = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, scaler.inv_scale(), warn_fp16=True)
        state["stage"] = OptState.UNSCALED

    # ------------------------------------------------------------------ stepping
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` ran) and call ``optimizer.step(*args, **kwargs)`` if no inf/NaN.

        * Plain optimizers: the overflow flag is read on the host (one sync, as in torch) to decide
          whether to call ``optimizer.step()``; its return value is returned (``None`` when skipped).
        * ``_step_supports_amp_scaling`` optimizers (torch's fused Adam/AdamW/SGD and the like): no sync.
          As torch does, the grads are checked (not unscaled) first unless ``unscale_`` ran, then the
          optimizer receives ``optimizer.grad_scale`` (the scale, ``None`` after ``unscale_``) and
          ``optimizer.found_inf`` (0-dim tensors), unscales and skips inside its own step.
        * Optimizers that also set ``_fp16kit_checks_inf = True`` (fp16kit's FusedLAMB/FusedAdam) check
          for inf/NaN in their own first pass, so no check pass runs here: they receive the scale tensor
          (fp32 ``[1]``) and a zeroed fp32 ``[1]`` flag on the grads' device, which they raise themselves;
          after ``step`` returns that flag is recorded for :meth:`update`. After ``unscale_`` they receive
          ``grad_scale = None`` and the flag from ``unscale_``.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scaler = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")

        if getattr(optimizer, "_step_supports_amp_scaling", False):
            return self._fused_step(optimizer, scaler, state, args, kwargs)

        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        found = state["found_inf_per_device"]
        if len(found) == 0:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        retval = None
        flags = list(found.values())
        flag = flags[0] if len(flags) == 1 else merge_found_inf(flags, scaler.device)  # one flag: its own max
        # The one host sync of the non-fused path: Python must know whether to call step().
        if not flag.item():
            retval = optimizer.step(*args, **kwargs)
            state["clean"] = True  # update() need not read this flag again
        state["stage"] = OptState.STEPPED
        return retval

    def _takes_grad_scaler(self, optimizer: torch.optim.Optimizer) -> bool:
        """Does ``optimizer.step`` accept a ``grad_scaler`` keyword (torch's deprecated contract)? Cached per
        step function: ``inspect.signature`` costs tens of microseconds, torch pays it every step."""
        step = optimizer.step
        key = getattr(step, "__func__", step)
        cached = self._signature_cache.get(key)
        if cached is None:
            cached = self._signature_cache[key] = "grad_scaler" in inspect.signature(step).parameters
        return cached

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        state: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if self._takes_grad_scaler(optimizer):
            # torch's deprecated contract: pass the scaler itself.
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the passed "
                "optimizer. In the near future GradScaler registers `grad_scale: Tensor` and "
                "`found_inf: Tensor` to the passed optimizer and let the optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            retval = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            state["stage"] = OptState.STEPPED
            return retval

        ready = state["stage"] is OptState.READY
        if checks_inf_itself(optimizer) and _sharded.optimizer_combines_flag(
            optimizer, self._process_group
        ):
            if ready:
                device = next(
                    (p.grad.device for g in optimizer.param_groups for p in g["params"] if p.grad is not None),
                    scaler.device,
                )
                optimizer.grad_scale = scaler.scale if device == scaler.device else scaler.scale.to(device)
                optimizer.found_inf = new_found_inf(device)
            else:
                optimizer.grad_scale = getattr(optimizer, "grad_scale", None)
                optimizer.found_inf = merge_found_inf(state["found_inf_per_device"].values(), scaler.device)
            try:
                retval = optimizer.step(*args, **kwargs)
                if ready:
                    flag = optimizer.found_inf
                    state["found_inf_per_device"] = {flag.device: flag}
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
            state["stage"] = OptState.STEPPED
            return retval

        # torch's contract: check (inv_scale 1: the grads stay scaled) unless unscale_ ran, then hand over
        # 0-dim tensors, which torch's fused kernels and their step-counter rollback expect.
        if ready:
            state["found_inf_per_device"] = self._unscale_grads_(optimizer, 1.0, warn_fp16=False)
        scale = self._scale_tensor(scaler.device)
        optimizer.grad_scale = (
            scale * getattr(optimizer, "grad_scale", 1) if ready else getattr(optimizer, "grad_scale", None)
        )
        optimizer.found_inf = as_torch_flag(merge_found_inf(state["found_inf_per_device"].values(), scaler.device))
        try:
            retval = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        state["stage"] = OptState.STEPPED
        return retval

    # ------------------------------------------------------------------ the update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Advance the scale once per iteration from every optimizer's overflow flags (no host sync).

        Any overflow this iteration counts as one overflow of the state machine (see the class docstring).
        ``new_scale`` sets the scale instead: a float, or a one-element tensor copied without a sync. It must lie
        in ``[2**-126, fp32 max]``: a float or a CPU tensor that does not raises ``ValueError`` (the scale is
        unchanged); an accelerator tensor is checked on the device (no sync, as torch's copy has none): an
        invalid value is ignored there and reported by a ``RuntimeWarning`` at the next ``get_scale()`` or
        ``state_dict()``. Either way the scale is never NaN, inf or 0.
        """
        if not self._enabled:
            return
        scaler = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                reason = (
                    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                    "torch.FloatTensor with requires_grad=False."
                )
                if new_scale.device.type != (self._device or scaler.device.type):
                    raise AssertionError(reason)
                if new_scale.numel() != 1:
                    raise AssertionError(reason)
                if new_scale.requires_grad is True:
                    raise AssertionError(reason)
            scaler.set_scale(new_scale, name="new_scale")
        else:
            states = self._per_optimizer_states
            if all(s.get("clean") for s in states.values()) and states:
                scaler.update_clean()  # every flag was read as 0 by step(): no flag to merge or read again
            else:
                found_infs = [f for s in states.values() for f in s["found_inf_per_device"].values()]
                if len(found_infs) == 0:
                    raise AssertionError("No inf checks were recorded prior to update.")
                # One flag (one optimizer, one device) is its own max: LossScaler.update takes it on any device.
                scaler.update(found_infs[0] if len(found_infs) == 1 else merge_found_inf(found_infs, scaler.device))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # ------------------------------------------------------------------ getters / setters
    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); ``init_scale`` before the first ``scale``,
        1.0 when disabled."""
        if not self._enabled:
            return 1.0
        if self._scaler is None:
            return self._pending_scale()
        return self._scaler.get_scale()

    def _pending_scale(self) -> float:
        """The scale before the first ``scale()``: the ``init_scale`` as given, as torch returns it (not its
        float32 rounding, which the device scale will hold), unless a loaded state changed it since."""
        pending = float(self._pending_state["scale"])
        given = self.__dict__.get("_init_scale_given")
        if given is not None and float(torch.tensor(given, dtype=torch.float32)) == pending:
            return given
        return pending

    def _option(self, name: str) -> Any:
        return getattr(self._scaler, name) if self._scaler is not None else self._pending_state[name]

    def _set_option(self, name: str, value: Any) -> None:
        """Change one option; validated (by ``LossScaler``) before anything is changed."""
        if not self._enabled:
            self._options[name] = self._pending_state[name] = value
            return
        if self._scaler is not None:
            self._scaler.load_state_dict({**self._scaler.state_dict(), name: value})  # validates first
        else:
            probe = LossScaler(**self._current_options(), device="cpu")
            probe.load_state_dict({**self._pending_state, name: value})
            self._pending_state = probe.state_dict()
        self._options[name] = value

    def get_growth_factor(self) -> float:
        return self._option("growth_factor")

    def set_growth_factor(self, new_factor: float) -> None:
        self._set_option("growth_factor", new_factor)

    def get_backoff_factor(self) -> float:
        return self._option("backoff_factor")

    def set_backoff_factor(self, new_factor: float) -> None:
        self._set_option("backoff_factor", new_factor)

    def get_growth_interval(self) -> int:
        return self._option("growth_interval")

    def set_growth_interval(self, new_interval: int) -> None:
        self._set_option("growth_interval", new_interval)

    def get_hysteresis(self) -> int:
        return self._option("hysteresis")

    def set_hysteresis(self, hysteresis: int) -> None:
        self._set_option("hysteresis", hysteresis)

    def get_min_scale(self) -> float | None:
        return self._option("min_scale")

    def set_min_scale(self, min_scale: float | None) -> None:
        self._set_option("min_scale", min_scale)

    def get_max_scale(self) -> float | None:
        return self._option("max_scale")

    def set_max_scale(self, max_scale: float | None) -> None:
        self._set_option("max_scale", max_scale)

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        if self._scaler is None:
            return int(self._pending_state["growth_tracker"])
        return int(self._scaler.growth_tracker.item())

    def is_enabled(self) -> bool:
        return self._enabled

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``) plus fp16kit's (``hysteresis``, ``_hysteresis_tracker``, ``_consecutive_skips``,
        ``min_scale``, ``max_scale``); ``{}`` when disabled. A host sync: call it after ``update()``."""
        if not self._enabled:
            return {}
        s = self._scaler.state_dict() if self._scaler is not None else dict(self._pending_state)
        return {
            "scale": s["scale"] if self._scaler is not None else self._pending_scale(),
            "growth_factor": s["growth_factor"],
            "backoff_factor": s["backoff_factor"],
            "growth_interval": s["growth_interval"],
            "_growth_tracker": s["growth_tracker"],
            "hysteresis": s["hysteresis"],
            "_hysteresis_tracker": s["hysteresis_tracker"],
            "_consecutive_skips": s["consecutive_skips"],
            "min_scale": s["min_scale"],
            "max_scale": s["max_scale"],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, or a ``torch.amp.GradScaler`` state dict (fp16kit's extras then
        keep this scaler's options, with fresh hysteresis/skip trackers). No-op when disabled."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
            )
        mapped = {
            "scale": state_dict["scale"],
            "growth_factor": state_dict["growth_factor"],
            "backoff_factor": state_dict["backoff_factor"],
            "growth_interval": state_dict["growth_interval"],
            "growth_tracker": state_dict["_growth_tracker"],
        }
        for ours, key in (
            ("hysteresis", "hysteresis"),
            ("hysteresis_tracker", "_hysteresis_tracker"),
            ("consecutive_skips", "_consecutive_skips"),
            ("min_scale", "min_scale"),
            ("max_scale", "max_scale"),
        ):
            if key in state_dict:
                mapped[ours] = state_dict[key]
        if "consecutive_skips" not in mapped and "hysteresis_tracker" not in mapped:
            mapped["consecutive_skips"] = 0
        if self._scaler is not None:
            self._scaler.load_state_dict(mapped)  # validates everything before changing anything
        else:
            probe = LossScaler(**self._current_options(), device="cpu")
            probe.load_state_dict({**self._pending_state, **mapped})
            self._pending_state = probe.state_dict()
        for name in ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale"):
            if name in mapped:
                self._options[name] = mapped[name]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise AssertionError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            # The device tensors are not pickled: the unpickled scaler re-creates them at its first scale().
            state["_pending_state"] = self._scaler.state_dict() if self._scaler is not None else self._pending_state
            state["_scaler"] = None
            state["_scale0"] = None
        state["_signature_cache"] = {}  # holds step functions, which need not pickle
        del state["_param_sets"]  # plans for this process's optimizers (weak references do not pickle)
        state["_one"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_one": None, **state})  # (pickles from before the fast path have no _one)
        self._param_sets = weakref.WeakKeyDictionary()
