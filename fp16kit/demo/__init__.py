"""``python -m fp16kit demo``: train real small models in every precision mode; print a table, draw a picture.

Two tasks (``--task``):

* ``lm`` (the default, ``fp16kit/demo/lm_cli.py``): a small byte-level transformer language model trained on the
  Python standard library's own source files once per precision mode (fp32, torch autocast + GradScaler, fp16kit
  autocast + GradScaler + FusedLAMB, apex-style O2 + FusedLAMB, bf16 with fp32 / split / no masters, each with
  fp32 or 8-bit moments). Needs matplotlib.
* ``digits`` (``fp16kit/demo/digits_cli.py``): an MLP with batchnorm on scikit-learn's handwritten digits at
  apex opt levels O0-O3 and O2 in bf16. Needs scikit-learn and matplotlib.

Both come with the ``demo`` extra: ``pip install "fp16kit[demo]"``.

May import: ``fp16kit.amp``, ``fp16kit.optim``, ``fp16kit.doctor``, ``fp16kit.kernels``, ``fp16kit.numerics`` (an
application of the library: nothing of the library imports the demo, except the command lines).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["main"]

TASKS = ("lm", "digits")


def _device(name: str) -> torch.device:
    """``auto`` (cuda if available, else cpu) or a device name; exits with a message when CUDA is asked for and
    absent."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m fp16kit demo: --device cuda requested but no CUDA device is available.")
    return device


def extras_missing(command: str, modules: Sequence[str] = ("matplotlib", "sklearn")) -> bool:
    """True (after saying what to install) when a module of the ``demo`` extra is missing; ``command`` names the
    caller."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"python -m fp16kit {command} needs the 'demo' extra ({exc.name} is missing): "
                  'pip install "fp16kit[demo]"', file=sys.stderr)
            return True
    return False


def _task(argv: list[str]) -> tuple[str, list[str]]:
    """Take ``--task NAME`` / ``--task=NAME`` out of ``argv`` (anywhere in it); the rest goes to the task."""
    rest, task, i = [], "lm", 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--task" and i + 1 < len(argv):
            task, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--task="):
            task = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return task, rest


def main(argv: list[str] | None = None) -> int:
    """Run the demo of ``--task`` (default ``lm``); returns the process exit code (0 on success, 2 on bad
    arguments or missing extras)."""
    task, rest = _task(list(sys.argv[1:] if argv is None else argv))
    if task == "digits":
        from .digits_cli import main as digits_main

        return digits_main(rest)
    if task == "lm":
        from .lm_cli import main as lm_main

        return lm_main(rest)
    print(f"python -m fp16kit demo: unknown --task {task!r}; choose from {', '.join(TASKS)}.", file=sys.stderr)
    return 2
