"""The plugin's CUDA-to-CPU mapping (runs always; apex's own tests run only with FP16KIT_APEX_TESTS set)."""

from __future__ import annotations

import torch
from cuda_mapping import cuda_on_cpu, map_device, patch_cuda_module
from torch import nn


def test_device_arguments_map_to_the_cpu() -> None:
    assert map_device("cuda:1") == "cpu" and map_device(torch.device("cuda", 0)) == torch.device("cpu")
    assert map_device("torch.cuda.HalfTensor") == "torch.HalfTensor" and map_device("cudax") == "cudax"
    with cuda_on_cpu():
        a = torch.zeros(2, device="cuda")
        b = torch.ones(2).to("cuda:0")
        c = torch.full((1,), 3.0, device=torch.device("cuda"))
        m = nn.Linear(2, 2).cuda()
        h = a.type("torch.cuda.HalfTensor")
        assert {a.device.type, b.device.type, c.device.type, m.weight.device.type} == {"cpu"}
        assert h.dtype == torch.float16 and h.type() == "torch.cuda.HalfTensor"
        assert a.cuda() is a
    assert a.type() == "torch.FloatTensor"  # outside the mode: honest names


def test_cuda_module_patch_is_undone_and_seeding_does_not_recurse() -> None:
    before = torch.cuda.FloatTensor
    undo = patch_cuda_module()
    try:
        assert torch.cuda.IntTensor(1).zero_().dtype == torch.int32
        torch.manual_seed(5)  # calls torch.cuda.manual_seed_all internally
        x = torch.rand(1)
        torch.cuda.manual_seed(5)
        assert torch.equal(torch.rand(1), x)
        with torch.cuda.device(1):
            torch.cuda.synchronize()
    finally:
        undo()
    assert torch.cuda.FloatTensor is before
