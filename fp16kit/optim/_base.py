"""What FusedLAMB and FusedAdam share: state, master weights, the loss-scaler hand-over, checkpoints.

The step skeleton (``FusedOptimizer.step``)::

    rows    = params with a grad, per group (the fp32 master instead of the param in master-weights mode)
    inv     = 1 / optimizer.grad_scale            (set by a GradScaler; 1 without one)
    flag    = optimizer.found_inf                 (set by a GradScaler; else a fresh zeroed flag)
    gnorm   = check-and-norm pass over all grads  (raises flag on any inf/NaN: one read of the grads); an update
              that uses no norm (Adam) runs the check alone (``flag_nonfinite``), or nothing when the caller
              declared its flag final (fp16kit/kernels/found_inf.py, "Final flags")
    skip    = flag, or a tensor lr that is NaN/inf/negative (device arithmetic: the scaler's flag is not raised)
    for each group: step += (skip == 0); the subclass's update (a no-op on the device when skip is set)

The stages of ``step``, each in a module of its own: replay the recorded steady device step while it holds
(``_steady.py``); check the groups' hyper-parameters and step counters (``_groups.py``); collect and check the rows
(``_rows.py``, the state they read: ``_state.py``); the shard plan (a hook: ``_sharding.ShardedSteps``); then one
path: sharded or compiled or eager host-vector (``_host_step.py``), or the device step (``_device_step.py``); the
skips counted and reported (``_report.py``).

Validation (``docs/optim.md``): host hyper-parameters of every group are checked at every full step (a
scheduler or a hand edit may have changed them; a replayed step compares them with the recorded ones) and raise
naming the group and key; every row (param, grad, moments, master) is checked for shape/dtype/device/layout before
a kernel sees its addresses; checkpoints are checked in ``load_state_dict`` (``_checkpoint.py``) and a rejected load
or ``add_param_group`` leaves the optimizer as it was.

Nothing here reads a device value on the host, except the ``on_nonfinite="raise"`` policy (and, on CPU
tensors, which have no queue to drain, the "warn" policy in an eager step).

``torch.compile(opt.step)``: while Dynamo traces, the passes are the ``fp16kit::`` dispatcher ops
(``fp16kit/kernels/library.py``), "warn" reads nothing (skips are counted in ``nonfinite_skips``) and a step
counter set by hand is checked on the device: one graph, no graph break (docs/optim.md, "torch.compile").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fp16kit.distributed import is_dtensor
from fp16kit.kernels import STATE8_SMALL_NUMEL, Bf16Weights, common_device, forget_autocast_casts, uses_state8

from . import functional as F
from ._context import capturing, step_watched, under_torch_compile
from ._device_step import DeviceStepMixin
from ._groups import GroupsMixin
from ._host_step import HostStepMixin
from ._report import ReportMixin
from ._rows import LOW_KEY, RowsMixin, _Rows
from ._state import LOW_PRECISION, StateMixin

__all__ = ["BF16_MODES", "LOW_KEY", "LOW_PRECISION", "FusedOptimizer"]

_POLICIES = ("skip", "warn", "raise")
#: ``master_weights`` values for bf16 params without an fp32 master (docs/optim.md, "bf16 weights without fp32
#: masters"): ``"split"`` keeps the master's low 16 bits in ``state["master_low"]``, ``"stochastic"`` keeps nothing.
BF16_MODES = ("split", "stochastic")


class FusedOptimizer(
    GroupsMixin, StateMixin, RowsMixin, HostStepMixin, DeviceStepMixin, ReportMixin, torch.optim.Optimizer
):
    """Base class: subclasses define ``_name``, ``_check_group`` and ``_update_group``."""

    # torch.amp.GradScaler (and fp16kit's) hands us grad_scale/found_inf instead of unscaling grads itself.
    _step_supports_amp_scaling = True
    # fp16kit's GradScaler then passes a zeroed found_inf and lets our norm pass detect inf/NaN.
    _fp16kit_checks_inf = True
    _name = "FusedOptimizer"
    #: Subclasses whose kernels have the bf16 write epilogues (``master_weights="split"``/``"stochastic"``).
    _bf16_modes = False
    # The per-param state tensors shaped like the param (besides the optional fp32 "master").
    _moment_keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    #: After a step that a GradScaler handed its scale to, write the unscaled gradients back into ``p.grad``
    #: (apex's optimizers leave them so; torch's fused optimizers and fp16kit by default leave them scaled).
    #: The apex aliases (``fp16kit.compat.install_apex``) set it; set it on an optimizer to get the same.
    unscale_grads: bool = False
    #: 32: fp32 moments; 8: 8-bit moments for params of at least 4096 elements (``state_bits`` of FusedAdam and
    #: FusedLAMB; docs/optim.md, "8-bit moments").
    state_bits: int = 32

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        set_grad_none: bool,
        master_weights: bool | str,
        on_nonfinite: str,
        process_group: Any = None,
        rounding_seed: int | None = None,
        state_bits: int = 32,
    ) -> None:
        if state_bits not in (8, 32):
            raise ValueError(
                f"{self._name}: state_bits={state_bits!r} is not supported; choose 32 (fp32 moments) or 8 (8-bit "
                f"moments, docs/optim.md)."
            )
        self.state_bits = int(state_bits)
        if on_nonfinite not in _POLICIES:
            raise ValueError(
                f"{self._name}: on_nonfinite={on_nonfinite!r} is not understood; choose 'skip' (skip the step "
                f"silently), 'warn' (skip and warn) or 'raise' (skip and raise RuntimeError)."
            )
        self.set_grad_none = bool(set_grad_none)
        #: ``"split"``/``"stochastic"`` (bf16 params without an fp32 master), else None; ``master_weights`` is then
        #: False (no fp32 master exists).
        self.bf16_weights: str | None = None
        if isinstance(master_weights, str):
            if master_weights not in BF16_MODES or not self._bf16_modes:
                supported = "True, False, 'split' or 'stochastic'" if self._bf16_modes else "True or False"
                raise ValueError(
                    f"{self._name}: master_weights={master_weights!r} is not understood; choose {supported} "
                    f"(docs/optim.md, \"bf16 weights without fp32 masters\")."
                )
            self.bf16_weights = master_weights
            master_weights = False
        self.master_weights = bool(master_weights)
        if self.bf16_weights == "stochastic":
            # drawn from torch's default generator unless given: torch.manual_seed makes runs reproducible
            seed = int(torch.randint(0, 2**62, ())) if rounding_seed is None else rounding_seed
            defaults = {**defaults, "rounding_seed": seed}
        elif rounding_seed is not None:
            raise ValueError(f"{self._name}: rounding_seed is for master_weights='stochastic' only.")
        self.on_nonfinite = on_nonfinite
        self._pending: list[tuple[Any, torch.Tensor, str]] = []
        # step counters made or checked here, by group position (not id(step): Dynamo cannot key a dict by the id of
        # a tensor a compiled step creates); a stale id is harmless, its tensor is compared with ``is``
        self._known_steps: dict[int, torch.Tensor] = {}
        # The skip counters (``hparam_skips``, ``nonfinite_skips``) live in a dict: Dynamo keeps a compiled
        # step's dict writes but (torch 2.13) drops its attribute stores on an Optimizer.
        self._skip_counts: dict[str, torch.Tensor] = {}
        # Host state a step writes ("rows_device", "rows_dtensors" from _collect; "shard_plan" from
        # _sharding.localize) lives in a dict for the same reason. Its keys exist from the start: a compiled step
        # guards on the dict, so keys first written by the first compiled step would recompile the second.
        self._step_cache: dict[str, Any] = {"rows_device": None, "rows_dtensors": True, "shard_plan": None}
        # ZeRO-1: the ranks whose params together form the model (global norm and inf flag summed over them).
        self.process_group = process_group
        super().__init__(params, defaults)
        self._check_modes_fit()

    def _check_modes_fit(self) -> None:
        """At construction: a bf16 mode (``"split"``/``"stochastic"``) with no bf16 param would keep nothing and round
        nothing (fp32 params are updated directly), so it is refused; ``state_bits=8`` with no param of
        ``STATE8_SMALL_NUMEL`` (4096) elements or more keeps fp32 moments everywhere, so it warns (once, here). Not
        under ZeRO-1 (``process_group``): a rank's partition of a mixed model may hold only fp32 or small params."""
        if self.process_group is not None:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        mode = self.bf16_weights
        if mode is not None and params and not any(p.dtype == torch.bfloat16 for p in params):
            raise ValueError(
                f"{self._name}: master_weights={mode!r} keeps bf16 params without fp32 masters, but no param is "
                f"bfloat16 (dtypes {sorted({str(p.dtype) for p in params})}): it would do nothing. Cast the model to "
                f"bf16 first (model.to(torch.bfloat16)), or drop master_weights={mode!r} (fp32 params are their own "
                f"masters) (docs/optim.md, \"bf16 weights without fp32 masters\")."
            )
        if self.state_bits == 8 and params and not any(map(uses_state8, params)):
            warnings.warn(
                f"{self._name}: state_bits=8 quantizes the moments of params of at least {STATE8_SMALL_NUMEL} "
                f"elements, and none of these {len(params)} params is that large (the largest has "
                f"{max(p.numel() for p in params)}): every moment stays fp32, no memory is saved (docs/optim.md, "
                f"\"8-bit moments\").",
                UserWarning,
                stacklevel=3,
            )

    @property
    def _shard_plan(self) -> Any:
        """The step's ``_sharding.ShardPlan`` (None in a single-process step), kept in ``_step_cache``."""
        return self.__dict__.get("_step_cache", {}).get("shard_plan")

    def __getstate__(self) -> dict[str, Any]:
        """Everything (``torch.optim.Optimizer`` keeps only defaults, state and groups, so a deep copy or an
        unpickled FusedLAMB lost ``adam_w_mode``, ``master_weights``, ... and failed at its first step); the
        pending CUDA warnings (events cannot be copied) and the step-counter cache are left out."""
        state = dict(self.__dict__)
        state["_pending"] = []
        state["_known_steps"] = {}
        state["_verdicts"] = {}  # keyed by id(group) and holding C++ guards: rebuilt at the next step
        # the recorded steady step holds a C++ guard and launches: recorded again after two equal steps
        state["_step_cache"] = {k: v for k, v in self._step_cache.items() if k not in ("steady", "device_key")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's, then the host caches an optimizer pickled by an earlier fp16kit lacks (the step reads them as
        plain attributes: Dynamo before torch 2.13 cannot trace ``__dict__.setdefault``)."""
        super().__setstate__(state)
        for name in ("_step_cache", "_skip_counts", "_verdicts", "_known_steps"):
            self.__dict__.setdefault(name, {})
        self.__dict__.setdefault("_pending", [])

    def _check_group(self, group: dict[str, Any]) -> None:
        raise NotImplementedError

    #: ``|g| >= 2**63`` after unscaling skips the step like inf/NaN where the update squares unclipped gradients
    #: (Adam, LAMB without clipping): ``fp16kit.optim.functional.SQUARE_GUARD``, the functional steps' rule too.
    _SQUARE_GUARD = F.SQUARE_GUARD

    def _check_factor(self) -> float:
        """The factor the check pass applies before its inf/NaN test: 1, or ``_SQUARE_GUARD`` for an update that
        squares unclipped gradients (the subclass says which)."""
        return 1.0

    def _needs_grad_norm(self) -> bool:
        """Does the update use the global gradient norm (clipping)? If not, a handed-over ``found_inf`` declared
        final (``fp16kit.kernels.flag_is_final``) makes the step's check pass redundant, and it is skipped."""
        return True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear grads; ``set_to_none`` defaults to the constructor's ``set_grad_none`` (apex semantics)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _weights(self, group: dict[str, Any]) -> Bf16Weights | None:
        """The update's bf16 write epilogue for ``group`` (None outside the bf16 modes): stochastic rounding keys
        its random bits by the group's seed, its position, its device step counter (docs/optim.md) and, for FSDP2
        shards, each row's first element's index in its whole param (``_shard_offsets``: every rank draws the
        one-process bits)."""
        mode = self.__dict__.get("bf16_weights")
        if mode is None:
            return None
        if mode == "split":
            return Bf16Weights("split")
        stream = next(i for i, g in enumerate(self.param_groups) if g is group)
        offsets = None
        if self._shard_plan is not None:  # the rows are group["params"] with a grad, in order (_collect_group)
            offsets = self._shard_offsets([p for p in group["params"] if p.grad is not None])
        return Bf16Weights("stochastic", int(group["rounding_seed"]), stream, group["step"], offsets)

    #: The bf16 weight modes that step FSDP2 shards: both. "split" steps each shard's reassembled masters bit for bit
    #: as ``master_weights=True`` does (LAMB's sharded stages, ``_sharding.defer_lamb``, with the split epilogue);
    #: "stochastic" draws each element's bits from its index in its whole param (``_sharding.element_offsets``), the
    #: bits one process draws. A subclass without the epilogues in its sharded step lists fewer.
    _fsdp2_bf16_modes: tuple[str, ...] = ("split", "stochastic")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step over every group (see the module docstring for the math).

        Under a GradScaler (``optimizer.grad_scale``/``optimizer.found_inf`` set by it) the grads are
        unscaled inside the step and a set ``found_inf`` makes the step a no-op on the device. Without a
        scaler, a non-finite grad skips the step and then warns, raises or stays silent per ``on_nonfinite``.
        A tensor ``lr`` that is NaN, inf or negative skips the step on the device too (``hparam_skips``
        counts these; reported per ``on_nonfinite``; the scaler's ``found_inf`` is not raised).

        Raises ValueError (before anything changes) for invalid host hyper-parameters in any group, a grad
        or state tensor that does not match its param, or a step counter that is NaN or negative.

        Step pre/post hooks (``register_step_pre_hook``, torch's global ones) and the profiler's
        ``Optimizer.step#<class>.step`` range are torch's own wrapper (``Optimizer.profile_hook_step``), run whenever
        a hook is registered, a profiler is on or Dynamo traces the step; otherwise the step skips that wrapper (it
        would only loop over empty registries and open a range nobody records: about 10 us per step).
        """
        if type(self).step is FusedOptimizer.step and step_watched(self):
            return _HOOKED_STEP(self, closure)
        if torch.compiler.is_compiling():
            return self._step(closure)
        # eager: grad mode set by hand (what torch.no_grad does, without its context manager's ~1 us)
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return self._step_body(closure)
        finally:
            torch._C._set_grad_enabled(grad_mode)

    # torch's Optimizer wraps a class's ``step`` in its hook-and-profile wrapper unless the function says it is
    # ``hooked``; this one calls that wrapper itself when something watches (above). A subclass that defines its own
    # ``step`` gets torch's wrapper around it as usual, and its ``super().step()`` runs the plain step (no hook twice).
    step.hooked = True  # type: ignore[attr-defined]

    def _step_body(self, closure: Callable[[], Any] | None = None, *, host_vector: bool = False) -> Any:
        """The step itself (:meth:`step` without torch's hook-and-profile wrapper), run under no_grad;
        ``host_vector``: the host-vector step even where the device step could run (what a compiled step is)."""
        self._refuse_compiled_state8()
        if torch.compiler.is_compiling() and self._steps_eagerly_under_compile():
            return _eager_step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._settle_eager_steps()
        if not host_vector and self._replay_steady():  # the recorded device step, while nothing it depends on changed
            return loss
        unchecked_steps = self._check_groups()
        all_rows = self._collect()
        shards = self._shards(all_rows)
        device = self._rows_device(all_rows, shards)
        if device is None:
            return loss
        if shards is not None:
            self._step_sharded(all_rows, device, shards, unchecked_steps)
        elif torch.compiler.is_compiling():
            self._step_compiled(all_rows, device, unchecked_steps)
        elif not host_vector and self._on_device(device):
            self._step_on_device(all_rows, device)
        else:
            self._step_host_vector(all_rows, device)
        return loss

    #: :meth:`_step_body` under ``torch.no_grad()`` (the step torch's wrapper and a compiled step call)
    _step = torch.no_grad()(_step_body)

    # -- the step's stages ----------------------------------------------------------------------------------

    def _steps_eagerly_under_compile(self) -> bool:
        """Whether a compiled step runs this optimizer's step eagerly, as one graph break: its passes have no
        dispatcher op (``fp16kit/kernels/library.py`` holds the fp32 and fp32-master LAMB and Adam updates only),
        so traced, the step's Python around them (planning, address tables, the host checks) would break into dozens
        of frames, each compiled, and recompile past Dynamo's limit. Here: the bf16 weight modes ("split",
        "stochastic"); apex's other optimizers: always (``_apex_common.py``)."""
        return self.__dict__.get("bf16_weights") in ("split", "stochastic")

    def _release_step_rows(self) -> None:
        """Let go of the rows a step kept for its own use (a subclass's; nothing here)."""

    def _refuse_compiled_state8(self) -> None:
        """``torch.compile`` of an 8-bit step is refused before any state is made: Dynamo falls back to running a
        frame that raises eagerly (and traces the frames it calls), so the eager step under torch.compile raises
        too."""
        if self.state_bits == 8 and under_torch_compile():
            raise NotImplementedError(self._compile8_message())

    def _settle_eager_steps(self) -> None:
        """An eager step's first act (not while compiling or capturing): warn for earlier skipped steps whose CUDA
        events have completed, and forget autocast's cached casts (a step inside an autocast region: its next op
        re-casts the stepped weights)."""
        if not torch.compiler.is_compiling() and not capturing():
            self._flush_warnings()
            forget_autocast_casts()

    def _shards(self, all_rows: list[_Rows]) -> Any:
        """The sharded step's plan (``_sharding.ShardPlan``: local shards and the group to sum over), or None for a
        single-process step, kept in the step cache as ``shard_plan``. A bf16 mode the class does not list in
        ``_fsdp2_bf16_modes`` is refused for DTensor params here."""
        cache = self._step_cache
        if self.process_group is None and not cache.get("rows_dtensors", True):
            cache["shard_plan"] = None  # no DTensor param and no process group: what a shard plan would say
            return None
        mode = self.__dict__.get("bf16_weights")
        if mode is not None and mode not in self._fsdp2_bf16_modes and any(
            is_dtensor(p) for group in self.param_groups for p in group["params"]
        ):
            fits = " or ".join(repr(m) for m in (*self._fsdp2_bf16_modes, True))
            raise NotImplementedError(
                f"{self._name}: master_weights={mode!r} does not step FSDP2 (DTensor) params yet; use "
                f"master_weights={fits} there, or ZeRO-1 (process_group=) (docs/optim.md)."
            )
        return self._plan_shards(all_rows)

    @staticmethod
    def _has_dtensors(params: list[torch.Tensor]) -> bool:
        """Is any of ``params`` an FSDP2 (DTensor) param? (The rows' verdict remembers it: a step without one and
        without a ``process_group`` needs no shard plan.)"""
        return any(map(is_dtensor, params))

    def _plan_shards(self, all_rows: list[_Rows]) -> Any:
        """The hook of the sharded step (``_sharding.ShardedSteps`` implements it): here no param may be a DTensor
        and no ``process_group`` given (this class steps whole tensors on one process)."""
        params = [p for g in self.param_groups for p in g["params"]]
        if self.process_group is not None or any(map(is_dtensor, params)):
            raise NotImplementedError(
                f"{self._name} does not step sharded params (DTensor params or process_group=); use an optimizer "
                f"of fp16kit.optim that does (docs/optim.md)."
            )
        self._step_cache["shard_plan"] = None
        return None

    def _shard_offsets(self, present: list[torch.Tensor]) -> tuple[int, ...] | None:
        """Each param's first element's index in its whole param (stochastic rounding of FSDP2 shards); the sharded
        step's hook (``_sharding.ShardedSteps``), None here."""
        return None

    def _rows_device(self, all_rows: list[_Rows], shards: Any) -> torch.device | None:
        """The one device of every row (raises for rows on several devices), or the shard plan's device for a rank
        without grads (it must still join the collectives); None when there is nothing to step."""
        device = self._step_cache.get("rows_device")
        if device is None or shards is not None:
            device = common_device(
                self._name, [p for rows in all_rows for p in rows.params], [g for rows in all_rows for g in rows.grads]
            )
        if device is None and shards is not None:
            device = shards.device
        return device

    def _step_compiled(self, all_rows: list[_Rows], device: torch.device, unchecked_steps: list[torch.Tensor]) -> None:
        """The step ``torch.compile`` traces: the host-vector path on the ``fp16kit::`` dispatcher ops
        (``_updates``), reading nothing on the host; a step counter set by hand is checked on the device
        (``unchecked_steps``, like a tensor ``lr``)."""
        self._step_host_vector(all_rows, device, unchecked_steps=unchecked_steps)

    def _step_sharded(
        self, all_rows: list[_Rows], device: torch.device, shards: Any, unchecked_steps: list[torch.Tensor]
    ) -> None:
        """FSDP2 shards or a ZeRO-1 partition: the host-vector path with the norm and flag summed over the shard
        group (``_sharding.py``)."""
        self._step_host_vector(all_rows, device, shards=shards, unchecked_steps=unchecked_steps)


#: torch's hook-and-profile wrapper (step pre-hooks, the profiler's ``Optimizer.step#<class>.step`` range, post-hooks)
#: around the plain step: what torch would have put in place of ``FusedOptimizer.step``.
_HOOKED_STEP = torch.optim.Optimizer.profile_hook_step(FusedOptimizer._step)


def _eager_step_body(optimizer: FusedOptimizer, closure: Callable[[], Any] | None) -> Any:
    try:
        with torch.no_grad():
            return optimizer._step_body(closure, host_vector=True)
    finally:
        optimizer._release_step_rows()


#: A compiled step of an optimizer whose passes have no dispatcher op (``FusedOptimizer._steps_eagerly_under_compile``):
#: the eager host-vector step (what every compiled step is), bit for bit, as one graph break.
_eager_step = torch.compiler.disable(_eager_step_body)
