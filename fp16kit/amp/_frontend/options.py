"""Opt levels O0-O3, the override rules, and the text ``amp.initialize`` prints (docs/specs/apex-amp.md).

The printed text is apex's, character for character, because people grep logs for it::

    Selected optimization level O1:  Insert automatic casts around Pytorch functions and Tensor methods.
    <blank line>
    Defaults for this optimization level are:
    enabled                : True
    ...

Each option line is ``"{:22} : {}".format(name, value)``. O0-O2's one-line descriptions end in a
newline (so ``print`` leaves a blank line after them), O3's does not: apex's quirk, kept.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "FP32_MAX", "OPT_LEVELS", "Options", "as_real", "check_frontend_args", "initial_scale", "maybe_print",
    "option_lines", "select_opt_level",
]

# the largest loss scale the fp32 scale tensor can hold
FP32_MAX = float(torch.finfo(torch.float32).max)

# (one-line description as apex prints it, defaults in apex's option order)
OPT_LEVELS: dict[str, tuple[str, dict[str, Any]]] = {
    "O0": (
        "O0:  Pure FP32 training.\n",
        {"cast_model_type": torch.float32, "patch_torch_functions": False, "keep_batchnorm_fp32": None,
         "master_weights": False, "loss_scale": 1.0},
    ),
    "O1": (
        "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n",
        {"cast_model_type": None, "patch_torch_functions": True, "keep_batchnorm_fp32": None,
         "master_weights": None, "loss_scale": "dynamic"},
    ),
    "O2": (
        "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n",
        {"cast_model_type": torch.float16, "patch_torch_functions": False, "keep_batchnorm_fp32": True,
         "master_weights": True, "loss_scale": "dynamic"},
    ),
    "O3": (
        "O3:  Pure FP16 training.",
        {"cast_model_type": torch.float16, "patch_torch_functions": False, "keep_batchnorm_fp32": False,
         "master_weights": False, "loss_scale": 1.0},
    ),
}

_NAMES = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
          "master_weights", "loss_scale")


class Options:
    """The seven apex options, validated as they are set (apex's ``Properties``).

    Setting an option that contradicts the opt level raises ``RuntimeError`` naming the rule; a value of the
    wrong kind or out of range raises ``ValueError`` naming the option and what it accepts: ``loss_scale`` is
    ``"dynamic"`` or a number in ``(0, FP32_MAX]`` (the scale is an fp32 tensor), ``master_weights`` a bool or
    None, ``cast_model_type`` a floating ``torch.dtype``, None or False.
    """

    def __init__(self, opt_level: str) -> None:
        self.values: dict[str, Any] = {"enabled": True, "opt_level": opt_level}
        self.values.update(OPT_LEVELS[opt_level][1])

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def set(self, name: str, value: Any) -> None:
        """Apply one user override, enforcing apex's rules."""
        o1 = self.values["opt_level"] == "O1"
        if name == "cast_model_type":
            if value is not None and value is not False and not _is_float_dtype(value):
                raise ValueError(
                    f"cast_model_type must be a floating torch.dtype (torch.float16, torch.bfloat16, torch.float32), "
                    f"None or False, got {value!r}."
                )
            if o1 and value is not None and value is not False and value is not torch.float32:
                raise RuntimeError(
                    "O1 inserts casts around Torch functions rather than model weights, so with O1, the model "
                    "weights themselves should remain FP32. If you wish to cast the model to a different type, "
                    f"use opt_level='O2' or 'O3'. cast_model_type was {value}"
                )
        elif name == "patch_torch_functions":
            if not o1 and value:
                raise RuntimeError(
                    "Currently, patch_torch_functions=True should only be set by selecting opt_level='O1'."
                )
        elif name == "keep_batchnorm_fp32":
            if o1 and value is not None:
                raise RuntimeError(
                    "With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
                    f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {value}"
                )
            if isinstance(value, str):
                value = {"True": True, "False": False}.get(value, value)
            if not (value is True or value is False or value is None):
                raise RuntimeError(
                    "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or None, found "
                    f"keep_batchnorm_fp32={value}"
                )
        elif name == "master_weights":
            if not (value is True or value is False or value is None):
                raise ValueError(f"master_weights must be True, False or None, got master_weights={value!r}.")
            if o1 and value is not None:
                raise RuntimeError(
                    "It doesn't make sense to use master_weights with O1. With O1, your model weights "
                    "themselves should be FP32."
                )
        elif name == "loss_scale" and value != "dynamic":
            try:  # strings too, as apex: loss_scale="128.0"
                value = as_real(value) if isinstance(value, numbers.Real) else float(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"loss_scale must be 'dynamic' or a number (anything float() accepts), got {value!r}."
                ) from None
            if not 0.0 < value <= FP32_MAX:  # NaN fails too
                raise ValueError(
                    f"loss_scale={value!r} is out of range: a static loss_scale must be a number in "
                    f"(0, {FP32_MAX:.8g}] (positive, finite, and representable in fp32, where the scale lives), "
                    f"or 'dynamic'."
                )
        self.values[name] = value


def as_real(value: Any) -> float:
    """A real number (or a one-element tensor) as a float, for range checks that name the option.

    NaN for anything else (bools included: ``True`` is no loss scale), +-inf for integers too large for a
    float (``float(10**400)`` raises ``OverflowError``), so that one ``lo < x <= hi`` test rejects them all.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _is_float_dtype(value: Any) -> bool:
    return isinstance(value, torch.dtype) and value.is_floating_point


def _check_count(name: str, value: Any, minimum: int) -> None:
    number = as_real(value)
    if not (math.isfinite(number) and number == int(number) and number >= minimum):
        raise ValueError(f"amp.initialize: {name} must be a positive integer (>= {minimum}), got {name}={value!r}.")


def _check_bound(name: str, value: Any, none_means: str) -> None:
    if value is None:
        return
    if not 0.0 < as_real(value) <= FP32_MAX:
        raise ValueError(
            f"amp.initialize: {name}={value!r} is out of range: it must be a number in (0, {FP32_MAX:.8g}] "
            f"(positive, finite, representable in fp32), or None for {none_means}."
        )


def check_frontend_args(*, num_losses: Any, verbosity: Any, cast_model_outputs: Any, min_loss_scale: Any,
                        max_loss_scale: Any, scale_window: Any, hysteresis: Any) -> None:
    """Validate ``amp.initialize``'s arguments that are not among the seven apex options.

    Runs before ``initialize`` touches a model or optimizer, so a rejected call leaves both as they were.
    Every error names the argument and its valid range. ``max_loss_scale=inf`` means "no cap" (as None).
    """
    _check_count("num_losses", num_losses, 1)
    _check_count("scale_window", scale_window, 1)
    _check_count("hysteresis", hysteresis, 1)
    if isinstance(verbosity, bool) or not isinstance(verbosity, numbers.Integral):
        raise ValueError(f"amp.initialize: verbosity must be an integer (0 silent, 1 apex's text), got {verbosity!r}.")
    if cast_model_outputs is not None and not _is_float_dtype(cast_model_outputs):
        raise ValueError(
            f"amp.initialize: cast_model_outputs must be a floating torch.dtype or None, got {cast_model_outputs!r}."
        )
    _check_bound("min_loss_scale", min_loss_scale, "no floor")
    if not (isinstance(max_loss_scale, float) and max_loss_scale == math.inf):
        _check_bound("max_loss_scale", max_loss_scale, "no cap")
    if (min_loss_scale is not None and max_loss_scale is not None
            and as_real(min_loss_scale) > as_real(max_loss_scale)):
        raise ValueError(
            f"amp.initialize: min_loss_scale={min_loss_scale!r} is larger than max_loss_scale={max_loss_scale!r}; "
            f"the dynamic loss scale lives in [min_loss_scale, max_loss_scale]."
        )


def initial_scale(min_loss_scale: float | None, max_loss_scale: float | None) -> float:
    """The first dynamic loss scale: ``2**16`` (apex's) brought into ``[min_loss_scale, max_loss_scale]``."""
    scale = 2.0**16
    if max_loss_scale is not None:
        scale = min(scale, float(max_loss_scale))
    if min_loss_scale is not None:
        scale = max(scale, float(min_loss_scale))
    return scale


def select_opt_level(opt_level: Any) -> str:
    """The opt level name, or the error apex gives (with the letter-O-vs-digit-zero hint)."""
    if opt_level not in OPT_LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  Note that in "
            "`O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    return opt_level


def option_lines(options: Options, extra: dict[str, Any] | None = None) -> list[str]:
    """``"{:22} : {}"`` lines in apex's order (plus fp16kit extensions the user set, if any)."""
    items = [(name, options[name]) for name in _NAMES] + list((extra or {}).items())
    return [f"{name:22} : {value}" for name, value in items]


def _is_rank0() -> bool:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank() == 0
    return True


def maybe_print(verbosity: int, msg: str, *, rank0: bool = False, out: Callable[[str], None] = print) -> None:
    """Print ``msg`` when ``verbosity > 0`` (only on rank 0 of a multi-process job when ``rank0``)."""
    if verbosity > 0 and (not rank0 or _is_rank0()):
        out(msg)


def process_options(
    opt_level: str, overrides: dict[str, Any], verbosity: int, extra: dict[str, Any] | None = None
) -> Options:
    """Build the options for ``opt_level``, print the defaults, apply the non-None overrides, print the result."""
    options = Options(opt_level)
    say = lambda msg: maybe_print(verbosity, msg, rank0=True)
    say(f"Selected optimization level {OPT_LEVELS[opt_level][0]}")
    say("Defaults for this optimization level are:")
    for line in option_lines(options):
        say(line)
    say("Processing user overrides (additional kwargs that are not None)...")
    for name in _NAMES[2:]:
        if overrides.get(name) is not None:
            options.set(name, overrides[name])
    say("After processing overrides, optimization options are:")
    for line in option_lines(options, extra):
        say(line)
    return options
