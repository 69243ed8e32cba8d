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

Validation (``docs/optim.md``): host hyper-parameters of every group are checked at every step (a scheduler
or a hand edit may have changed them) and raise naming the group and key; every row (param, grad, moments,
master) is checked for shape/dtype/device/layout before a kernel sees its addresses; checkpoints are
checked in ``load_state_dict`` (``_checkpoint.py``) and a rejected load or ``add_param_group`` leaves the
optimizer as it was.

Nothing here reads a device value on the host, except the ``on_nonfinite="raise"`` policy (and, on CPU
tensors, which have no queue to drain, the "warn" policy in an eager step).

``torch.compile(opt.step)``: while Dynamo traces, the passes are the ``fp16kit::`` dispatcher ops
(``fp16kit/kernels/library.py``), "warn" reads nothing (skips are counted in ``nonfinite_skips``) and a step
counter set by hand is checked on the device: one graph, no graph break (docs/optim.md, "torch.compile").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter, is_not, itemgetter
from typing import Any

import torch

from fp16kit.distributed import is_dtensor, local
from fp16kit.kernels import (
    STATE8_SMALL_NUMEL,
    Backend,
    Bf16Weights,
    DeviceStep,
    check_found_inf,
    common_device,
    flag_is_final,
    flag_nonfinite,
    forget_autocast_casts,
    join_halves,
    library,
    metadata_guard,
    new_found_inf,
    select_backend,
    state8_absmax,
    step_check,
    to_state8,
    unscale_and_check,
    uses_state8,
    vouched_rows,
)
from fp16kit.kernels.optimizers import record_launches, replay_launches

from . import _checkpoint, _sharding, _state8_dtensor
from . import functional as F
from ._validate import check_param_tensor, check_row, check_step_value, naming_group

__all__ = ["FusedOptimizer"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_POLICIES = ("skip", "warn", "raise")
#: ``master_weights`` values for bf16 params without an fp32 master (docs/optim.md, "bf16 weights without fp32
#: masters"): ``"split"`` keeps the master's low 16 bits in ``state["master_low"]``, ``"stochastic"`` keeps nothing.
BF16_MODES = ("split", "stochastic")
#: The state key of the split master's low halves (int16, the param's shape).
LOW_KEY = "master_low"


_data_ptr = torch.Tensor.data_ptr


_not_none = functools.partial(is_not, None)  # C-level: filter(_not_none, models) drops the None entries


def _fact(value: Any) -> Any:
    """A hyper-parameter as a replay key holds it: a tensor by identity, a list (``betas=[0.9, 0.999]``, mutable in
    place) as a tuple of its values, anything else as is."""
    if isinstance(value, torch.Tensor):
        return id(value)
    if isinstance(value, list):
        return tuple(map(_fact, value))
    return value


class _Uncompared:
    """A value carried in a replay key that never decides equality (the key's written tensors)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Uncompared)

    __hash__ = None  # type: ignore[assignment]


@dataclass(eq=False)
class _DeviceProgram:
    """A recorded device step (``FusedOptimizer._step_on_device``): its replay key, launches, and whether its check
    pass counted the skip on the device."""

    key: tuple
    launches: list
    counted: bool

try:  # Dynamo's frame callback: set inside a torch.compile'd call (while tracing, and in frames it runs eagerly)
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # pragma: no cover - a torch without Dynamo's C frame hook: the trace-time check alone
    _dynamo_callback = None


def _under_torch_compile() -> bool:
    """Is this code running inside a ``torch.compile``'d call: traced by Dynamo, or run eagerly after Dynamo fell
    back on a frame (an exception raised while tracing makes it run that frame eagerly)?"""
    if torch.compiler.is_compiling():
        return True
    return _dynamo_callback is not None and _dynamo_callback() not in (None, False)


def _capturing() -> bool:
    """Is the current CUDA stream being captured into a graph? (Nothing may wait on the device then.)"""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclass
class _Rows:
    """The tensors one group's update works on, paired by position."""

    params: list[torch.Tensor] = field(default_factory=list)  # masters in master-weights mode
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    models: list[torch.Tensor | None] = field(default_factory=list)  # low-precision params that get a copy


_grad_of = attrgetter("grad")


@dataclass(eq=False)
class _Verdict:
    """One group's remembered row check (``FusedOptimizer._collect``): valid while the group holds the same param
    objects (``ids``), the same params have grads (``has_grad``) and masters (``has_master``), and every tensor of
    the rows has the metadata it had when ``check_row`` passed (``guard``: shape, strides, dtype, device, dispatch
    keys, checked in C++). ``device``: the rows' common device; ``dtensors``: some param of the group is a DTensor."""

    ids: tuple[int, ...]
    has_grad: tuple[bool, ...]
    has_master: tuple[bool, ...]
    guard: Any
    device: torch.device | None
    dtensors: bool


def _check_seed(fn: str, index: int, seed: Any) -> None:
    """A stochastic-rounding seed: an int in [0, 2**63) (the 64-bit Philox key)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(
            f"{fn}: param_groups[{index}]['rounding_seed'] must be an int in [0, 2**63) (the stochastic-rounding "
            f"key), got {seed!r}."
        )


class FusedOptimizer(torch.optim.Optimizer):
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
        # _sharding.localize) lives in a dict for the same reason.
        self._step_cache: dict[str, Any] = {}
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
    def hparam_skips(self) -> torch.Tensor | None:
        """Steps skipped on the device because a tensor hyper-parameter (``lr``) was NaN, inf or negative:
        a one-element int64 tensor on the params' device (None until a group has a tensor lr)."""
        return self.__dict__.get("_skip_counts", {}).get("hparam_skips")

    @property
    def nonfinite_skips(self) -> torch.Tensor | None:
        """Steps skipped on the device because a gradient held inf/NaN with no loss scaler attached (a scaler
        counts its own skips): a one-element int64 tensor on the params' device (None before the first step).
        A compiled step's only report under ``on_nonfinite="warn"`` (docs/optim.md)."""
        return self.__dict__.get("_skip_counts", {}).get("nonfinite_skips")

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
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's, then the host caches an optimizer pickled by an earlier fp16kit lacks (the step reads them as
        plain attributes: Dynamo before torch 2.13 cannot trace ``__dict__.setdefault``)."""
        super().__setstate__(state)
        for name in ("_step_cache", "_skip_counts", "_verdicts", "_known_steps"):
            self.__dict__.setdefault(name, {})
        self.__dict__.setdefault("_pending", [])

    # -- param groups ---------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated: dense real float params, valid hyper-parameters).

        Everything is checked before the group is added: a rejected group leaves ``param_groups`` and the
        state as they were.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"{self._name}.add_param_group: expected a dict, got {type(param_group).__name__}.")
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(f"{self._name}: a param group's params must be an ordered sequence, not a set.")
        elif params is not None:
            params = list(params)
        param_group["params"] = params
        index = len(self.param_groups)
        for i, p in enumerate(params or []):
            check_param_tensor(self._name, i, p, group=index)
            if self.__dict__.get("bf16_weights") and p.dtype not in (torch.bfloat16, torch.float32):
                raise TypeError(
                    f"{self._name}: param_groups[{index}]['params'][{i}] has dtype {p.dtype}, but "
                    f"master_weights={self.bf16_weights!r} keeps bf16 params without an fp32 master (fp32 params "
                    f"are updated directly). Cast the model to torch.bfloat16, or use master_weights=True for "
                    f"{p.dtype} params."
                )
        with naming_group(index):
            self._check_group({**self.defaults, **param_group})
        self._check_rounding_seed(index, {**self.defaults, **param_group})
        super().add_param_group(param_group)
        self._own_counter(self.param_groups[-1])

    def _check_rounding_seed(self, index: int, group: dict[str, Any]) -> None:
        """Stochastic rounding's seed of group ``index`` (an int in ``[0, 2**63)``): in ``add_param_group``, at every
        step (an edit by hand) and at load (a checkpoint's), before anything is written."""
        if self.__dict__.get("bf16_weights") == "stochastic":
            _check_seed(self._name, index, group.get("rounding_seed"))

    def _own_counter(self, group: dict[str, Any]) -> None:
        """Each group owns its step counter: a tensor ``step`` that another group holds too (a group dict copied
        from another, ``step`` included; one tensor given to two groups; a hand assignment) becomes this group's own
        copy, so that no step advances a counter twice (docs/optim.md, "Step counters")."""
        step = group.get("step")
        if isinstance(step, torch.Tensor) and any(g is not group and g.get("step") is step for g in self.param_groups):
            group["step"] = step.detach().clone()

    def _adopt_counters(self) -> None:
        """After a committed load: each group's counter a copy of the checkpoint's (``state_dict()`` hands out the
        live tensors: a second optimizer loading it must not advance the first one's), remembered as checked."""
        for gi, group in enumerate(self.param_groups):
            if isinstance(group.get("step"), torch.Tensor):
                group["step"] = group["step"].detach().clone()
            if group["params"] and "step" in group:
                self._own_step(gi, group, group["params"][0].device)

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

    def _check_groups(self) -> list[torch.Tensor]:
        """Host hyper-parameters of every group (edited after construction?), and host step counters.

        Returns the step counters left to the device: in a compiled step a tensor counter installed by hand is
        not read (that would break the graph); the step treats it like a tensor ``lr``, skipping on the device
        when it is NaN, inf or negative."""
        unchecked = []
        for gi, group in enumerate(self.param_groups):
            with naming_group(gi):
                self._check_group(group)
            self._check_rounding_seed(gi, group)
            step = group.get("step")
            if step is not None and self._known_steps.get(gi) is not step:
                if isinstance(step, torch.Tensor) and step.numel() == 1 and torch.compiler.is_compiling():
                    unchecked.append(step)
                    continue
                # a number, or a tensor installed by hand: read once (a sync on a GPU, only when it changed)
                value = step.reshape(-1)[0] if isinstance(step, torch.Tensor) and step.numel() == 1 else step
                check_step_value(self._name, gi, float(value))
                self._own_counter(group)
        return unchecked

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear grads; ``set_to_none`` defaults to the constructor's ``set_grad_none`` (apex semantics)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    # -- state ----------------------------------------------------------------------------------------------

    def _state_for(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Lazily created state: fp32 moments (fp64 for fp64 params) and, in master-weights mode, an fp32
        master copy of each fp16/bf16 param."""
        state = self.state[p]
        if not state:
            math = torch.float64 if p.dtype == torch.float64 else torch.float32
            if self.master_weights and p.dtype in _LOW_PRECISION:
                state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            elif self.bf16_weights == "split" and p.dtype == torch.bfloat16:
                # the bf16 value is its own fp32 master exactly: high half p, low half 0
                state[LOW_KEY] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)
            kind = self._state8(p)
            if kind in ("rows", "flat"):  # an FSDP2 param: DTensor codes and absmax (_state8_dtensor.py)
                for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                    state[key], state[f"{key}_absmax"] = _state8_dtensor.moment(p, kind, signed)
                return state
            if kind:
                self._set_moments8(state, p.new_zeros(p.shape, dtype=torch.float32), p.new_zeros(p.shape,
                                   dtype=torch.float32))
                return state
            state["exp_avg"] = torch.zeros_like(p, dtype=math, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=math, memory_format=torch.contiguous_format)
        return state

    def _state8(self, p: torch.Tensor) -> bool | str:
        """Whether ``p``'s moments are 8-bit here (``state_bits=8`` and ``uses_state8``). For an FSDP2 (DTensor)
        param, the layout of its DTensor state (``"rows"``/``"flat"``, truthy) or False where its shards keep
        fp32 moments; raises for a param whose shards do not line up with the quantization blocks
        (``_state8_dtensor.layout``)."""
        if self.state_bits != 8 or not uses_state8(p):
            return False
        if is_dtensor(p):
            return _state8_dtensor.layout(self._name, p, lambda: self._where(p)) or False
        return True

    def _where(self, p: torch.Tensor) -> str:
        """``param_groups[g]['params'][i]`` of ``p`` (for messages)."""
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{i}]"
        return "a param"

    @staticmethod
    def _set_moments8(state: dict[str, Any], exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """8-bit moments quantized from the fp32 values, and their absmax views under ``*_absmax`` keys (so
        ``state_dict()`` carries them)."""
        for key, x, signed in (("exp_avg", exp_avg, True), ("exp_avg_sq", exp_avg_sq, False)):
            codes = to_state8(x.float(), signed)
            state[key] = codes
            state[f"{key}_absmax"] = state8_absmax(codes)

    def _state_kw(self) -> dict[str, int]:
        """The ``state_bits`` argument of the update ops (none for fp32 state). ``torch.compile`` of an 8-bit step
        is refused: the dispatcher ops take fp32 state only."""
        if self.state_bits == 32:
            return {}
        if torch.compiler.is_compiling():
            raise NotImplementedError(self._compile8_message())
        return {"state_bits": self.state_bits}

    def _compile8_message(self) -> str:
        return (
            f"{self._name}: torch.compile of a state_bits=8 step is not supported yet; run the step eagerly, outside "
            f"the compiled function (it is already one launch set per dtype group), or use state_bits=32."
        )

    def _collect(self) -> list[_Rows]:
        """Rows of every group (params without a grad are left out), each checked (``check_row``).

        The check's verdict is remembered per group (:class:`_Verdict`): the next step gathers the rows with
        C-level maps (``p.grad``, ``state[p]``, the state keys) and, when the group holds the same params and the
        guard passes on every row tensor (new grad tensors included: re-allocated grads have new addresses, and
        what ``check_row`` reads of them, numel/dtype/layout/device, is their metadata), skips ``check_row``.
        Anything else (a param or state entry missing or replaced by a tensor of other metadata, a state key
        deleted, a grad appearing or disappearing) runs the full per-param check again, with its messages. Not
        while ``torch.compile`` traces (the guard is host state Dynamo need not see): the per-param check then.
        """
        cache = self._step_cache
        cache["rows_device"] = None
        cache["rows_dtensors"] = True  # unknown: the step asks _sharding
        if torch.compiler.is_compiling():
            return [self._collect_group(gi, group)[0] for gi, group in enumerate(self.param_groups)]
        verdicts = self.__dict__.setdefault("_verdicts", {})  # an optimizer pickled before the cache existed
        out = []
        devices = set()
        dtensors = False
        for gi, group in enumerate(self.param_groups):
            rows = self._recollect(group, verdicts.get(id(group)))
            if rows is None:
                rows, verdict = self._collect_group(gi, group)
                verdicts[id(group)] = verdict
            else:
                verdict = verdicts[id(group)]
            out.append(rows)
            devices.add(verdict.device)
            dtensors = dtensors or verdict.dtensors
        if len(verdicts) > len(self.param_groups):  # groups removed by hand: drop their verdicts
            live = {id(g) for g in self.param_groups}
            for key in [k for k in verdicts if k not in live]:
                del verdicts[key]
        devices.discard(None)
        if len(devices) == 1:
            cache["rows_device"] = devices.pop()
        cache["rows_dtensors"] = dtensors
        return out

    def _collect_group(self, gi: int, group: dict[str, Any]) -> tuple[_Rows, _Verdict | None]:
        """One group's rows, every param checked (``check_row``), and the verdict to remember (None while
        compiling)."""
        rows = _Rows()
        moment_keys = self._moment_keys
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self._state_for(p)
            check_row(self._name, gi, i, p, p.grad, state, moment_keys, state8=self._state8(p))
            master = state.get(self._paired_key)
            if self._paired_key == LOW_KEY:
                rows.params.append(p)
                rows.models.append(None if master is None else master.view(torch.bfloat16))
            else:
                rows.params.append(p if master is None else master)
                rows.models.append(None if master is None else p)
            rows.grads.append(p.grad)
            rows.exp_avgs.append(state["exp_avg"])
            rows.exp_avg_sqs.append(state["exp_avg_sq"])
        if torch.compiler.is_compiling():
            return rows, None
        params = group["params"]
        present = [p for p in params if p.grad is not None]
        states = [self.state[p] for p in present]
        masters = [s.get(self._paired_key) for s in states]
        flat = self._row_tensors(present, states, [m for m in masters if m is not None])
        device = common_device(self._name, rows.params, rows.grads)
        verdict = _Verdict(
            ids=tuple(map(id, params)),
            has_grad=tuple(p.grad is not None for p in params),
            has_master=tuple(m is not None for m in masters),
            guard=metadata_guard(flat),
            device=device,
            dtensors=any(map(is_dtensor, params)),
        )
        return rows, verdict

    def _row_tensors(self, present: list, states: list, masters: list) -> list[torch.Tensor]:
        """Every tensor ``check_row`` reads, in the guard's order: params, grads, each moment, masters."""
        flat = list(present)
        flat += map(_grad_of, present)
        for key in self._moment_keys:
            flat += map(itemgetter(key), states)
        flat += masters
        return flat

    def _recollect(self, group: dict[str, Any], verdict: _Verdict | None) -> _Rows | None:
        """The group's rows under a remembered verdict, or None when the verdict does not cover them."""
        if verdict is None:
            return None
        params = group["params"]
        grads = list(map(_grad_of, params))
        has_grad = tuple(map(is_not, grads, repeat(None)))
        if has_grad != verdict.has_grad or tuple(map(id, params)) != verdict.ids:
            return None
        if False in has_grad:
            present, grads = list(compress(params, has_grad)), list(compress(grads, has_grad))
        else:
            present = list(params)
        try:
            states = list(map(self.state.__getitem__, present))
            moments = [list(map(itemgetter(key), states)) for key in self._moment_keys]
            masters = list(map(dict.get, states, repeat(self._paired_key)))
        except (KeyError, TypeError):  # a state entry deleted or replaced by hand: the full check says what
            return None
        has_master = tuple(map(is_not, masters, repeat(None)))
        if has_master != verdict.has_master:
            return None
        own = list(compress(masters, has_master)) if True in has_master else []
        try:
            flat = present + grads
            for row in moments:
                flat += row
            if not verdict.guard.check(*flat, *own):
                return None
        except (TypeError, RuntimeError, AttributeError):  # a state value that is not a tensor
            return None
        if not own:
            params_row, models = present, [None] * len(present)
        elif self._paired_key == LOW_KEY:
            params_row, models = present, [None if m is None else m.view(torch.bfloat16) for m in masters]
        elif len(own) == len(present):
            params_row, models = own, present
        else:
            params_row = [p if m is None else m for p, m in zip(present, masters)]
            models = [None if m is None else p for p, m in zip(present, masters)]
        by_key = dict(zip(self._moment_keys, moments))
        return _Rows(list(params_row), grads, by_key["exp_avg"], by_key["exp_avg_sq"], list(models))

    @property
    def _paired_key(self) -> str:
        """The state key of the tensor paired with each low-precision param: its fp32 ``"master"`` or, in split
        mode, its int16 low half (``LOW_KEY``)."""
        return LOW_KEY if self.__dict__.get("bf16_weights") == "split" else "master"

    def _weights(self, group: dict[str, Any]) -> Bf16Weights | None:
        """The update's bf16 write epilogue for ``group`` (None outside the bf16 modes): stochastic rounding keys
        its random bits by the group's seed, its position, its device step counter (docs/optim.md) and, for FSDP2
        shards, each row's first element's index in its whole param (``_sharding.element_offsets``: every rank
        draws the one-process bits; kept per param list in the step cache)."""
        mode = self.__dict__.get("bf16_weights")
        if mode is None:
            return None
        if mode == "split":
            return Bf16Weights("split")
        stream = next(i for i, g in enumerate(self.param_groups) if g is group)
        offsets = None
        if self._shard_plan is not None:  # the rows are group["params"] with a grad, in order (_collect_group)
            present = [p for p in group["params"] if p.grad is not None]
            known = self._step_cache.setdefault("bf16_offsets", {})
            key = tuple(map(id, present))
            if key not in known:
                known[key] = _sharding.element_offsets(self._name, present)
            offsets = known[key]
        return Bf16Weights("stochastic", int(group["rounding_seed"]), stream, group["step"], offsets)

    @staticmethod
    def _group_step(group: dict[str, Any], device: torch.device) -> torch.Tensor:
        """The group's step counter: a one-element fp32 tensor on the device (apex keeps it per group)."""
        step = group.get("step")
        if not isinstance(step, torch.Tensor) or step.device != device or step.dtype != torch.float32:
            value = step if step is not None else 0
            step = torch.as_tensor(value, dtype=torch.float32).reshape(1).to(device)
            group["step"] = step
        return step

    def _own_step(self, gi: int, group: dict[str, Any], device: torch.device) -> torch.Tensor:
        """Group ``gi``'s counter, remembered as checked: one made here, or one ``_check_groups`` read on the host
        (a compiled step checks a counter set by hand on the device only, so the next eager step reads it). Keyed by
        the group's position (Dynamo before torch 2.13 cannot trace ``id()`` of a dict): a stale entry after groups
        were removed by hand is harmless, it is compared with ``is``."""
        old = group.get("step")
        step = self._group_step(group, device)
        if step is not old or not torch.compiler.is_compiling():
            self._known_steps[gi] = step
        return step

    def master_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer updates: fp32 masters where they exist, else the params themselves (in the
        bf16 modes the params: see :meth:`split_masters` for split mode's fp32 values)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                master = self.state[p].get("master") if p in self.state else None
                out.append(p if master is None else master)
        return out

    def split_masters(self) -> list[torch.Tensor]:
        """Split mode: the fp32 master of every param, reassembled (new tensors, ``(hi << 16) + lo``): bit for bit
        what ``master_weights=True`` would hold. Params without a low half (fp32, or no step yet) are returned as
        fp32 copies. An FSDP2 (DTensor) param gives this rank's shard (a plain tensor)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                low = self.state[p].get(LOW_KEY) if p in self.state else None
                hi = local(p.detach())
                out.append(hi.float() if low is None else join_halves(hi, local(low)))
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's ``state_dict``; with ``state_bits=8`` each 8-bit moment's codes and absmax are copies (a snapshot,
        about 2 bytes per param for the two moments): the live absmax is a float32 view of the codes' own storage,
        which ``torch.save`` refuses (``_checkpoint.saveable_state8``)."""
        out = super().state_dict()
        if self.state_bits == 8:
            out["state"] = _checkpoint.saveable_state8(out["state"])
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint: validated, then committed (``_checkpoint.py``); on any error nothing changes.

        Keeps fp32 moments and masters fp32 for fp16/bf16 params (``torch.optim.Optimizer`` would cast them
        to the param dtype, losing bits). Accepts ``torch.optim.Adam``/``AdamW`` checkpoints (missing fp16kit
        keys come from the defaults; AMSGrad or ``maximize`` fail here). Rejects state that does not fit the
        params and NaN/inf/negative moments or step counters, naming the group, param and key. With
        ``master_weights=True``, masters missing from the checkpoint are rebuilt from the params (warning).
        One host read for the values (loading is not on the hot path). 8-bit moments (``state_bits=8``) load
        exactly into an 8-bit optimizer and dequantized into an fp32 one; fp32 moments are quantized into an
        8-bit one (``_checkpoint.split_state8``/``apply_state8``).
        """
        fn = self._name
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(f"{fn}.load_state_dict: expected a dict with 'state' and 'param_groups' (a state_dict()).")
        saved_groups = state_dict["param_groups"]
        saved_state, state8 = _checkpoint.split_state8(fn, state_dict["state"])
        state_dict = {**state_dict, "state": saved_state}
        groups = _checkpoint.import_groups(
            fn, saved_groups, self.defaults, adam_w_mode=bool(getattr(self, "adam_w_mode", True))
        )
        old_groups, old_state = self.param_groups, self.state
        try:
            super().load_state_dict({**state_dict, "param_groups": groups})
            state = _checkpoint.restore_state(
                fn,
                self.param_groups,
                saved_groups,
                state_dict["state"],
                moment_keys=self._moment_keys,
                master_weights=self.master_weights,
                bf16_weights=self.__dict__.get("bf16_weights"),
            )
            _checkpoint.check_state(fn, self.param_groups, state, self._moment_keys)
            _checkpoint.apply_state8(self, self.param_groups, saved_groups, state, state8)
            for gi, group in enumerate(self.param_groups):
                with naming_group(gi):
                    self._check_group(group)
                self._check_rounding_seed(gi, group)
        except BaseException:
            self.param_groups, self.state = old_groups, old_state
            raise
        self.state.clear()
        self.state.update(state)
        _checkpoint.finish_split(self.param_groups, self.state, self.__dict__.get("bf16_weights"))
        self.__dict__.get("_verdicts", {}).clear()
        self._adopt_counters()

    # -- step -----------------------------------------------------------------------------------------------

    @staticmethod
    def _updates() -> Any:
        """Where the passes come from: the dispatcher ops while ``torch.compile`` traces a step (Dynamo then
        sees one ``fp16kit::`` op per pass, not the launchers' ``data_ptr()`` reads), the eager functions
        (``fp16kit.optim.functional``: no dispatcher cost) otherwise. Both run the same implementation."""
        return library if torch.compiler.is_compiling() else F

    def _check_results(self, all_rows: list, inv_scale64: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Raise ``found_inf`` on the device when this step's update would store an inf/NaN (a finite grad
        can overflow it); runs before any group is written. A no-op here (subclasses: fp16kit/optim/_apex_common.py)."""

    def _update_group(
        self,
        group: dict[str, Any],
        rows: _Rows,
        step: torch.Tensor,
        inv_scale64: torch.Tensor,
        found_inf: torch.Tensor,
        grad_norm: torch.Tensor,
    ) -> None:
        raise NotImplementedError

    #: The bf16 weight modes that step FSDP2 shards: both. "split" steps each shard's reassembled masters bit for bit
    #: as ``master_weights=True`` does (LAMB's sharded stages, ``_sharding.defer_lamb``, with the split epilogue);
    #: "stochastic" draws each element's bits from its index in its whole param (``_sharding.element_offsets``), the
    #: bits one process draws. A subclass without the epilogues in its sharded step lists fewer.
    _fsdp2_bf16_modes: tuple[str, ...] = ("split", "stochastic")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step over every group (see the class docstring for the math).

        Under a GradScaler (``optimizer.grad_scale``/``optimizer.found_inf`` set by it) the grads are
        unscaled inside the step and a set ``found_inf`` makes the step a no-op on the device. Without a
        scaler, a non-finite grad skips the step and then warns, raises or stays silent per ``on_nonfinite``.
        A tensor ``lr`` that is NaN, inf or negative skips the step on the device too (``hparam_skips``
        counts these; reported per ``on_nonfinite``; the scaler's ``found_inf`` is not raised).

        Raises ValueError (before anything changes) for invalid host hyper-parameters in any group, a grad
        or state tensor that does not match its param, or a step counter that is NaN or negative.
        """
        if self.state_bits == 8 and _under_torch_compile():
            # before any state is made: Dynamo falls back to running a frame that raises eagerly (and traces the
            # frames it calls), so the eager step under torch.compile raises too
            raise NotImplementedError(self._compile8_message())
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not torch.compiler.is_compiling() and not _capturing():  # pending warnings: CUDA events of eager steps
            self._flush_warnings()
            forget_autocast_casts()  # a step inside an autocast region: its next op re-casts the stepped weights
        unchecked_steps = self._check_groups()
        all_rows = self._collect()
        cache = self._step_cache
        if self.process_group is None and not cache.get("rows_dtensors", True):
            shards = cache["shard_plan"] = None  # no DTensor param and no process group: what localize would say
        else:
            mode = self.__dict__.get("bf16_weights")
            if mode is not None and mode not in self._fsdp2_bf16_modes and any(
                is_dtensor(p) for group in self.param_groups for p in group["params"]
            ):
                fits = " or ".join(repr(m) for m in (*self._fsdp2_bf16_modes, True))
                raise NotImplementedError(
                    f"{self._name}: master_weights={mode!r} does not step FSDP2 (DTensor) params yet; use "
                    f"master_weights={fits} there, or ZeRO-1 (process_group=) (docs/optim.md)."
                )
            shards = _sharding.localize(self, all_rows)  # FSDP2/ZeRO: local shards and the group to sum over
        device = cache.get("rows_device")
        if device is None or shards is not None:
            device = common_device(
                self._name, [p for rows in all_rows for p in rows.params], [g for rows in all_rows for g in rows.grads]
            )
        if device is None and shards is not None:
            device = shards.device  # no grads here, but this rank must still join the collectives
        if device is None:
            return loss
        if shards is None and not unchecked_steps and self._on_device(device):
            self._step_on_device(all_rows, device)
            return loss
        inv64 = F.inv_scale_from_grad_scale(getattr(self, "grad_scale", None), device)
        found_inf = getattr(self, "found_inf", None)
        own_flag = found_inf is None
        if own_flag:
            found_inf = new_found_inf(device)
        else:
            check_found_inf(f"{self._name}.step", found_inf, device)
        factor = self._check_factor()
        if shards is None and not self._needs_grad_norm() and not torch.compiler.is_compiling():
            grad_norm = torch.zeros((), dtype=torch.float32, device=device)  # not used
            if own_flag or not flag_is_final(self):
                # the check alone (no norm): fp16kit.kernels.flag_nonfinite, C-level on the CPU (a norm pass
                # there is per-tensor Python); the caller's final flag (fp16kit/kernels/found_inf.py, "Final
                # flags": amp O2's fused path) already covers these grads at this scale
                flag_nonfinite([g for rows in all_rows for g in rows.grads], inv64.float() * factor, found_inf)
        else:
            guard = inv64 if self._needs_grad_norm() else inv64 * factor  # the norm is then unused
            grad_norm = F.check_and_norm([g for rows in all_rows for g in rows.grads], guard, found_inf)
        self._check_results(all_rows, inv64, found_inf)  # before any write and before the flag is shared
        if shards is not None:
            grad_norm = shards.reduce_norm_and_flag(grad_norm, found_inf)
        unchecked_steps = [s.to(device, torch.float64) for s in unchecked_steps]
        bad_hp = F.bad_lr_flag([g["lr"] for g in self.param_groups] + unchecked_steps, device)
        skip = found_inf if bad_hp is None else torch.maximum(found_inf.reshape(1), bad_hp)
        # The rows' tensors passed their group verdict's guard in _collect this step (eager, unsharded): the
        # planner may take that for its own metadata guard on the same lists (fp16kit.kernels.vouched_rows).
        verdicts = self.__dict__.get("_verdicts", {}) if shards is None and not torch.compiler.is_compiling() else {}
        for gi, (group, rows) in enumerate(zip(self.param_groups, all_rows)):
            step = self._own_step(gi, group, device)
            if rows.params:  # a group without grads keeps its counter (docs/optim.md, "Step counters")
                F.advance_step(step, skip)
            verdict = verdicts.get(id(group)) if verdicts else None  # (no id() while compiling)
            if verdict is None:
                self._update_group(group, rows, step, inv64, skip, grad_norm)
                continue
            with vouched_rows(verdict, (rows.params, rows.grads, rows.exp_avgs, rows.exp_avg_sqs, rows.models)):
                self._update_group(group, rows, step, inv64, skip, grad_norm)
        if shards is not None:
            shards.finish(skip)
        if self.unscale_grads and getattr(self, "grad_scale", None) is not None:
            self._write_unscaled_grads([g for rows in all_rows for g in rows.grads], inv64, device)
        self._count_and_report(bad_hp, found_inf if own_flag else None, device)
        return loss

    def _write_unscaled_grads(self, grads: list[torch.Tensor], inv64: torch.Tensor, device: torch.device) -> None:
        """apex's semantics after a GradScaler step: ``p.grad`` holds unscaled gradients (one extra write pass,
        after the update has read them scaled). fp16kit's default leaves them scaled, as torch's fused
        optimizers do."""
        grads = [g for g in grads if g.numel()]
        if grads:
            unscale = library.unscale_and_check if torch.compiler.is_compiling() else unscale_and_check
            unscale(grads, inv64.float(), new_found_inf(device))

    def _count_and_report(
        self,
        bad_hp: torch.Tensor | None,
        own_flag: torch.Tensor | None,
        device: torch.device,
        *,
        counted: bool = False,
        report: bool = True,
    ) -> None:
        """After the update: count a skip for a bad tensor ``lr`` (``hparam_skips``) and, with no scaler's flag
        (``own_flag``: the step's own), a non-finite gradient (``nonfinite_skips``, unless the check pass
        ``counted`` it already on the device); then report each per ``on_nonfinite`` (not while ``report`` is
        False: a captured step)."""
        if bad_hp is not None:
            self._count("hparam_skips", bad_hp, device)
            if report:
                self._report(bad_hp, self._hparam_message())
        if own_flag is not None:
            if not counted:
                self._count("nonfinite_skips", own_flag, device)
            if report:
                self._report(own_flag, self._message())

    # -- the device-resident step (docs/optim.md, "The step on the device") ---------------------------------

    def _device_step(self, group: dict[str, Any], base: DeviceStep) -> DeviceStep | None:
        """The group's step for kernels that derive their hyper-parameters on the device (``base`` with the
        group's host numbers filled in, :meth:`_adam_like_step`), or None where the subclass has no such kernels."""
        return None

    @staticmethod
    def _adam_like_step(
        group: dict[str, Any], base: DeviceStep, legacy: Callable[[], torch.Tensor], **extra: float
    ) -> DeviceStep:
        """``base`` with the host numbers Adam and LAMB share (``lr`` unless a tensor, ``beta1``, ``beta2``, ``eps``,
        ``weight_decay``) and ``extra``, a tensor ``lr`` (validated), the bias-correction switch, and ``legacy``:
        the same step's float64 vector for rows the kernels do not take."""
        b1, b2 = (float(b) for b in group["betas"])
        lr = group["lr"]
        host = {
            "lr": 0.0 if isinstance(lr, torch.Tensor) else float(lr),
            "beta1": b1,
            "beta2": b2,
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            **extra,
        }
        return dataclasses.replace(
            base, host=host, lr=F.device_lr(lr, base.step.device), bias_correction=bool(group["bias_correction"]),
            legacy=legacy,
        )

    def _on_device(self, device: torch.device) -> bool:
        """Can this eager step run device-resident? Triton kernels on ``device``, a subclass with device-step
        kernels, and a GradScaler's ``grad_scale`` (if any) a one-element float tensor on ``device``."""
        if torch.compiler.is_compiling() or type(self)._device_step is FusedOptimizer._device_step:
            return False
        if select_backend(device).backend is Backend.TORCH:
            return False
        scale = getattr(self, "grad_scale", None)
        return scale is None or (
            isinstance(scale, torch.Tensor) and scale.numel() == 1 and scale.is_floating_point()
            and scale.device == device
        )

    def _device_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The optimizer's own flag and gradient norm (float32 ``[1]`` each) on ``device``, made once: a step
        writes them whole, so it needs no fill (and a captured graph replays into the same memory)."""
        store = self._skip_counts
        key = f"buffers:{device}"
        bufs = store.get(key)
        if bufs is None:
            bufs = store[key] = torch.zeros(2, dtype=torch.float32, device=device)
        return {"flag": bufs[0:1], "gnorm": bufs[1:2]}

    def _step_on_device(self, all_rows: list[_Rows], device: torch.device) -> None:
        """``step`` with nothing copied from the host and nothing read back (CUDA-graph capturable).

        Launches per step and (device, dtype) group: the check pass (inf/NaN flag, the norm when the update uses
        it, and the skip count, finished in the same launch) and the update kernels, which derive the
        hyper-parameters from the device step counter and advance it (``fp16kit.kernels.DeviceStep``). A tensor
        ``lr`` adds the device check of its value (a few torch ops); anything the kernels cannot take (several
        grad dtypes, layouts the planner sends to the torch fallback) runs the torch passes for that part.

        A steady step (the same rows at the same addresses with the same metadata, the same hyper-parameters, flags
        and counters as the step before) is recorded once and then replayed (:meth:`_replay_key`): the recorded
        launches issued again, the written tensors' versions bumped, the skip reported, and nothing planned.
        """
        cache = self._step_cache
        key = self._replay_key(all_rows, device) if self.device_replay else None
        program = cache.get("device_program")
        if key is not None and program is not None and program.key == key:
            self._replay_step(program, key, device)
            return
        # Record a step whose key repeats the last one (a steady loop: grads kept, nothing changed), never while a
        # CUDA graph captures (the recording's bookkeeping is host work the capture need not see).
        recording = key is not None and key == cache.get("device_key") and not _capturing()
        cache["device_key"], cache["device_program"] = key, None
        with record_launches(device) if recording else contextlib.nullcontext() as rec:
            bad_hp, found_inf, own_flag, counted, grads = self._device_pass(all_rows, device)
        grad_scale = getattr(self, "grad_scale", None)
        if self.unscale_grads and grad_scale is not None:
            self._write_unscaled_grads(grads, F.inv_scale_from_grad_scale(grad_scale, device), device)
        elif rec is not None and rec.ok and bad_hp is None:
            cache["device_program"] = _DeviceProgram(key, rec.launches, counted)
        capturing = device.type == "cuda" and _capturing()
        self._count_and_report(bad_hp, found_inf if own_flag else None, device, counted=counted, report=not capturing)

    def _device_pass(
        self, all_rows: list[_Rows], device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor, bool, bool, list[torch.Tensor]]:
        """The device step's launches (and the torch passes for what the kernels cannot take): ``(bad_hp,
        found_inf, own_flag, counted, grads)`` for the report that follows."""
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        own_flag = found_inf is None
        bufs = self._device_buffers(device)
        if own_flag:
            found_inf = bufs["flag"]
        else:
            check_found_inf(f"{self._name}.step", found_inf, device)
        verdicts = self.__dict__.get("_verdicts", {})
        # One group: its own grads list, which its verdict's guard checked this step (_collect), so the planner may
        # take that for its own guard over the same list (fp16kit.kernels.vouched_rows): one pass less per step.
        only = verdicts.get(id(self.param_groups[0])) if len(all_rows) == 1 else None
        grads = all_rows[0].grads if only is not None else [g for rows in all_rows for g in rows.grads]
        norm = self._needs_grad_norm()
        gnorm = bufs["gnorm"]
        counter = self._counter("nonfinite_skips", device) if own_flag else None
        counted = False
        if own_flag or norm or not flag_is_final(self):
            factor = 1.0 if norm else self._check_factor()
            with vouched_rows(only, (grads,)) if only is not None else contextlib.nullcontext():
                counted = step_check(grads, grad_scale, found_inf, gnorm if norm else None, own_flag=own_flag,
                                     skip_count=counter, check_factor=factor)
            if not counted:  # the torch passes (several grad dtypes, the fallback's layouts)
                inv64 = F.inv_scale_from_grad_scale(grad_scale, device)
                if own_flag:
                    found_inf.zero_()
                if norm:
                    gnorm.copy_(F.check_and_norm(grads, inv64, found_inf).reshape(1))
                else:
                    flag_nonfinite(grads, inv64.float() * factor, found_inf)
        bad_hp = F.bad_lr_flag([g["lr"] for g in self.param_groups], device)
        skip = found_inf if bad_hp is None else torch.maximum(found_inf.reshape(1), bad_hp)
        for gi, (group, rows) in enumerate(zip(self.param_groups, all_rows)):
            step = self._own_step(gi, group, device)
            if not rows.params:  # no grads: the counter stays (docs/optim.md, "Step counters")
                continue
            base = DeviceStep(step, {}, scale=grad_scale, gnorm=gnorm)
            ds = self._device_step(group, base)
            verdict = verdicts.get(id(group))
            rows_t = (rows.params, rows.grads, rows.exp_avgs, rows.exp_avg_sqs, rows.models)
            with vouched_rows(verdict, rows_t) if verdict is not None else contextlib.nullcontext():
                self._run_device_update(group, rows, ds, skip)
        return bad_hp, found_inf, own_flag, counted, grads

    #: Replay steady device steps from their recording (:meth:`_step_on_device`); False: every step takes the full
    #: path (``benchmarks/bench_device_step_host.py`` times both in one run).
    device_replay: bool = True

    def _replay_key(self, all_rows: list[_Rows], device: torch.device) -> tuple | None:
        """What a recorded device step depends on, or None when this step cannot be replayed: every group's
        verdict (the rows' metadata, checked by its guard in :meth:`_collect`) and the addresses of every row
        tensor; the groups' hyper-parameters (tensors by identity: a tensor ``lr`` or step counter replaced), the
        optimizer's own settings, its counters and buffers, the GradScaler's scale and flag, and the backend.
        Equal keys mean the same launches with the same arguments: the planner, the tables and the launchers'
        argument packing would all give what the recording holds. The key's last entry is the list of written
        tensors (params or masters, moments, model copies) whose versions a replay bumps; it is not compared."""
        verdicts = self.__dict__.get("_verdicts")
        if not verdicts or torch.compiler.is_compiling():
            return None
        vs = tuple(map(verdicts.get, map(id, self.param_groups)))
        if None in vs:
            return None
        written: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for rows in all_rows:
            written += rows.params
            written += rows.exp_avgs
            written += rows.exp_avg_sqs
            written += filter(_not_none, rows.models)
            grads += rows.grads
        groups = tuple(tuple((k, _fact(v)) for k, v in g.items() if k != "params") for g in self.param_groups)
        own = tuple((k, v) for k, v in self.__dict__.items() if v is None or isinstance(v, (bool, int, float, str)))
        scaler = (id(getattr(self, "grad_scale", None)), id(getattr(self, "found_inf", None)), flag_is_final(self))
        return (vs, tuple(map(_data_ptr, written)), tuple(map(_data_ptr, grads)), groups, own, scaler,
                tuple(map(id, self._skip_counts.values())), select_backend(device).backend, _Uncompared(written))

    def _replay_step(self, program: _DeviceProgram, key: tuple, device: torch.device) -> None:
        """The recorded step again: its launches, the versions of what they write, the counters' bookkeeping and
        the skip report (the same calls the full path ends with)."""
        for gi, group in enumerate(self.param_groups):
            self._own_step(gi, group, device)
        replay_launches(program.launches)
        torch._C._increment_version(key[-1].value)
        found_inf = getattr(self, "found_inf", None)
        own_flag = found_inf is None
        if own_flag:
            found_inf = self._device_buffers(device)["flag"]
        capturing = device.type == "cuda" and _capturing()
        self._count_and_report(None, found_inf if own_flag else None, device, counted=program.counted,
                               report=not capturing)

    def _run_device_update(self, group: dict[str, Any], rows: _Rows, ds: DeviceStep, skip: torch.Tensor) -> None:
        raise NotImplementedError

    def _counter(self, name: str, device: torch.device) -> torch.Tensor:
        """The one-element int64 skip counter ``name`` on ``device`` (made on first use)."""
        counts = self._skip_counts
        counter = counts.get(name)
        if counter is None or counter.device != device:
            counter = counts[name] = torch.zeros(1, dtype=torch.int64, device=device)
        return counter

    def _count(self, name: str, flag: torch.Tensor, device: torch.device) -> None:
        """``self.<name> += flag`` on the device (a one-element int64 counter, made on first use)."""
        self._counter(name, device).add_(flag.reshape(1).to(torch.int64))

    # -- non-finite grads without a scaler ------------------------------------------------------------------

    def _message(self) -> str:
        return (
            f"{self._name}: a gradient holds inf or NaN"
            + (" or a magnitude of 2**63 (9.2e18) or more, whose square would overflow the second moment"
               if self._check_factor() != 1.0 else "")
            + "; the step was skipped (params, moments and the step counter are unchanged). Use a GradScaler "
            "for fp16 training, or lower the learning rate."
        )

    def _hparam_message(self) -> str:
        return (
            f"{self._name}: a tensor learning rate (or, in a compiled step, a step counter set by hand) is NaN, "
            f"inf or negative; the step was skipped on the device "
            f"(params, state and step counters are unchanged; optimizer.hparam_skips counts such steps). Check "
            f"the learning-rate schedule."
        )

    def _report(self, flag: torch.Tensor, message: str) -> None:
        """Act on a skip flag per ``on_nonfinite``: nothing, a warning (on CUDA one step later, no sync),
        or a RuntimeError (reads the flag: one sync per step on a GPU)."""
        if self.on_nonfinite == "skip":
            return
        if self.on_nonfinite == "warn" and torch.compiler.is_compiling():
            # A compiled step never reads the flag on the host (a graph break and, on a GPU, a sync): it is
            # counted on the device instead (``hparam_skips``/``nonfinite_skips``); "raise" keeps its read.
            return
        if self.on_nonfinite == "raise" or flag.device.type != "cuda":
            # A CPU tensor is read without any queue to drain; elsewhere "raise" is a documented sync.
            if bool(flag.reshape(())):
                if self.on_nonfinite == "raise":
                    raise RuntimeError(message)
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            return
        # "warn" on CUDA: copy the flag to pinned host memory without a sync; look at it next step.
        host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag.reshape(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, message))

    def _flush_warnings(self) -> None:
        """Warn for earlier skipped steps whose flag has reached the host (never waits)."""
        still = []
        for event, host, message in self._pending:
            if not event.query():
                still.append((event, host, message))
            elif bool(host[0] != 0):
                warnings.warn(message, RuntimeWarning, stacklevel=3)
        self._pending = still

