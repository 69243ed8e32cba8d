"""apex's ``apex.fp16_utils``: the pre-amp fp16 helpers, for scripts that still import them.

Compatibility shim, reachable as ``apex.fp16_utils`` through the aliases (``fp16kit.compat.install_apex``,
``python -m fp16kit run``). apex deprecated this module in favour of ``amp``; so does fp16kit, and each name says
its public fp16kit replacement (docs/migrating-from-apex.md, "apex.fp16_utils"):

=================================================  ===========================================================
apex.fp16_utils                                     public fp16kit way
=================================================  ===========================================================
``to_python_float(t)``                              ``float(t)`` / ``t.item()``
``network_to_half``, ``BN_convert_float``,          ``amp.initialize(model, opt, opt_level="O2")`` (casts the
``convert_network``, ``FP16Model``, ``tofp16``      model, keeps batchnorm fp32, casts inputs and outputs)
``prep_param_lists``, ``model_grads_to_master_      ``amp.initialize(..., opt_level="O2")`` (fp32 masters kept
grads``, ``master_params_to_model_params``          by the optimizer; ``amp.master_params(opt)`` lists them)
``FP16_Optimizer``                                  ``amp.initialize(..., opt_level="O2")`` + ``amp.scale_loss``
``LossScaler``, ``DynamicLossScaler``               ``fp16kit.amp.LossScaler`` / ``fp16kit.amp.GradScaler``
``Fused_Weight_Norm``                               ``torch.nn.utils.parametrizations.weight_norm`` (not provided)
=================================================  ===========================================================

Differences from apex: fp16 or bf16 parameters are accepted (apex: CUDA fp16 only) and CPU tensors work;
``FP16_Optimizer`` unscales and checks the model grads in one fused pass (``fp16kit.kernels.unscale_and_check``)
and its dynamic scaler is fp16kit's ``LossScaler`` (apex's newer ``FP16_Optimizer`` used amp's scaler with the same
defaults: ``2**16``, window 2000, cap ``2**24``); its ``state_dict()`` stores the scaler's state as a dict (apex
pickled the scaler object), and loads either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .kernels import copy_, new_found_inf, unscale_and_check

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Module",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "fp16_to_fp32",
    "fp32_to_fp16",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]

_LOW = (torch.float16, torch.bfloat16)

#: torch's clipping under apex's old name
clip_grad_norm = torch.nn.utils.clip_grad_norm_


def to_python_float(t: Any) -> float:
    """``t.item()`` (a host sync for device tensors); ``t[0]`` for objects without ``item``."""
    return t.item() if hasattr(t, "item") else t[0]


# ---------------------------------------------------------------------------------------------- model conversion
class tofp16(nn.Module):
    """A module whose ``forward`` returns ``input.half()`` (the first stage of :func:`network_to_half`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def _is_affine_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and bool(module.affine)


def BN_convert_float(module: nn.Module) -> nn.Module:
    """Batchnorm layers (every ``_BatchNorm``, recursively) back to fp32, in place; returns ``module``."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))``: fp16 model, fp32 batchnorm, fp16 input."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters and buffers of ``module`` itself (not its children) to ``dtype``, in place
    (grads too)."""
    for param in module.parameters(recurse=False):
        if param is not None and param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad.data = param.grad.data.to(dtype)
    for name, buf in module.named_buffers(recurse=False):
        if buf is not None and buf.is_floating_point():
            setattr(module, name, buf.to(dtype))


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module of ``network`` to ``dtype`` except affine batchnorm (kept fp32); returns ``network``."""
    for module in network.modules():
        if _is_affine_batchnorm(module):
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """``network`` in fp16 (batchnorm fp32); floating inputs are cast to fp16 on the way in."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Any) -> Any:
        return self.network(*(x.half() if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs))


def _convert(val: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(val, list | tuple):
        out = [_convert(v, fn) for v in val]
        return tuple(out) if isinstance(val, tuple) else out
    return fn(val) if torch.is_tensor(val) else val


def fp32_to_fp16(val: Any) -> Any:
    """fp32 tensors in ``val`` (nested lists/tuples) to fp16; everything else as it is."""
    return _convert(val, lambda t: t.half() if t.dtype == torch.float32 else t)


def fp16_to_fp32(val: Any) -> Any:
    """fp16 tensors in ``val`` (nested lists/tuples) to fp32; everything else as it is."""
    return _convert(val, lambda t: t.float() if t.dtype == torch.float16 else t)


class FP16_Module(nn.Module):
    """``module.half()``, with fp32 inputs cast to fp16 and fp16 outputs back to fp32."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.add_module("module", module.half())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return fp16_to_fp32(self.module(*fp32_to_fp16(inputs), **kwargs))


# ---------------------------------------------------------------------------------------------- manual masters
def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """``(model_params, master_params)``: the params that require grad, and fp32 copies of them that require grad.

    ``flat_master=True``: one flat fp32 master (all model params must share a dtype; its ``.grad`` is allocated).
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        dtypes = {p.dtype for p in model_params}
        if len(dtypes) > 1:
            raise TypeError(
                f"prep_param_lists(flat_master=True): the model's parameters have several dtypes "
                f"({sorted(map(str, dtypes))}); use flat_master=False, or amp.initialize(model, optimizer, "
                "opt_level='O2')."
            )
        flat = nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        flat.grad = torch.empty_like(flat)
        return model_params, [flat]
    masters = [p.detach().clone().float() for p in model_params]
    for m in masters:
        m.requires_grad = True
    return model_params, masters


def model_grads_to_master_grads(model_params: list[torch.Tensor], master_params: list[torch.Tensor],
                                flat_master: bool = False) -> None:
    """``master.grad = fp32(model.grad)`` (``None`` where the model param has none); one flat grad with
    ``flat_master``."""
    if flat_master:
        master_params[0].grad.data.copy_(_flatten_dense_tensors([p.grad.data for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.data.copy_(model.grad.data)


def master_params_to_model_params(model_params: list[torch.Tensor], master_params: list[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """``model.copy_(master)`` for each pair (round to nearest even); from one flat master with ``flat_master``."""
    if flat_master:
        masters = list(_unflatten_dense_tensors(master_params[0].data, model_params))
    else:
        masters = [m.data for m in master_params]
    with torch.no_grad():
        for model, master in zip(model_params, masters):
            model.copy_(master)


# ---------------------------------------------------------------------------------------------- legacy scalers
class LossScaler:
    """apex.fp16_utils' static scaler: ``loss_scale`` (a property), ``update_scale(overflow)`` does nothing."""

    def __init__(self, scale: float = 1) -> None:
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        return None

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: nn.Module, grad_in: tuple, grad_out: tuple) -> tuple:
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor) -> None:
        (loss * self.loss_scale).backward()


class DynamicLossScaler(LossScaler):
    """apex.fp16_utils' dynamic scaler: starts at ``init_scale``; an overflow divides by ``scale_factor`` (not below
    1); every ``scale_window`` iterations after the last overflow multiplies by it. ``has_overflow(params)`` reads
    each grad back to the host (as apex did); new code uses ``fp16kit.amp.GradScaler``."""

    def __init__(self, init_scale: float = 2**32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return any(p.grad is not None and not bool(torch.isfinite(p.grad.float()).all()) for p in params)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1


# ---------------------------------------------------------------------------------------------- FP16_Optimizer
class FP16_Optimizer:
    """apex's optimizer wrapper with fp32 master weights and static or dynamic loss scaling.

    ``loss.backward()`` becomes ``optimizer.backward(loss)``; ``optimizer.step()`` skips overflowed steps. The
    fp16/bf16 params of ``init_optimizer``'s groups are replaced by fp32 masters (``fp32_from_fp16_groups``); after
    each step the masters are written into the model params (``fp16_groups``). Dynamic scaling
    (``dynamic_loss_scale=True``; ``dynamic_loss_args`` keys ``init_scale``, ``scale_factor``, ``scale_window``,
    ``min_loss_scale``, ``max_loss_scale``) is fp16kit's ``LossScaler``; the step decision is one host read per
    ``update_master_grads`` (apex's too). New code: ``amp.initialize(model, opt, opt_level="O2")``.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 verbose: bool = True) -> None:
        from .amp.loss_scaler import LossScaler as _DeviceScaler

        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        device = None
        for i, group in enumerate(init_optimizer.param_groups):
            self._say(f"FP16_Optimizer processing param group {i}:")
            low, full = [], []
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                device = device or p.device
                if p.dtype in _LOW:
                    self._say(f"FP16_Optimizer received {p.type()} with {p.size()}")
                    low.append(p)
                elif p.dtype == torch.float32:
                    self._say(f"FP16_Optimizer received {p.type()} with {p.size()}")
                    full.append(p)
                else:
                    raise TypeError(f"Wrapped parameters must be fp32, fp16 or bf16 tensors. Received {p.type()}")
            masters = [p.detach().clone().float().requires_grad_(True) for p in low]
            group["params"] = masters + full
            self.fp16_groups.append(low)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(full)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        if len(init_optimizer.state):  # re-key existing per-param state onto the masters (apex's trick)
            init_optimizer.load_state_dict(init_optimizer.state_dict())
        device = device or torch.device("cpu")
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        if self.dynamic_loss_scale:
            args = dict(dynamic_loss_args or {})
            factor = float(args.pop("scale_factor", 2.0))
            self.loss_scaler = _DeviceScaler(
                init_scale=args.pop("init_scale", 2.0**16), growth_factor=factor, backoff_factor=1.0 / factor,
                growth_interval=int(args.pop("scale_window", 2000)), min_scale=args.pop("min_loss_scale", None),
                max_scale=args.pop("max_loss_scale", 2.0**24), device=device,
            )
            if args:
                raise TypeError(f"FP16_Optimizer: unknown dynamic_loss_args {sorted(args)}.")
        else:
            self.loss_scaler = _DeviceScaler(init_scale=float(static_loss_scale), dynamic=False, device=device)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_

    def _say(self, msg: str) -> None:
        if self.verbose:
            print(msg)

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_grads_to_None: bool = False) -> None:
        """Zero (or drop, with ``set_grads_to_None``) the master grads and the model's fp16 grads."""
        for p in [*self.all_fp32_from_fp16_params, *self.all_fp32_from_fp32_params, *self.all_fp16_params]:
            if p.grad is None:
                continue
            if set_grads_to_None:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss.float() * loss_scale).backward()``; then :meth:`update_master_grads` unless told not to (several
        losses: call it once after the last backward)."""
        (loss.float() * self.loss_scaler.scale.reshape(())).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """fp32 master grads = model grads / loss_scale (fp32 params' grads unscaled in place), checked for inf/NaN
        in the same pass; the scaler is updated and ``overflow`` says whether the next ``step()`` is skipped."""
        found_inf = self.loss_scaler.new_found_inf()
        inv = self.loss_scaler.inv_scale()
        src, dst = [], []
        for p, m in zip(self.all_fp16_params, self.all_fp32_from_fp16_params):
            if p.grad is not None:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                src.append(p.grad)
                dst.append(m.grad)
        for p in self.all_fp32_from_fp32_params:
            if p.grad is not None:
                src.append(p.grad)
                dst.append(p.grad)
        if src and src[0].device == found_inf.device:
            unscale_and_check(src, inv, found_inf, out=dst)
        elif src:
            _unscale_elsewhere(src, dst, inv, found_inf)
        self.loss_scaler.update(found_inf)
        self.overflow = bool(self.loss_scaler.dynamic and float(found_inf.reshape(-1)[0]) != 0.0)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor | int:
        """Clip the fp32 master grads (``clip_grad_norm_``) and return their total norm; ``-1`` after an overflow."""
        if self.overflow:
            return -1
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def inspect_master_grad_data(self) -> None:
        raise NotImplementedError("FP16_Optimizer.inspect_master_grad_data: not implemented in apex either; read the "
                                  ".grad of optimizer.fp32_from_fp16_groups.")

    # ------------------------------------------------------------------ the step
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the masters with the wrapped optimizer and write them into the model; skip (printing apex's
        message) when the last :meth:`update_master_grads` found an overflow."""
        if closure is not None and self.dynamic_loss_scale:
            raise TypeError("Using step with a closure is currently not compatible with dynamic loss scaling.")
        if self.overflow:
            self._say(f"Gradient overflow.  Skipping step, reducing loss scale to {self.loss_scaler.get_scale()}")
            self.overflow = False
            return None
        result = self._step_with_closure(closure) if closure is not None else self.optimizer.step()
        self._master_params_to_model_params()
        return result

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                self._master_params_to_model_params()
            return closure()

        result = self.optimizer.step(wrapped)
        self.first_closure_call_this_step = True
        return result

    def _master_params_to_model_params(self) -> None:
        if self.all_fp16_params:
            with torch.no_grad():
                copy_(self.all_fp16_params, self.all_fp32_from_fp16_params)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """``loss_scaler`` (the scaler's state dict), ``dynamic_loss_scale``, ``overflow``,
        ``first_closure_call_this_step``, ``optimizer_state_dict``, ``fp32_from_fp16`` (the masters by group)."""
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach().clone() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (masters bit for bit). An apex checkpoint's pickled scaler gives its scale."""
        saved = state_dict["loss_scaler"]
        if isinstance(saved, dict):
            self.loss_scaler.load_state_dict(saved)
        else:  # apex pickled its scaler object: take its scale
            scale = saved.loss_scale() if callable(saved.loss_scale) else saved.loss_scale
            self.loss_scaler.set_scale(float(scale))
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current, saved_group in zip(self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"]):
                for m, s in zip(current, saved_group):
                    m.copy_(s)

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.get_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler.set_scale(value)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value


def _unscale_elsewhere(src: list[torch.Tensor], dst: list[torch.Tensor], inv: torch.Tensor,
                       found_inf: torch.Tensor) -> None:
    """``unscale_and_check`` for grads on another device than the scaler, the flag folded back."""
    flag = new_found_inf(src[0].device)
    unscale_and_check(src, inv.to(src[0].device), flag, out=dst)
    found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))


def __getattr__(name: str) -> Any:
    if name == "Fused_Weight_Norm":
        raise AttributeError(
            "apex.fp16_utils.Fused_Weight_Norm is not provided by fp16kit (apex removed it too): use "
            "torch.nn.utils.parametrizations.weight_norm."
        )
    raise AttributeError(f"module 'fp16kit.fp16_utils' (apex.fp16_utils) has no attribute {name!r}")
