"""The apex-style frontend on a CUDA GPU: dtypes, the device-side skip without a sync, lazy overflow message,
bit-identical resume, the demo. Run with ``TRITON_INTERPRET=0 pytest -m gpu`` on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from frontend_helpers import batch, bits, make_model, roundtrip
from torch.nn import functional as F

from fp16kit import amp

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled_triton")]


def _cuda_o2(optimizer: str = "fused", seed: int = 0, verbosity: int = 0):
    model = make_model(seed).cuda()
    if optimizer == "fused":
        from fp16kit.optim import FusedAdam

        opt = FusedAdam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return amp.initialize(model, opt, opt_level="O2", verbosity=verbosity, scale_window=3)


def _step(model, opt, step, inf=False, data=None):
    x, y = data if data is not None else (t.cuda() for t in batch(step))
    loss = F.cross_entropy(model(x), y) * (float("inf") if inf else 1.0)
    opt.zero_grad()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_dtypes_on_gpu(level):
    model = make_model().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    x, y = (t.cuda() for t in batch(0))
    out = model(x)
    assert out.dtype == torch.float32 and out.is_cuda
    with amp.scale_loss(F.cross_entropy(out, y), opt) as scaled:
        scaled.backward()
    opt.step()
    low = torch.float16 if level in ("O2", "O3") else torch.float32
    assert model[0].weight.dtype == low and model[0].weight.grad.dtype == low
    assert model[1].weight.dtype == (torch.float16 if level == "O3" else torch.float32)


def test_fused_skip_has_no_sync_and_reports_lazily(capsys):
    model, opt = _cuda_o2(verbosity=1)
    capsys.readouterr()
    _step(model, opt, 0)
    torch.cuda.synchronize()
    before = [bits(p) for p in model.parameters()]
    data = tuple(t.cuda() for t in batch(1))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, opt, 1, inf=True, data=data)  # scale_loss + step: no device-to-host read anywhere
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(bits(p), b) for p, b in zip(model.parameters(), before))
    amp.state_dict()  # reading the state waits for the flag: the message has been printed by now
    msg = "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n"
    assert capsys.readouterr().out == msg
    for master, p in zip(amp.master_params(opt), model.parameters()):
        assert torch.equal(master.to(p.dtype), p)


@pytest.mark.parametrize("optimizer", ["fused", "sgd"])
def test_resume_bit_identical_on_gpu(optimizer):
    overflows = {2, 6}
    model, opt = _cuda_o2(optimizer)
    for s in range(9):
        _step(model, opt, s, inf=s in overflows)
    expected = [bits(p) for p in list(model.parameters()) + list(amp.master_params(opt))]
    expected_amp = amp.state_dict()

    model, opt = _cuda_o2(optimizer)
    for s in range(4):
        _step(model, opt, s, inf=s in overflows)
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    model, opt = _cuda_o2(optimizer, seed=3)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    for s in range(4, 9):
        _step(model, opt, s, inf=s in overflows)
    got = [bits(p) for p in list(model.parameters()) + list(amp.master_params(opt))]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert amp.state_dict() == expected_amp


def test_quick_demo_on_gpu(tmp_path):
    pytest.importorskip("sklearn")
    from fp16kit.demo import main

    assert main(["--quick", "--device", "cuda", "--no-progress", "--out", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").exists()
