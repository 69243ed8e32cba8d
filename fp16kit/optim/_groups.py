"""Param groups and their step counters: adding a group (validated before anything changes), the host
hyper-parameters checked at every step, and each group's own one-element fp32 counter on the params' device
(docs/optim.md, "Step counters").
"""

from __future__ import annotations

from typing import Any

import torch

from ._validate import check_param_tensor, check_step_value, naming_group

__all__ = ["GroupsMixin"]


def _check_seed(fn: str, index: int, seed: Any) -> None:
    """A stochastic-rounding seed: an int in [0, 2**63) (the 64-bit Philox key)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(
            f"{fn}: param_groups[{index}]['rounding_seed'] must be an int in [0, 2**63) (the stochastic-rounding "
            f"key), got {seed!r}."
        )


class GroupsMixin:
    """``FusedOptimizer``'s param groups and counters (the subclass's ``_check_group`` validates a group)."""

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
        if "_step_cache" in self.__dict__:  # (torch's __init__ adds the first groups before the cache exists)
            self._forget_steady_step()

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
