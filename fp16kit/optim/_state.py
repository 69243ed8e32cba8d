"""Per-param optimizer state and checkpoints: the lazily made moments (fp32, fp64 for fp64 params, or 8-bit codes
with their absmax), the fp32 master of a low-precision param (or split mode's low half), and ``state_dict`` /
``load_state_dict`` (validated, then committed: ``_checkpoint.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from fp16kit.distributed import is_dtensor, local
from fp16kit.kernels import join_halves, state8_absmax, to_state8, uses_state8

from . import _checkpoint, _state8_dtensor
from ._rows import LOW_KEY
from ._validate import naming_group

__all__ = ["LOW_PRECISION", "StateMixin"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


class StateMixin:
    """``FusedOptimizer``'s state and checkpoints (reads ``master_weights``, ``bf16_weights``, ``state_bits``)."""

    def _state_for(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Lazily created state: fp32 moments (fp64 for fp64 params) and, in master-weights mode, an fp32
        master copy of each fp16/bf16 param."""
        state = self.state[p]
        if not state:
            math = torch.float64 if p.dtype == torch.float64 else torch.float32
            if self.master_weights and p.dtype in LOW_PRECISION:
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

    def _exact_norm(self) -> bool:
        """Whether the global gradient norm must follow the kernels' arithmetic on the torch backend too: with 8-bit
        moments, whose codes agree with the kernels' bit for bit only from the same clip divisor (LAMB)."""
        return self.state_bits == 8

    def _compile8_message(self) -> str:
        return (
            f"{self._name}: torch.compile of a state_bits=8 step is not supported yet; run the step eagerly, outside "
            f"the compiled function (it is already one launch set per dtype group), or use state_bits=32."
        )

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
        self._forget_steady_step()
        self._adopt_counters()

