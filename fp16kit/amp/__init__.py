"""fp16kit.amp: mixed precision, apex-style and torch-style, on one engine.

apex style::

    from fp16kit import amp
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

torch style::

    scaler = amp.GradScaler()
    with amp.autocast(dtype=torch.float16):
        loss = model(x)
    scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()

Names resolve lazily to the module that defines them (one job per module), so importing
``fp16kit.amp`` is cheap and each part can be used alone.

May import: ``fp16kit.kernels`` (its public names), ``fp16kit.optim``, ``fp16kit.amp_C``, ``fp16kit.distributed``,
``fp16kit.numerics``, ``fp16kit._versions``, ``fp16kit._lazy``; never the demo, the doctor or the integrations.
"""

from __future__ import annotations

import importlib
from typing import Any

from .._lazy import lazy_exports

# public name -> defining module (relative to this package)
_EXPORTS = {
    # cast policy table and registration (docs/specs/cast-policy.md)
    "Rule": ".policy",
    "register_half_function": ".functions",
    "register_float_function": ".functions",
    "register_promote_function": ".functions",
    "policy_override": ".policy",
    "policy_table": ".policy",
    "print_policy": ".policy",
    # autocast (torch style) and cast control
    "autocast": ".autocast_mode",
    "disable_casts": ".autocast_mode",
    "is_autocast_enabled": ".autocast_mode",
    # decorators for user functions and custom autograd functions
    "half_function": ".functions",
    "float_function": ".functions",
    "promote_function": ".functions",
    "custom_fwd": ".functions",
    "custom_bwd": ".functions",
    # loss scaling
    "LossScaler": ".loss_scaler",
    "GradScaler": ".grad_scaler",
    # apex-style frontend (docs/specs/apex-amp.md)
    "initialize": ".frontend",
    "scale_loss": ".frontend",
    "master_params": ".frontend",
    "state_dict": ".frontend",
    "load_state_dict": ".frontend",
    # apex internals as compatibility views (docs/migrating-from-apex.md)
    "_amp_state": "._apex_state",
}

__all__ = sorted(name for name in _EXPORTS if not name.startswith("_"))

#: submodules reachable as attributes without importing them first (``fp16kit.amp.autocast_mode.set_engine("mode")``,
#: as docs/autocast.md writes it)
_SUBMODULES = frozenset({"autocast_mode", "functions", "grad_scaler", "loss_scaler", "policy"})

_exported, _dir = lazy_exports(__name__, globals(), _EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    return _exported(name)


def __dir__() -> list[str]:
    return sorted(set(_dir()) | _SUBMODULES)
