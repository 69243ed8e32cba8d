"""The device buffers a table keeps for the device-resident step (``ChunkTable.scratch_buffer``) are never written
past their end: the same grads checked without a norm (FusedAdam) and then with one (FusedLAMB) share one address
table, and the norm pass needs a partial per chunk where the check alone needed one value (a heap overflow before)."""

from __future__ import annotations

import pytest
import torch

from fp16kit.kernels import step_check
from fp16kit.kernels.engine.table import chunk_table
from fp16kit.optim import FusedAdam, FusedLAMB


def test_scratch_buffer_grows_and_keeps_the_old_one_alive():
    table = chunk_table([[torch.zeros(10), torch.zeros(5000)]])
    small = table.scratch_buffer("x", 1, torch.float64)
    big = table.scratch_buffer("x", table.num_chunks, torch.float64)
    assert big.numel() >= table.num_chunks and big.data_ptr() != small.data_ptr()
    assert any(t is small for t in table.scratch["retired"])  # a captured graph may still use it
    assert table.scratch_buffer("x", 1, torch.float64) is big
    assert table.scratch_buffer("x", 1, torch.float32).dtype == torch.float32


@pytest.mark.interpreter
def test_check_without_then_with_a_norm_on_the_same_grads():
    grads = [torch.randn(9000), torch.randn(3)]
    flag, norm = torch.zeros(1), torch.zeros(1)
    assert step_check(grads, None, flag, None, own_flag=True)
    table = chunk_table([grads])
    assert step_check(grads, None, flag, norm, own_flag=True)
    assert table.scratch["check_partials"].numel() >= table.num_chunks
    expected = torch.linalg.vector_norm(torch.cat(grads).double()).float()
    assert torch.equal(norm.reshape(()), expected)


@pytest.mark.interpreter
def test_adam_then_lamb_over_shared_grads():
    grads = [torch.randn(9000) * 1e-2, torch.randn(3) * 1e-2]
    adam_ps = [torch.randn(g.shape).requires_grad_() for g in grads]
    lamb_ps = [torch.randn(g.shape).requires_grad_() for g in grads]
    for a, b, g in zip(adam_ps, lamb_ps, grads):
        a.grad = g
        b.grad = g
    adam, lamb = FusedAdam(adam_ps, lr=1e-3), FusedLAMB(lamb_ps, lr=1e-3)
    for _ in range(2):
        adam.step()
        lamb.step()
    table = chunk_table([grads])
    assert table.scratch["check_partials"].numel() >= table.num_chunks
    assert all(torch.isfinite(p).all() for p in adam_ps + lamb_ps)
