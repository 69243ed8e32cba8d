"""apex.amp's frontend: ``initialize``, ``scale_loss``, ``master_params``, ``state_dict``, ``load_state_dict``.

A script written for apex runs unchanged once ``from apex import amp`` becomes ``from fp16kit import amp``
(docs/specs/apex-amp.md is the contract; docs/migrating-from-apex.md lists every call). The work is split over
``fp16kit.amp._frontend``: ``options`` (opt levels, override rules, printed text), ``casting`` (model
casting and forward hooks), ``masters`` (fp32 master weights, gradient plumbing, master checkpoints),
``stepping`` (``scale_loss``, the patched ``step``/``zero_grad``), ``state`` (sessions, amp state dict).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ._frontend import casting, masters, options, state, stepping
from .loss_scaler import LossScaler

__all__ = ["initialize", "load_state_dict", "master_params", "scale_loss", "state_dict"]

Models = nn.Module | list[nn.Module]
Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer] | None


def _as_list(value: Any, kind: type, what: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], False
    if isinstance(value, list) and all(isinstance(v, kind) for v in value):
        return list(value), True
    raise TypeError(f"{what} must be either a single {kind.__name__} or a list of them, got {type(value)}.")


def _mirror(models: list[nn.Module], models_was_list: bool, optimizers: list[torch.optim.Optimizer] | None,
            optimizers_was_list: bool) -> Any:
    model_out = models if models_was_list else models[0]
    if optimizers is None:
        return model_out
    return model_out, (optimizers if optimizers_was_list else optimizers[0])


def _device_of(models: list[nn.Module]) -> torch.device:
    for model in models:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def initialize(
    models: Models,
    optimizers: Optimizers = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    *,
    low_precision_dtype: torch.dtype | None = None,
    scale_window: int = 2000,
    hysteresis: int = 1,
) -> Any:
    """Prepare models and optimizers for mixed precision at ``opt_level`` ("O0"-"O3"); apex's signature.

    Returns the models and optimizers in the shape they came in: ``model, optimizer``, ``[m1, m2], opt``,
    ``model, [o1, o2]``, or just the model(s) when ``optimizers`` is None. Prints the chosen options at
    ``verbosity=1`` (rank 0 only), nothing at 0.

    What happens: O2/O3 (``cast_model_type``) cast the model, keep affine batchnorm fp32 with
    ``keep_batchnorm_fp32``, cast floating inputs of ``forward`` to the model type and outputs to fp32 (or
    ``cast_model_outputs``), and make ``model.state_dict()`` return fp32. O1 runs ``forward`` inside the cast
    policy (low-precision outputs come back as fp32, so a loss computed outside the model runs in fp32 as
    apex's patched loss functions did) and ``optimizer.step`` with casts disabled. ``master_weights``: fp32
    masters (started from the exact fp32 initial weights) that the optimizer updates and that are written into
    the model after each step: fp16kit's ``FusedAdam``/``FusedLAMB`` keep them in their own state and write the
    model copy in their update pass; other optimizers get them in their param groups (docs/migrating-from-apex.md,
    "O2 master weights"). ``num_losses`` dynamic (``loss_scale="dynamic"``: start at
    ``min(2**16, max_loss_scale)``, halve on overflow down to ``min_loss_scale``, double after ``scale_window``
    clean steps up to ``max_loss_scale``) or static loss scalers.

    fp16kit extensions (keyword-only): ``low_precision_dtype=torch.bfloat16`` uses bf16 instead of fp16 for
    O1-O3; ``scale_window`` (apex's hard-wired 2000) and ``hysteresis`` (overflows tolerated before backing
    off; 1 = apex) tune the dynamic scaler.

    Errors: unknown ``opt_level`` (with the letter-O hint), contradicting overrides, a model already wrapped
    in (Distributed)DataParallel or already initialized, fp16 parameters, the same optimizer twice, and any
    option out of its range (each error names the option and the values it accepts: ``loss_scale`` in
    ``(0, 3.4e38]`` or ``"dynamic"``, ``min_loss_scale``/``max_loss_scale`` likewise or None,
    ``scale_window``/``hysteresis``/``num_losses`` integers >= 1, ...). All of these are raised before a
    model or optimizer is changed. The first dynamic scale is ``2**16`` brought into
    ``[min_loss_scale, max_loss_scale]``.

    After ``initialize``: ``optimizer.add_param_group`` works as before (new low-precision params get fp32
    masters under master weights; every new param's grads are unscaled and checked by ``scale_loss``; a
    group the optimizer rejects leaves the optimizer and amp's state unchanged). See
    docs/migrating-from-apex.md, "Lifecycle and checkpoints".
    """
    if not enabled:
        state.set_current_session(state.Session(None, verbosity, [], torch.float16))
        return models if optimizers is None else (models, optimizers)
    level = options.select_opt_level(opt_level)
    if low_precision_dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(
            f"low_precision_dtype must be torch.float16 or torch.bfloat16 (or None for float16), got "
            f"{low_precision_dtype}."
        )
    low = low_precision_dtype or torch.float16
    options.check_frontend_args(
        num_losses=num_losses, verbosity=verbosity, cast_model_outputs=cast_model_outputs,
        min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale, scale_window=scale_window,
        hysteresis=hysteresis,
    )

    model_list, models_was_list = _as_list(models, nn.Module, "models")
    if optimizers is None:
        opt_list, optimizers_was_list = None, False
    else:
        opt_list, optimizers_was_list = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
        for i, opt in enumerate(opt_list):
            if hasattr(opt, "_amp_stash") or any(opt is o for o in opt_list[:i]):
                raise RuntimeError(
                    "A given optimizer should only be passed through amp.initialize once: this optimizer was "
                    "already processed. Build a new optimizer for new models (or keep the one amp returned)."
                )
    casting.check_models(model_list)

    overrides = {
        "cast_model_type": cast_model_type, "patch_torch_functions": patch_torch_functions,
        "keep_batchnorm_fp32": keep_batchnorm_fp32, "master_weights": master_weights, "loss_scale": loss_scale,
    }
    if low_precision_dtype is not None and cast_model_type is None and level in ("O2", "O3"):
        overrides["cast_model_type"] = low
    extra = {"low_precision_dtype": low} if low_precision_dtype is not None else None
    opts = options.process_options(level, overrides, verbosity, extra)

    # fp32 values before any cast: the masters start from them
    model_type = opts["cast_model_type"] or None
    fp32_values: dict[int, torch.Tensor] = {}
    if opts["master_weights"] and model_type is not None and model_type != torch.float32:
        for opt in opt_list or []:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.dtype == torch.float32:
                        fp32_values[id(p)] = p.detach().clone()

    for opt in opt_list or []:
        masters.check_optimizer_params(opt)
    # the loss scalers before the first change to a model: every error above or here leaves the models as they were
    device = _device_of(model_list)
    dynamic = opts["loss_scale"] == "dynamic"
    scalers = [
        LossScaler(
            init_scale=options.initial_scale(min_loss_scale, max_loss_scale) if dynamic else opts["loss_scale"],
            growth_interval=int(scale_window), hysteresis=int(hysteresis), min_scale=min_loss_scale,
            max_scale=max_loss_scale, dynamic=dynamic, device=device,
        )
        for _ in range(int(num_losses))
    ]

    policy_dtype = low if opts["patch_torch_functions"] else None
    for model in model_list:
        if model_type is not None:
            casting.cast_model(model, model_type, bool(opts["keep_batchnorm_fp32"]))
            out = cast_model_outputs or torch.float32
            casting.install_forward_hooks(model, input_dtype=model_type, output_dtype=out, output_only=None,
                                          policy_dtype=policy_dtype)
            if model_type != torch.float32:
                casting.install_fp32_state_dict(model, model_type)
        elif policy_dtype is not None:  # O1: low-precision outputs back to fp32 (or cast_model_outputs)
            casting.install_forward_hooks(model, input_dtype=None, output_dtype=cast_model_outputs or torch.float32,
                                          output_only=None if cast_model_outputs else casting.LOW_DTYPES,
                                          policy_dtype=policy_dtype)
        else:
            casting.install_forward_hooks(model, input_dtype=None, output_dtype=cast_model_outputs, output_only=None,
                                          policy_dtype=None)

    session = state.Session(opts, verbosity, scalers, low)
    for opt in opt_list or []:
        had_state = len(opt.state) > 0
        stash = masters.make_stash(opt, session, bool(opts["master_weights"]), fp32_values)
        if had_state and model_type is not None:  # recast pre-existing per-param state (apex's trick)
            opt.load_state_dict(opt.state_dict())
        stepping.install_step(opt, stash, disable_casts=bool(opts["patch_torch_functions"]))
        if stash.master_weights:
            masters.resync_on_model_load(model_list, stash)
    state.set_current_session(session)
    return _mirror(model_list, models_was_list, opt_list, optimizers_was_list)


def _unwrap(optimizer: Any) -> Any:
    """The optimizer ``amp.initialize`` processed, inside wrappers that expose it as ``.optimizer``.

    accelerate's ``AcceleratedOptimizer`` (which the HF Trainer hands out), and wrappers of wrappers, keep the
    real optimizer in ``.optimizer``; the wrapper itself has no amp stash. Stops at the first object that has
    one (or that exposes no ``.optimizer``), and after 32 levels (a wrapper that points to itself).
    """
    for _ in range(32):
        if getattr(optimizer, "_amp_stash", None) is not None:
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def _optimizer_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    """``scale_loss``'s ``optimizers`` argument (one, or a list/tuple, each possibly wrapped) as a list."""
    items = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    out = [_unwrap(o) for o in items]
    for o in out:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(
                f"amp.scale_loss: expected an optimizer (or a list of them) returned by amp.initialize, got "
                f"{type(o).__name__}; wrappers are followed through their .optimizer attribute."
            )
    return out


def _session_of(optimizers: list[torch.optim.Optimizer]) -> state.Session | None:
    sessions = []
    for opt in optimizers:
        stash = getattr(opt, "_amp_stash", None)
        if stash is None:
            current = state.current_session()
            if current is not None and not current.enabled:
                return current
            raise RuntimeError(
                "amp.scale_loss got an optimizer that was not passed through amp.initialize: "
                "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must come first."
            )
        if all(s is not stash.session for s in sessions):
            sessions.append(stash.session)
    if len(sessions) > 1:
        raise RuntimeError("amp.scale_loss: the optimizers come from different amp.initialize calls; "
                           "use one scale_loss per initialize call.")
    return sessions[0] if sessions else state.current_session()


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * S`` for the backward; on exit unscale the grads and check them (apex semantics).

    ``S`` is loss scaler ``loss_id``'s current scale (exact for the power-of-two scales dynamic scaling
    uses). On exit, unless ``delay_unscale``: every new gradient is multiplied by ``1/S`` in one fused pass
    (under master weights straight from the fp16 model grads into the fp32 master grads; grads that existed
    before the backward are kept and added) — or, where the optimizer keeps the masters itself, left scaled for
    it and only checked (docs/migrating-from-apex.md, "O2 master weights"); inf/NaN raises the overflow flag;
    the scaler updates (not with ``delay_overflow_check``); on overflow the next ``optimizer.step()`` is skipped and
    ``Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0`` is printed.
    ``delay_unscale=True`` leaves the grads scaled so that several backward passes accumulate; the next
    ``scale_loss`` without it unscales the sum. Static scale 1.0 without master weights (O0, O3): yields
    ``loss.float()`` and does nothing else. ``model`` is accepted for apex compatibility and unused.

    ``optimizers`` may be wrapped (accelerate's ``AcceleratedOptimizer``, as the HF Trainer hands out, or any
    wrapper that exposes the optimizer as ``.optimizer``, nested too): the wrapped optimizer is used.
    """
    opt_list = _optimizer_list(optimizers)
    session = _session_of(opt_list)
    if session is None:
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
            "before `with amp.scale_loss`."
        )
    if not session.enabled:
        yield loss
        return
    stashes = [opt._amp_stash for opt in opt_list]
    with stepping.run_scale_loss(session, loss, stashes, loss_id, delay_unscale, delay_overflow_check) as scaled:
        yield scaled


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The params ``optimizer`` updates: the fp32 masters under master weights (use them to clip grads).

    Between ``scale_loss`` and ``step`` their ``.grad`` holds the unscaled fp32 gradients, as in apex; where
    the optimizer keeps the masters itself (fp16kit's fused optimizers), asking for them here is what makes
    those fp32 master grads exist for this step (docs/migrating-from-apex.md, "O2 master weights").
    """
    stash = getattr(_unwrap(optimizer), "_amp_stash", None)
    if stash is None:
        for group in optimizer.param_groups:
            yield from group["params"]
        return
    yield from stash.master_params()


def _session_for(optimizer: Any) -> state.Session | None:
    """The session of the ``initialize`` call that processed ``optimizer`` (wrappers followed); None: the latest."""
    if optimizer is None:
        return None
    stash = getattr(_unwrap(optimizer), "_amp_stash", None)
    if stash is None:
        raise RuntimeError("amp.state_dict/load_state_dict(optimizer=...): this optimizer was not passed through "
                           "amp.initialize.")
    return stash.session


def state_dict(destination: OrderedDict | None = None, *, optimizer: Any = None) -> OrderedDict:
    """``OrderedDict({'loss_scaler0': {'loss_scale': float, 'unskipped': int, 'fp16kit': {...}}, ...})``.

    apex's two keys per loss scaler plus fp16kit's full scaler state (growth and hysteresis trackers,
    options, skipped-step count) under ``"fp16kit"``, for a bit-identical resume. A host sync. The latest
    ``initialize``'s state, or (fp16kit extension, keyword-only) that of the call which processed ``optimizer``.
    """
    stepping.REPORTS.poll(block=True)
    return state.save_amp_state(destination, session=_session_for(optimizer))


def load_state_dict(state_dict: dict[str, Any], *, optimizer: Any = None) -> None:
    """Restore ``amp.state_dict()`` (apex's or fp16kit's) into the loss scalers of the latest ``initialize`` (or,
    keyword-only, of the call which processed ``optimizer``).

    A count mismatch prints a warning and loads what fits; a key without ``loss_scaler`` raises
    ``RuntimeError`` naming it.
    """
    state.load_amp_state(state_dict, session=_session_for(optimizer))
