"""Opt levels O0-O3, the override rules, and the text ``amp.initialize`` prints (apex-amp.md).

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

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["OPT_LEVELS", "Options", "maybe_print", "option_lines", "select_opt_level"]

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

    Setting an option that contradicts the opt level raises ``RuntimeError`` naming the rule; a
    ``loss_scale`` that is neither ``"dynamic"`` nor a number raises ``ValueError``.
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
            if o1 and value is not None:
                raise RuntimeError(
                    "It doesn't make sense to use master_weights with O1. With O1, your model weights "
                    "themselves should be FP32."
                )
        elif name == "loss_scale" and value != "dynamic":
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"loss_scale must be 'dynamic' or a number (anything float() accepts), got {value!r}."
                ) from None
            if not value > 0.0 or value == float("inf"):
                raise ValueError(f"loss_scale must be a positive finite number or 'dynamic', got {value!r}.")
        self.values[name] = value


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
