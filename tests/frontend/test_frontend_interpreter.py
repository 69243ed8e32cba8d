"""O1 and O2 with the real Triton kernels (unscale-and-check into fp32 masters, master -> model copy) under
Triton's interpreter on CPU tensors: bit-identical to the torch fallback."""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import bits, make_model, train_steps

from fp16kit import amp
from fp16kit.kernels import Backend, select_backend, use_backend

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_triton_kernels_match_the_torch_fallback(level):
    results = []
    for backend in ("torch", "auto"):  # "auto" on CPU tensors under TRITON_INTERPRET=1: the interpreter
        with use_backend(backend):
            expected = Backend.TORCH if backend == "torch" else Backend.INTERPRETER
            assert select_backend(torch.device("cpu")).backend is expected
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
            train_steps(model, opt, range(3), inject_inf=lambda s: s == 1)
            results.append([bits(p) for p in list(model.parameters()) + list(amp.master_params(opt))])
            results[-1].append(torch.tensor(amp.state_dict()["loss_scaler0"]["loss_scale"]))
    for a, b in zip(*results):
        assert torch.equal(a, b)
