"""The row bundles an optimizer op hands down to its Triton launchers and torch twins, in place of one parameter per
tensor list: a new row (or a new state list) then changes one bundle, not every signature on the way down.

Every list in a bundle is one row of the op's call (one entry per parameter tensor, in the call's order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ApexRows", "GradMoments", "Rows"]

#: Adam's and LAMB's rows: ``(params, grads, exp_avgs, exp_avg_sqs, models)`` (``models[i]`` a model copy or None;
#: for a launcher, ``models`` None when there are no model copies).
Rows = tuple[
    Sequence[torch.Tensor],
    Sequence[torch.Tensor],
    Sequence[torch.Tensor],
    Sequence[torch.Tensor],
    Sequence[torch.Tensor | None],
]

#: The rows the moment math reads: ``(grads, exp_avgs, exp_avg_sqs)``.
GradMoments = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[torch.Tensor]]

#: An apex optimizer's rows (SGD, Adagrad, NovoGrad): ``(params, grads, states, models)``, ``states`` its state lists
#: (SGD's momentum buffers or none, Adagrad's sums, NovoGrad's first moments), ``models[i]`` a model copy or None
#: (for a launcher, ``models`` None when there are no model copies).
ApexRows = tuple[
    Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[Sequence[torch.Tensor]], Sequence[torch.Tensor | None]
]
