"""Synchronized batch normalization that also trains on CPU tensors (gloo), and apex's ``convert_syncbn_model``.

Training forward, per channel ``c`` (fp16/bf16 ``x`` widened to fp32, statistics combined in float64)::

    rank r:  n_r = elements of channel c,  mean_r,  M2_r = sum (x - mean_r)^2           (local, one pass each)
    all_gather (n_r, mean_r, M2_r) over the process group
    N = sum n_r;  mean = sum n_r mean_r / N;  M2 = sum (M2_r + n_r (mean_r - mean)^2)    (Chan et al.)
    var = M2 / N (biased, normalizes);  invstd = 1 / sqrt(var + eps)
    y = (x - mean) * invstd * weight + bias                                              (rounded to x's dtype)
    running_mean += momentum * (mean - running_mean);  running_var += momentum * (M2 / (N - 1) - running_var)

Gathering per-rank means and M2 (instead of summing x and x^2) avoids the cancellation of ``E[x^2] - E[x]^2``.
Backward (the gradient of the sum of every rank's loss, as torch's and apex's SyncBatchNorm)::

    xhat = (x - mean) * invstd
    grad_weight = sum_local dy * xhat;  grad_bias = sum_local dy        (DDP averages them like any param grad)
    all_reduce (sum dy, sum dy * xhat) over the group  ->  (S1, S2)
    dx = weight * invstd * (dy - S1 / N - xhat * S2 / N)

Evaluation uses the running statistics (``F.batch_norm``); without ``track_running_stats`` the batch
statistics as in training. Outside an initialized process group (or with one process) the statistics are
local, i.e. plain batch normalization.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_syncbn_model"]

F64 = torch.float64


def _group_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                channel_dim: int, eps: float, group: Any, world: int) -> tuple[torch.Tensor, ...]:
        math = F64 if x.dtype == F64 else torch.float32  # fp16/bf16/fp32 in fp32, float64 in float64
        xf = x.to(math).movedim(channel_dim, -1)
        channels = xf.shape[-1]
        rows = xf.reshape(-1, channels)
        n_local = rows.shape[0]
        mean_l = rows.mean(0)
        m2_l = (rows - mean_l).square().sum(0)
        stats = torch.stack([torch.full_like(mean_l, n_local), mean_l, m2_l])
        if world > 1:
            parts = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(parts, stats, group=group)
            gathered = torch.stack(parts).to(F64)  # [world, 3, C]
        else:
            gathered = stats.to(F64).unsqueeze(0)
        n, means, m2s = gathered[:, 0], gathered[:, 1], gathered[:, 2]
        total = n.sum(0)
        if bool((total <= 1).any()):
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training over the whole group, got "
                f"input of size {tuple(x.shape)} on each of {world} process(es); use a larger batch or eval mode."
            )
        mean = (n * means).sum(0) / total
        m2 = (m2s + n * (means - mean).square()).sum(0)
        var = m2 / total
        invstd = (var + eps).rsqrt()
        xhat = (rows - mean.to(math)) * invstd.to(math)
        y = xhat
        if weight is not None:
            y = y * weight.to(math) + bias.to(math)
        out = y.reshape(xf.shape).movedim(-1, channel_dim).to(x.dtype)
        ctx.save_for_backward(xhat, weight, invstd.to(math), total.to(math))
        ctx.meta = (x.shape, x.dtype, channel_dim, group, world)
        unbiased = m2 / (total - 1)
        ctx.mark_non_differentiable(mean, unbiased)
        return out, mean, unbiased

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, _dmean: Any, _dvar: Any) -> tuple[Any, ...]:
        xhat, weight, invstd, total = ctx.saved_tensors
        shape, dtype, channel_dim, group, world = ctx.meta
        dyr = dy.to(xhat.dtype).movedim(channel_dim, -1).reshape(xhat.shape)
        sum_dy = dyr.sum(0)
        sum_dy_xhat = (dyr * xhat).sum(0)
        grad_w = grad_b = grad_x = None
        if weight is not None:
            grad_w = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_b = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[0]:
            sums = torch.stack([sum_dy, sum_dy_xhat])
            if world > 1:
                dist.all_reduce(sums, group=group)
            scale = invstd if weight is None else weight.to(invstd.dtype) * invstd
            dx = scale * (dyr - sums[0] / total - xhat * (sums[1] / total))
            moved = list(shape)
            moved.append(moved.pop(channel_dim))
            grad_x = dx.reshape(moved).movedim(-1, channel_dim).to(dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """apex's ``SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats, process_group,
    channel_last, fuse_relu)``: batch normalization with statistics over ``process_group`` (default: the world).

    Any input rank >= 2 (channels in dim 1, or last with ``channel_last=True``); CPU or GPU tensors; fp16/bf16
    inputs are normalized in fp32 and rounded once. ``fuse_relu=True`` applies ReLU to the output.
    The math is in this module's docstring.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = bool(channel_last)
        self.fuse_relu = bool(fuse_relu)

    def _specify_process_group(self, process_group: Any) -> None:
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input (got {input.dim()}D input).")
        channel = input.shape[-1 if self.channel_last else 1]
        if channel != self.num_features:
            where = "last" if self.channel_last else "dim 1"
            raise ValueError(f"SyncBatchNorm: expected {self.num_features} channels in {where}, input has shape "
                             f"{tuple(input.shape)}.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or self.running_mean is None
        channel_dim = input.dim() - 1 if self.channel_last else 1
        if not use_batch_stats:
            x = input.movedim(channel_dim, 1) if self.channel_last else input
            out = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
            out = out.movedim(1, channel_dim) if self.channel_last else out
        else:
            world = _group_size(self.process_group) if self.training else 1
            out, mean, unbiased = _SyncBatchNormFn.apply(input, self.weight, self.bias, channel_dim, self.eps,
                                                         self.process_group, world)
            if self.training and self.running_mean is not None:
                with torch.no_grad():
                    self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                    self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return F.relu(out) if self.fuse_relu else out


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """Replace every ``torch.nn.BatchNorm*d`` (any ``_BatchNorm``, instance norms excepted) in ``module`` by a
    :class:`SyncBatchNorm` with the same options, parameters and buffers; returns the converted module.

    Carried over: ``eps``, ``momentum``, ``affine``, ``track_running_stats``, weight and bias (values,
    ``requires_grad``, dtype, device), ``running_mean``, ``running_var``, ``num_batches_tracked``, training mode.
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last=channel_last)
        with torch.no_grad():
            if module.affine:
                new.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=module.weight.requires_grad)
                new.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
            new.running_mean = module.running_mean
            new.running_var = module.running_var
            new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        if hasattr(module, "qconfig"):
            new.qconfig = module.qconfig
    else:
        new = module
    for name, child in module.named_children():
        new.add_module(name, convert_syncbn_model(child, process_group=process_group, channel_last=channel_last))
    return new
