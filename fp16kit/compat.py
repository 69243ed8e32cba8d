"""Run unmodified apex scripts on fp16kit: import aliases for ``apex``, ``amp_C`` and ``apex_C``.

``install_apex()`` makes these imports resolve to fp16kit (compatibility shims; the public fp16kit names
are on the right, docs/migrating-from-apex.md lists every apex name)::

    apex.amp                     -> fp16kit.amp            (apex.amp._amp_state -> fp16kit.amp._apex_state)
    apex.optimizers.<Name>       -> fp16kit.optim.<Name>   (FusedAdam, FusedLAMB, FusedSGD, FusedNovoGrad,
                                                            FusedAdagrad, FusedMixedPrecisionLamb; resolved lazily)
    apex.parallel                -> fp16kit.parallel       (apex.parallel.LARC.LARC -> fp16kit.optim.LARC)
    apex.parallel.distributed    -> DistributedDataParallel and flat_dist_call (below)
    apex.multi_tensor_apply      -> fp16kit.multi_tensor_apply
    apex.fp16_utils              -> fp16kit.fp16_utils     (to_python_float, network_to_half, FP16_Optimizer, ...)
    amp_C                        -> fp16kit.amp_C
    apex_C.flatten / unflatten   -> torch._utils._flatten_dense_tensors / _unflatten_dense_tensors

so ``try: from apex import amp`` / ``except ImportError: amp = None`` takes the apex path. It refuses when a
real apex (or amp_C / apex_C) is importable, unless ``force=True``: two implementations behind one name would
be a silent source of wrong results. ``python -m fp16kit run SCRIPT [ARGS...]`` runs a script with the
aliases installed (``run_script``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
import types
from typing import Any

__all__ = ["APEX_OPTIMIZERS", "flat_dist_call", "install_apex", "installed", "run_script", "uninstall_apex"]

#: apex.optimizers names, resolved through fp16kit.optim when first used
APEX_OPTIMIZERS = ("FusedAdam", "FusedLAMB", "FusedSGD", "FusedNovoGrad", "FusedAdagrad", "FusedMixedPrecisionLamb")

_MARK = "__fp16kit_alias__"
_TOP_LEVEL = ("apex", "amp_C", "apex_C")


def installed() -> bool:
    """Whether the aliases are in place (``sys.modules["apex"]`` is fp16kit's)."""
    return bool(getattr(sys.modules.get("apex"), _MARK, False))


def _real_module(name: str) -> str | None:
    """Where a real (non-alias) module ``name`` would be imported from, or None."""
    mod = sys.modules.get(name)
    if mod is not None:
        return None if getattr(mod, _MARK, False) else str(getattr(mod, "__file__", name))
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None else str(spec.origin or name)


def _module(name: str, doc: str, attrs: dict[str, Any] | None = None, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name, doc)
    setattr(mod, _MARK, True)
    if package:
        mod.__path__ = []  # a package: `import apex.amp` finds the submodule in sys.modules
    for key, value in (attrs or {}).items():
        setattr(mod, key, value)
    return mod


def _apex_flavour(cls: type) -> type:
    """``cls`` as apex's optimizer behaves: after a GradScaler step ``p.grad`` holds the unscaled gradients
    (``unscale_grads``; apex's tests and scripts read them, e.g. for logging or clipping checks)."""
    return type(cls.__name__, (cls,), {"unscale_grads": True, "__module__": "apex.optimizers", "__doc__": cls.__doc__})


def _lazy_from(module: types.ModuleType, target: str, names: tuple[str, ...]) -> None:
    """``module.<name>`` for ``name`` in ``names`` resolves to ``<target>.<name>`` on first use."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r} (fp16kit alias of {target})")
        try:
            value = getattr(importlib.import_module(target), name)
        except AttributeError:
            raise AttributeError(
                f"{module.__name__}.{name} maps to {target}.{name}, which this fp16kit does not provide; "
                f"docs/migrating-from-apex.md lists what to use instead."
            ) from None
        if isinstance(value, type) and hasattr(value, "unscale_grads"):
            value = _apex_flavour(value)
        setattr(module, name, value)
        return value

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__all__ = list(names)


def flat_dist_call(tensors: list[Any], call: Any, extra_args: tuple | list | None = None) -> None:
    """apex's ``apex.parallel.distributed.flat_dist_call``: for each dtype/device bucket of ``tensors`` (in first-seen
    order), flatten, ``call(flat, *extra_args)`` (e.g. ``torch.distributed.broadcast, (0,)``), divide by the world
    size when ``call`` is ``torch.distributed.all_reduce``, and copy the result back into the tensors."""
    import torch._utils as tu
    import torch.distributed as dist

    buckets: dict[tuple[Any, Any], list[Any]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for bucket in buckets.values():
        flat = tu._flatten_dense_tensors(bucket)
        call(flat, *(extra_args or ()))
        if call is dist.all_reduce:
            flat /= dist.get_world_size()
        for buf, synced in zip(bucket, tu._unflatten_dense_tensors(flat, bucket)):
            buf.copy_(synced)


def _aliases() -> dict[str, types.ModuleType]:
    import torch._utils as tu

    import fp16kit.amp
    import fp16kit.amp._apex_state
    import fp16kit.amp_C
    import fp16kit.fp16_utils
    import fp16kit.multi_tensor_apply
    import fp16kit.parallel

    optimizers = _module("apex.optimizers", "apex.optimizers alias: fp16kit.optim (fp16kit.compat).")
    _lazy_from(optimizers, "fp16kit.optim", APEX_OPTIMIZERS)
    larc = _module("apex.parallel.LARC", "apex.parallel.LARC alias: fp16kit.optim.LARC (fp16kit.compat).")
    _lazy_from(larc, "fp16kit.optim", ("LARC",))
    distributed = _module("apex.parallel.distributed", "apex.parallel.distributed alias (fp16kit.compat).",
                          {"flat_dist_call": flat_dist_call})
    _lazy_from(distributed, "fp16kit.parallel", ("DistributedDataParallel",))
    distributed.__all__ = ["DistributedDataParallel", "flat_dist_call"]
    apex_c = _module("apex_C", "apex_C alias: torch's dense-tensor flatten/unflatten (fp16kit.compat).",
                     {"flatten": tu._flatten_dense_tensors, "unflatten": tu._unflatten_dense_tensors})
    mods = {
        "apex.amp": fp16kit.amp,
        "apex.amp._amp_state": fp16kit.amp._apex_state,
        "apex.optimizers": optimizers,
        "apex.parallel": fp16kit.parallel,
        "apex.parallel.LARC": larc,
        "apex.parallel.distributed": distributed,
        "apex.multi_tensor_apply": fp16kit.multi_tensor_apply,
        "apex.fp16_utils": fp16kit.fp16_utils,
        "amp_C": fp16kit.amp_C,
        "apex_C": apex_c,
    }
    apex = _module("apex", "apex alias: fp16kit (fp16kit.compat.install_apex).", package=True)
    for name in ("amp", "optimizers", "parallel", "multi_tensor_apply", "fp16_utils"):
        setattr(apex, name, mods[f"apex.{name}"])
    mods["apex"] = apex
    return mods


_installed_names: list[str] = []
_previous: dict[str, Any] = {}


def install_apex(force: bool = False) -> None:
    """Install the import aliases listed in the module docstring (idempotent).

    Raises:
        RuntimeError: a real ``apex``, ``amp_C`` or ``apex_C`` is importable and ``force`` is False. The
            message names where it was found; uninstall it, or pass ``force=True`` to shadow it in this process.
    """
    if installed():
        return
    if not force:
        found = {name: where for name in _TOP_LEVEL if (where := _real_module(name)) is not None}
        if found:
            listing = ", ".join(f"{name} ({where})" for name, where in found.items())
            raise RuntimeError(
                f"fp16kit.compat.install_apex: a real apex is importable: {listing}. Aliasing it to fp16kit would "
                "hide which implementation runs. Uninstall apex (pip uninstall apex), or call "
                "install_apex(force=True) / `python -m fp16kit run --force SCRIPT` to shadow it in this process."
            )
    mods = _aliases()
    for name, mod in mods.items():
        if name in sys.modules:
            _previous[name] = sys.modules[name]
        sys.modules[name] = mod
        _installed_names.append(name)


def uninstall_apex() -> None:
    """Remove the aliases (and put back modules they shadowed under ``force=True``)."""
    for name in _installed_names:
        sys.modules.pop(name, None)
    for name, mod in _previous.items():
        sys.modules[name] = mod
    _installed_names.clear()
    _previous.clear()


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_script(path: str, args: list[str] | tuple[str, ...] = (), force: bool = False) -> int:
    """Run the Python file ``path`` as ``__main__`` with ``sys.argv = [path, *args]`` and the apex aliases
    installed; return its exit code (``sys.exit(n)`` -> n, normal end -> 0). Exceptions propagate.

    The script's directory is put first on ``sys.path`` as ``python SCRIPT`` does. Processes the script
    starts with ``multiprocessing``'s spawn do not inherit the aliases: launch one ``python -m fp16kit run``
    per rank instead (``torchrun`` / ``torch.distributed.launch`` style, docs/migrating-from-apex.md).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"python -m fp16kit run: no such script: {path}")
    install_apex(force=force)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        return _exit_code(exc.code)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def main(argv: list[str]) -> int:
    """``python -m fp16kit run [--force] SCRIPT [ARGS...]``."""
    force = bool(argv[:1] == ["--force"])
    rest = argv[1:] if force else argv
    if not rest or rest[0] in ("-h", "--help"):
        print("usage: python -m fp16kit run [--force] SCRIPT [ARGS...]\n\nRun an unmodified apex script on fp16kit "
              "(apex, amp_C and apex_C imports resolve to fp16kit; --force shadows a real apex).")
        return 0 if rest else 2
    return run_script(rest[0], rest[1:], force=force)
