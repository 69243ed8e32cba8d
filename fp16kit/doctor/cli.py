"""``python -m fp16kit doctor``: watch a model train and write the doctor's table, JSON and picture.

Without ``--model`` the model and data are the demo's (``fp16kit/demo``: an MLP with batchnorm on
scikit-learn's digits, trained with apex-style amp at one opt level; needs the ``demo`` extra). With
``--model MODULE:FACTORY`` they are yours: ``FACTORY()`` (``MODULE`` an importable module or a ``.py`` file)
returns one of

- ``(model, batches)`` or ``(model, batches, loss_fn)``, or a dict with keys ``model``, ``batches`` and
  optionally ``loss_fn`` and ``optimizer``. A batch that is a dict is passed as ``model(**batch)``, a tuple
  or list as ``model(*batch)``, anything else as ``model(batch)``; the loss is ``loss_fn(model, batch)`` if
  given, else the output itself (a scalar tensor), its ``.loss`` or its ``["loss"]``. ``batches`` is iterated
  again when it runs out, if it can be (a list, a DataLoader), else training stops there. The optimizer
  defaults to ``torch.optim.AdamW(lr=--lr)``. The run is fp32 unless ``--autocast`` asks for fp16kit's
  autocast, with ``--scaler dynamic`` an ``fp16kit.amp.GradScaler``.
- a finished watch: a ``doctor.Watcher`` or ``doctor.Report``.

``--model FILE.json`` reads a saved report (``doctor.json``, ``report.to_dict()``) and judges it again.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_factory", "main"]

_PROG = "python -m fp16kit doctor"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG,
        description=(
            "Train a model while fp16kit.doctor samples its gradients (the demo MLP, or yours with --model); "
            "write the report as a table (doctor.txt, also printed), JSON (doctor.json) and a PNG (doctor.png): "
            "where the gradients lie against fp16's and bf16's ranges, the loss scale that fits them, the layers "
            "to keep fp32 and the line of code that does it."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, metavar="MODULE:FACTORY | FILE.json",
                   help="your model: a function returning (model, batches[, loss_fn]) or a finished watch, "
                        "e.g. mymodels:tiny or path/to/file.py:make; or a saved doctor.json (see the module "
                        "docstring of fp16kit/doctor/cli.py)")
    p.add_argument("--out", type=Path, default=Path("fp16kit-doctor"),
                   help="directory for doctor.txt, doctor.json, doctor.png (and doctor-unscaled.png)")
    p.add_argument("--opt-level", choices=("O0", "O1", "O2", "O3"), default="O0",
                   help="demo only: amp opt level of the watched run (O0: fp32 gradients, the ones a cast would "
                        "change)")
    p.add_argument("--autocast", choices=("none", "float16", "bfloat16"), default="none",
                   help="--model only: run the forward under fp16kit.amp.autocast in this dtype")
    p.add_argument("--scaler", choices=("none", "dynamic"), default="none",
                   help="--model only: scale the loss with fp16kit.amp.GradScaler (watched by the doctor)")
    p.add_argument("--lr", type=float, default=1e-3, help="--model only: AdamW's learning rate")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="format the report leads with")
    p.add_argument("--loss-scale", type=float, default=None,
                   help="power of two to judge the gradients at (default: the run's loss scale; for an fp32 "
                        "run, O0 or a run without a scaler, the recommended one)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 400 demo, 100 --model)")
    p.add_argument("--every", type=int, default=10, help="sample every N-th step")
    p.add_argument("--no-activations", action="store_true", help="parameter gradients only")
    p.add_argument("--quick", action="store_true", help="demo: 60 steps and a narrower model (a smoke test)")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available, else cpu), 'cpu', 'cuda'")
    p.add_argument("--seed", type=int, default=0, help="seed for the model and the batch order")
    return p


def load_factory(spec: str) -> Any:
    """``MODULE:FACTORY`` -> the callable; ``MODULE`` is a dotted module name or a path to a ``.py`` file."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r}: expected MODULE:FACTORY (e.g. mymodels:tiny) or a .json file.")
    if module_name.endswith(".py") or "/" in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"--model {spec!r}: no file {path}.")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        sys.modules[path.stem] = module
        loaded.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {module.__name__} has no callable {attr!r}.")
    return factory


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(v, device) for v in batch)
    return batch


def _loss_of(model: torch.nn.Module, batch: Any, loss_fn: Any) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(model, batch)
    out = model(**batch) if isinstance(batch, Mapping) else model(*batch) if isinstance(batch, (list, tuple)) \
        else model(batch)
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.reshape(())
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"{_PROG} --model: the model's output ({type(out).__name__}) is not a scalar loss and has no "
                         f".loss or ['loss']; return (model, batches, loss_fn) with loss_fn(model, batch) -> loss.")
    return loss


def _steps(batches: Iterable[Any], steps: int) -> Iterable[Any]:
    reiterable = iter(batches) is not batches
    source = itertools.chain.from_iterable(itertools.repeat(batches)) if reiterable else batches
    return itertools.islice(source, steps)


def _watch_own(made: Any, args: argparse.Namespace, device: torch.device) -> tuple[Any, str]:
    """Train the factory's model while the doctor watches; returns (report, description)."""
    from .. import amp, doctor

    if isinstance(made, doctor.Report):
        return made, "a finished watch (Report)"
    if isinstance(made, doctor.Watcher):
        return made.report(), "a finished watch (Watcher)"
    optimizer = loss_fn = None
    if isinstance(made, Mapping):
        model, batches = made["model"], made["batches"]
        loss_fn, optimizer = made.get("loss_fn"), made.get("optimizer")
    elif isinstance(made, (tuple, list)) and len(made) in (2, 3):
        model, batches, loss_fn = (*made, None)[:3]
    else:
        raise ValueError(f"{_PROG} --model: the factory returned {type(made).__name__}; expected (model, batches), "
                         f"(model, batches, loss_fn), a dict, a doctor.Watcher or a doctor.Report.")
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"{_PROG} --model: the factory's model is a {type(model).__name__}, not a torch.nn.Module.")
    model = model.to(device).train()
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    low = None if args.autocast == "none" else getattr(torch, args.autocast)
    scaler = amp.GradScaler(device.type) if args.scaler == "dynamic" else None
    steps = 100 if args.steps is None else args.steps
    done = 0
    with doctor.watch(model, every=args.every, activations=not args.no_activations, scaler=scaler) as w:
        for batch in _steps(batches, steps):
            batch = _to(batch, device)
            optimizer.zero_grad()
            if low is None:
                loss = _loss_of(model, batch, loss_fn)
            else:
                with amp.autocast(dtype=low):
                    loss = _loss_of(model, batch, loss_fn)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            done += 1
    if not done:
        raise ValueError(f"{_PROG} --model: the factory's batches were empty.")
    precision = "fp32" if low is None else f"autocast {args.autocast}"
    scaled = "" if scaler is None else ", GradScaler"
    params = sum(p.numel() for p in model.parameters())
    return w.report(), f"{type(model).__name__} ({params:,} parameters), {precision}{scaled}, {done} steps, {device}"


def main(argv: list[str] | None = None) -> int:
    """Run it; returns the exit code (2 on bad arguments, a model that cannot be loaded, or missing extras)."""
    from .. import doctor
    from ..demo import _device

    args = _parser().parse_args(argv)
    if min(args.steps or 1, args.every) < 1:
        print(f"{_PROG}: --steps and --every must be >= 1.", file=sys.stderr)
        return 2
    try:
        if args.loss_scale is not None:
            doctor.scale_exponent(args.loss_scale)
    except ValueError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 2
    device = _device(args.device)
    dtype = torch.float16 if args.dtype == "float16" else torch.bfloat16
    if args.model is None:
        from ..demo import extras_missing

        if extras_missing("doctor"):
            return 2
        report, title, fp32_run = _watch_demo(args, device)
    else:
        try:
            if args.model.endswith(".json"):
                report = doctor.Report.from_dict(json.loads(Path(args.model).read_text()))
                title = f"fp16kit doctor on a saved report ({args.model})"
            else:
                torch.manual_seed(args.seed)
                report, what = _watch_own(load_factory(args.model)(), args, device)
                title = f"fp16kit doctor on {args.model}: {what}"
        except (ValueError, OSError, ImportError, KeyError, TypeError) as exc:
            print(f"{_PROG}: {exc}", file=sys.stderr)
            return 2
        fp32_run = False
    # judged at: the given scale; for an fp32 run (O0) the recommended one; else the run's
    scale: float | str | None = args.loss_scale if args.loss_scale is not None else "recommended" if fp32_run else None
    report = report.rescored(dtype=dtype, loss_scale=scale, reason=f"an fp32 run (amp {args.opt_level})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = f"{title}\n\n{report}"
    written = [out / "doctor.txt", out / "doctor.json"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{_PROG}: matplotlib is missing, no picture (pip install matplotlib)", file=sys.stderr)
    else:
        written.append(report.save_png(out / "doctor.png"))
        if report.scale_exp != 0:  # the same gradients without a loss scale: what fp16 without scaling would do
            written.append(report.rescored(loss_scale=1.0).save_png(out / "doctor-unscaled.png"))
    print(text)
    (out / "doctor.txt").write_text(text + "\n")
    (out / "doctor.json").write_text(report.to_json(indent=1) + "\n")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def _watch_demo(args: argparse.Namespace, device: torch.device) -> tuple[Any, str, bool]:
    from ..demo.data import load_digits_split
    from ..demo.train import RunConfig, train_one

    steps, hidden = (60, 64) if args.quick else (args.steps or 400, 128)
    data = load_digits_split(seed=0).to(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the demo's setting: this small model is fastest on one thread
    try:
        run = train_one(RunConfig(args.opt_level, args.opt_level), data, steps=steps, batch_size=64, hidden=hidden,
                        lr=0.05, optimizer="sgd", device=device, scale_window=100, seed=args.seed, progress=False,
                        doctor_every=args.every, doctor_activations=not args.no_activations)
    finally:
        torch.set_num_threads(threads)
    title = (f"fp16kit doctor on the demo MLP(64-{hidden}-{hidden}-10, batchnorm), amp {args.opt_level}, {steps} "
             f"steps, {device}; test accuracy {100 * run.accuracy:.1f}%")
    return run.doctor, title, args.opt_level == "O0"
