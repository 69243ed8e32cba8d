"""``LARC``: apex's layer-wise adaptive rate clipping/scaling wrapper, around ANY optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fp16kit.kernels import common_device, l2norm

from ._apex_common import check_range
from ._sharding import refuse_dtensors

_SHARDED_WHY = "its local learning rate is the ratio of each whole param's norm to its whole gradient's"

__all__ = ["LARC"]


def _delegated(name: str) -> property:
    """A read-only attribute that is the wrapped optimizer's."""
    return property(lambda self: getattr(self.optim, name), doc=f"The wrapped optimizer's ``{name}``.")


class LARC(torch.optim.Optimizer):
    """LARC (You et al. 2017, https://arxiv.org/abs/1708.03888) as apex's ``apex.parallel.LARC``: rescales each
    param's gradient by a per-layer adaptive learning rate, then calls the wrapped optimizer's ``step``.

    Per param ``p`` with a gradient, in its group (``wd`` = the group's weight_decay, ``lr`` its lr)::

        if |p| != 0 and |g| != 0:
            a = trust_coefficient * |p| / (|g| + |p| * wd + eps)
            if clip: a = min(a / lr, 1)            # the effective lr becomes min(a_unclipped, lr)
            g = (g + wd * p) * a
        # else: g unchanged, and no weight decay for this param in this step (apex)
        optimizer.step() with every group's weight_decay temporarily 0 (LARC applied it)

    ``|p|`` and ``|g|`` are per-tensor L2 norms from one multi-tensor pass each (``fp16kit.kernels.l2norm``);
    the factors are computed on the device and applied with ``torch._foreach`` ops: no host sync per param
    (apex reads both norms on the host for every param). Improvement over apex: when a norm is inf or NaN the
    gradient is left as it was (apex turns it into NaN or 0), so the wrapped optimizer sees the original
    inf/NaN and skips or reports the step (fp16kit's optimizers, a GradScaler) instead of writing NaN.

    ``LARC`` is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state``, ``defaults``, ``state_dict``,
    ``load_state_dict`` (and its hooks), ``zero_grad`` and ``add_param_group`` are the wrapped optimizer's (as
    apex's), so
    ``GradScaler.step(larc)`` (which unscales the grads first), LR schedulers and amp accept it.

    Args:
        optimizer: the optimizer to wrap (any ``torch.optim.Optimizer``; its groups need an ``lr`` entry).
        trust_coefficient: the trust coefficient (apex default 0.02), finite and >= 0.
        clip: True: clipping mode, lr = min(lr, local lr); False: scaling mode, lr = local lr * lr.
        eps: added to the denominator, finite and >= 0.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8
    ) -> None:
        # No torch.optim.Optimizer.__init__: every piece of optimizer state is the wrapped optimizer's.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        for group in optimizer.param_groups:
            refuse_dtensors("LARC", group, _SHARDED_WHY)
        self.optim = optimizer
        self.trust_coefficient = check_range("LARC", "trust_coefficient", trust_coefficient)
        self.eps = check_range("LARC", "eps", eps)
        self.clip = bool(clip)
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    # -- the wrapped optimizer's state, as apex's LARC exposes it ---------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return self.optim.__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optim.__setstate__(state)

    def __repr__(self) -> str:
        return f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, eps={self.eps}, {self.optim!r})"

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    # Checkpoint hooks (e.g. amp's master weights) are the wrapped optimizer's: its state_dict runs them.
    _optimizer_state_dict_pre_hooks = _delegated("_optimizer_state_dict_pre_hooks")
    _optimizer_state_dict_post_hooks = _delegated("_optimizer_state_dict_post_hooks")
    _optimizer_load_state_dict_pre_hooks = _delegated("_optimizer_load_state_dict_pre_hooks")
    _optimizer_load_state_dict_post_hooks = _delegated("_optimizer_load_state_dict_post_hooks")

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if set_to_none is None:
            self.optim.zero_grad()
        else:
            self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        refuse_dtensors("LARC", param_group, _SHARDED_WHY)
        self.optim.add_param_group(param_group)

    # -- step ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def apply_adaptive_lr_(self) -> list[float]:
        """Rewrite the grads as the class docstring says and set every group's weight_decay to 0 (``step``
        restores them after the wrapped optimizer's step); returns the weight decays it found."""
        weight_decays = []
        for group in self.optim.param_groups:
            wd = group.get("weight_decay", 0)
            weight_decays.append(wd)
            group["weight_decay"] = 0
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            device = common_device("LARC.step", params, grads)
            lr = group["lr"]
            _, pn = l2norm([p.detach() for p in params], per_tensor=True)
            _, gn = l2norm(grads, per_tensor=True)
            pn, gn = pn.to(torch.float64), gn.to(torch.float64)
            wd64 = float(wd)
            a = self.trust_coefficient * pn / (gn + pn * wd64 + self.eps)
            if self.clip:
                lr64 = lr.to(device, torch.float64) if isinstance(lr, torch.Tensor) else float(lr)
                a = torch.clamp(a / lr64, max=1.0)
            apply = (pn != 0) & (gn != 0) & torch.isfinite(pn) & torch.isfinite(gn) & torch.isfinite(a)
            factor = torch.where(apply, a, 1.0).float()
            decay = torch.where(apply, a * wd64, 0.0).float()
            # g = (g + wd p) a = g a + (wd a) p: two foreach passes, no per-param host read
            torch._foreach_mul_(grads, list(factor.unbind()))
            if wd64 != 0:
                torch._foreach_add_(grads, torch._foreach_mul([p.detach() for p in params], list(decay.unbind())))
        return weight_decays

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Rescale the grads (see the class docstring), run the wrapped optimizer's step (with ``closure``,
        if given, evaluated first as apex's wrapped optimizers would), and restore each group's weight_decay."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved = [(group, group.get("weight_decay")) for group in self.optim.param_groups]
        try:
            self.apply_adaptive_lr_()
            self.optim.step()
        finally:  # also after an error: the groups get their own weight decay back
            for group, wd in saved:
                if wd is None:
                    group.pop("weight_decay", None)
                else:
                    group["weight_decay"] = wd
        return loss
