"""Per-op inputs for every row of the default cast policy table (cast-policy.md), used by test_policy.py.

``INPUTS[row](mk)`` returns ``(args, kwargs)`` for calling any callable of that row. ``mk(*shape, lo=, hi=)``
makes the row's *floating* tensor inputs, in call order; the test decides each one's dtype (so that a cast is
always needed: fp32 inputs for LOW rows, low-precision inputs for FP32 rows, mixed for PROMOTE, ...). Values are
drawn inside each op's domain (acos in (-1, 1), log of positives, probabilities for losses...). Non-floating
inputs (indices, targets, lengths) are made here directly. ``TARGET_INPUTS`` overrides a row's inputs for one
callable whose signature differs (the ``torch.*`` builtin twin of an ``F.*`` loss, for example).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Mk = Callable[..., torch.Tensor]
Inputs = Callable[[Mk], tuple[tuple[Any, ...], dict[str, Any]]]


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def idx(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_g())


def _a(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def _unary(lo: float = -2.0, hi: float = 2.0, *extra: Any, **kw: Any) -> Inputs:
    return lambda mk: _a(mk(4, 5, lo=lo, hi=hi), *extra, **kw)


def _binary(lo: float = -2.0, hi: float = 2.0) -> Inputs:
    return lambda mk: _a(mk(4, 5, lo=lo, hi=hi), mk(4, 5, lo=lo, hi=hi))


def _rnn(gates: int, lstm: bool) -> Inputs:
    def f(mk: Mk) -> tuple[tuple[Any, ...], dict[str, Any]]:
        x, hx = mk(3, 4), mk(3, 5)
        hidden: Any = (hx, mk(3, 5)) if lstm else hx
        return _a(x, hidden, mk(gates * 5, 4), mk(gates * 5, 5), mk(gates * 5), mk(gates * 5))

    return f


INPUTS: dict[str, Inputs] = {
    # ---- LOW
    "conv1d": lambda mk: _a(mk(2, 3, 8), mk(4, 3, 3), mk(4)),
    "conv2d": lambda mk: _a(mk(2, 3, 6, 6), mk(4, 3, 3, 3), mk(4)),
    "conv3d": lambda mk: _a(mk(1, 2, 4, 4, 4), mk(3, 2, 2, 2, 2), mk(3)),
    "conv_transpose1d": lambda mk: _a(mk(2, 3, 8), mk(3, 4, 3), mk(4)),
    "conv_transpose2d": lambda mk: _a(mk(2, 3, 5, 5), mk(3, 4, 3, 3), mk(4)),
    "conv_transpose3d": lambda mk: _a(mk(1, 2, 3, 3, 3), mk(2, 3, 2, 2, 2), mk(3)),
    "conv_tbc": lambda mk: _a(mk(6, 2, 3), mk(3, 3, 4), mk(4), 1),
    "linear": lambda mk: _a(mk(4, 8), mk(6, 8), mk(6)),
    "prelu": lambda mk: _a(mk(2, 3, 4), mk(3, lo=0.0, hi=0.5)),
    "addmm": lambda mk: _a(mk(4, 6), mk(4, 5), mk(5, 6)),
    "addmv": lambda mk: _a(mk(4), mk(4, 5), mk(5)),
    "addr": lambda mk: _a(mk(4, 5), mk(4), mk(5)),
    "matmul": lambda mk: _a(mk(2, 4, 5), mk(5, 3)),
    "mm": lambda mk: _a(mk(4, 5), mk(5, 3)),
    "mv": lambda mk: _a(mk(4, 5), mk(5)),
    "bmm": lambda mk: _a(mk(2, 4, 5), mk(2, 5, 3)),
    "baddbmm": lambda mk: _a(mk(2, 4, 3), mk(2, 4, 5), mk(2, 5, 3)),
    "addbmm": lambda mk: _a(mk(4, 3), mk(2, 4, 5), mk(2, 5, 3)),
    "einsum": lambda mk: _a("ij,jk->ik", mk(4, 5), mk(5, 3)),
    "chain_matmul": lambda mk: _a(mk(4, 5), mk(5, 3), mk(3, 2)),
    "linalg.multi_dot": lambda mk: _a([mk(4, 5), mk(5, 3), mk(3, 2)]),
    "linalg.vecdot": lambda mk: _a(mk(4, 5), mk(4, 5)),
    "Tensor.__matmul__": lambda mk: _a(mk(4, 5), mk(5, 3)),
    "scaled_dot_product_attention": lambda mk: _a(mk(1, 2, 4, 8), mk(1, 2, 4, 8), mk(1, 2, 4, 8)),
    "lstm_cell": _rnn(4, lstm=True),
    "gru_cell": _rnn(3, lstm=False),
    "rnn_tanh_cell": _rnn(1, lstm=False),
    "rnn_relu_cell": _rnn(1, lstm=False),
    # ---- FP32: pointwise
    "acos": _unary(-0.9, 0.9),
    "asin": _unary(-0.9, 0.9),
    "cosh": _unary(),
    "sinh": _unary(),
    "tan": _unary(-1.2, 1.2),
    "erfinv": _unary(-0.9, 0.9),
    "exp": _unary(),
    "expm1": _unary(),
    "log": _unary(0.1, 4.0),
    "log10": _unary(0.1, 4.0),
    "log2": _unary(0.1, 4.0),
    "log1p": _unary(-0.5, 4.0),
    "reciprocal": _unary(0.5, 4.0),
    "rsqrt": _unary(0.1, 4.0),
    "pow": lambda mk: _a(mk(4, 5, lo=0.1, hi=2.0), mk(4, 5, lo=-1.5, hi=1.5)),
    "Tensor.__pow__": lambda mk: _a(mk(4, 5, lo=0.1, hi=2.0), mk(4, 5, lo=-1.5, hi=1.5)),
    "Tensor.__rpow__": lambda mk: _a(mk(4, 5, lo=-1.5, hi=1.5), mk(4, 5, lo=0.1, hi=2.0)),
    "Tensor.__ipow__": lambda mk: _a(mk(4, 5, lo=0.1, hi=2.0), mk(4, 5, lo=-1.5, hi=1.5)),
    "softplus": _unary(),
    # softmax family
    "softmax": _unary(-3, 3, -1),
    "log_softmax": _unary(-3, 3, -1),
    "softmin": _unary(-3, 3, -1),
    # reductions
    "sum": _unary(),
    "prod": _unary(0.5, 1.5),
    "cumsum": _unary(-2, 2, 1),
    "cumprod": _unary(0.5, 1.5, 1),
    "mean": _unary(),
    "norm": _unary(),
    "dist": _binary(),
    "renorm": _unary(-2, 2, 2, 0, 1.0),
    "std": _unary(),
    "var": _unary(),
    "logsumexp": _unary(-3, 3, 1),
    "linalg.vector_norm": _unary(),
    "linalg.matrix_norm": _unary(),
    # normalisation
    "layer_norm": lambda mk: _a(mk(3, 4, 6), (6,), mk(6), mk(6)),
    "group_norm": lambda mk: _a(mk(2, 4, 5), 2, mk(4), mk(4)),
    "rms_norm": lambda mk: _a(mk(3, 4, 6), (6,), mk(6)),
    "local_response_norm": lambda mk: _a(mk(2, 4, 5), 2),
    "normalize": _unary(),
    # losses
    "cross_entropy": lambda mk: _a(mk(6, 5), idx(5, 6)),
    "nll_loss": lambda mk: _a(mk(6, 5, lo=-3.0, hi=-0.1), idx(5, 6)),
    # batchmean: the default 'mean' warns, and Dynamo cannot trace warnings.warn under fullgraph=True once the
    # warning registry has been reset (the compiled sweeps of test_compile_equals_eager failed after other tests)
    "kl_div": lambda mk: _a(mk(6, 5, lo=-3.0, hi=-0.1), mk(6, 5, lo=0.05, hi=1.0), reduction="batchmean"),
    "l1_loss": _binary(),
    "mse_loss": _binary(),
    "smooth_l1_loss": _binary(),
    "huber_loss": _binary(),
    "poisson_nll_loss": lambda mk: _a(mk(6, 5, lo=-1.0, hi=1.0), mk(6, 5, lo=0.0, hi=3.0)),
    "cosine_embedding_loss": lambda mk: _a(mk(6, 5), mk(6, 5), idx(2, 6) * 2 - 1),
    "hinge_embedding_loss": lambda mk: _a(mk(6, 5), idx(2, 6, 5) * 2 - 1),
    "margin_ranking_loss": lambda mk: _a(mk(6), mk(6), (idx(2, 6) * 2 - 1).float()),
    "multilabel_margin_loss": lambda mk: _a(
        mk(3, 5), torch.tensor([[3, 0, -1, 1, 2], [1, -1, 0, 0, 0], [4, 2, 1, -1, 0]])
    ),
    "multilabel_soft_margin_loss": lambda mk: _a(mk(3, 5), idx(2, 3, 5).float()),
    "multi_margin_loss": lambda mk: _a(mk(6, 5), idx(5, 6)),
    "soft_margin_loss": lambda mk: _a(mk(6, 5), (idx(2, 6, 5) * 2 - 1).float()),
    "triplet_margin_loss": lambda mk: _a(mk(6, 5), mk(6, 5), mk(6, 5)),
    "binary_cross_entropy_with_logits": lambda mk: _a(mk(6, 5), mk(6, 5, lo=0.0, hi=1.0)),
    "ctc_loss": lambda mk: _a(
        mk(8, 2, 5, lo=-3.0, hi=-0.5).log_softmax(-1),
        torch.tensor([[1, 2, 3], [2, 4, 1]]),
        torch.tensor([8, 7]),
        torch.tensor([3, 2]),
    ),
    "cosine_similarity": _binary(),
    # others
    "gelu": _unary(),
    "interpolate": lambda mk: _a(mk(1, 2, 4, 4), None, 2.0, "bilinear"),
    "grid_sample": lambda mk: _a(mk(1, 2, 4, 4), mk(1, 3, 3, 2, lo=-1.0, hi=1.0), align_corners=False),
    "cdist": _binary(),
    "pdist": _unary(),
    # ---- PROMOTE
    "addcdiv": lambda mk: _a(mk(4, 5), mk(4, 5), mk(4, 5, lo=0.5, hi=2.0), value=0.5),
    "addcmul": lambda mk: _a(mk(4, 5), mk(4, 5), mk(4, 5), value=0.5),
    "atan2": _binary(),
    "cross": lambda mk: _a(mk(4, 3), mk(4, 3), dim=1),
    "bilinear": lambda mk: _a(mk(4, 3), mk(4, 5), mk(2, 3, 5), mk(2)),
    "dot": lambda mk: _a(mk(7), mk(7)),
    "vdot": lambda mk: _a(mk(7), mk(7)),
    "tensordot": lambda mk: _a(mk(4, 5), mk(5, 3), dims=1),
    "index_put": lambda mk: _a(mk(6, 3), (torch.tensor([0, 2, 5]),), mk(3, 3)),
    "scatter_add": lambda mk: _a(mk(4, 5), 1, idx(5, 4, 5), mk(4, 5)),
    "cat": lambda mk: _a([mk(2, 5), mk(3, 5)]),
    "stack": lambda mk: _a([mk(2, 5), mk(2, 5)]),
    # ---- rows that come from torch's own CUDA lists (policy.TORCH_CUDA_TABLE)
    "_convolution": lambda mk: _a(
        mk(2, 3, 6, 6), mk(4, 3, 3, 3), mk(4), (1, 1), (0, 0), (1, 1), False, (0, 0), 1, False, False, True, True
    ),
    "convolution": lambda mk: _a(mk(2, 3, 6, 6), mk(4, 3, 3, 3), mk(4), (1, 1), (0, 0), (1, 1), False, (0, 0), 1),
    "cudnn_convolution": lambda mk: _a(mk(2, 3, 6, 6), mk(4, 3, 3, 3), (0, 0), (1, 1), (1, 1), 1, False, True, True),
    "cudnn_convolution_transpose": lambda mk: _a(
        mk(2, 3, 6, 6), mk(3, 4, 3, 3), (0, 0), (0, 0), (1, 1), (1, 1), 1, False, True, True
    ),
    "grid_sampler": lambda mk: _a(mk(1, 2, 4, 4), mk(1, 3, 3, 2, lo=-1.0, hi=1.0), 0, 0, False),
    "nll_loss2d": lambda mk: _a(mk(2, 3, 4, 4, lo=-3.0, hi=-0.1), idx(3, 2, 4, 4)),
    # ---- BANNED
    "binary_cross_entropy": lambda mk: _a(mk(6, 5, lo=0.05, hi=0.95), mk(6, 5, lo=0.0, hi=1.0)),
}

# torch.* builtin twins whose signatures differ from the F.* function of the same row
TARGET_INPUTS: dict[str, Inputs] = {
    "torch.poisson_nll_loss": lambda mk: _a(mk(6, 5, lo=-1.0, hi=1.0), mk(6, 5, lo=0.0, hi=3.0), True, False, 1e-8, 1),
    "torch.kl_div": lambda mk: _a(mk(6, 5, lo=-3.0, hi=-0.1), mk(6, 5, lo=0.05, hi=1.0)),
    "torch.ctc_loss": lambda mk: _a(
        mk(8, 2, 5, lo=-3.0, hi=-0.5).log_softmax(-1),
        torch.tensor([[1, 2, 3], [2, 4, 1]]),
        [8, 7],
        [3, 2],
    ),
    "torch.Tensor.renorm_": _unary(-2, 2, 2, 0, 1.0),
}
