"""install_apex aliases and ``python -m fp16kit run``: unmodified apex scripts take the apex path."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fp16kit
import fp16kit.optim
from fp16kit import compat
from fp16kit.__main__ import main as fp16kit_main

HERE = Path(__file__).parent
REPO = HERE.parents[1]


@pytest.fixture
def aliases():
    assert not compat.installed()
    compat.install_apex()
    yield
    compat.uninstall_apex()
    assert "apex" not in sys.modules and "amp_C" not in sys.modules


def test_seed_idiom_takes_the_apex_path(aliases) -> None:
    try:
        from apex import amp
    except ImportError:
        amp = None
    import amp_C
    import apex
    import apex_C
    from apex.amp import _amp_state
    from apex.multi_tensor_apply import multi_tensor_applier
    from apex.optimizers import FusedAdam, FusedLAMB
    from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model

    assert amp is fp16kit.amp and apex.amp is amp
    assert amp_C is fp16kit.amp_C and multi_tensor_applier is fp16kit.multi_tensor_apply.multi_tensor_applier
    assert issubclass(FusedAdam, fp16kit.optim.FusedAdam) and issubclass(FusedLAMB, fp16kit.optim.FusedLAMB)
    assert FusedAdam.unscale_grads and not fp16kit.optim.FusedAdam.unscale_grads  # apex's grads (see below)
    assert DistributedDataParallel.__module__ == "fp16kit.parallel.distributed"
    assert SyncBatchNorm is fp16kit.parallel.SyncBatchNorm and convert_syncbn_model is not None
    assert _amp_state is fp16kit.amp._amp_state
    ts = [torch.arange(3.0), torch.ones(2, 2)]
    flat = apex_C.flatten(ts)
    assert flat.shape == (7,) and all(torch.equal(a, b) for a, b in zip(apex_C.unflatten(flat, ts), ts))
    compat.install_apex()  # idempotent


@pytest.mark.parametrize("name", compat.APEX_OPTIMIZERS)
def test_apex_optimizers_resolve_lazily_through_fp16kit_optim(aliases, monkeypatch, name) -> None:
    sentinel = type(name, (), {})
    monkeypatch.setattr(fp16kit.optim, name, sentinel, raising=False)
    import apex.optimizers

    monkeypatch.delattr(apex.optimizers, name, raising=False)
    assert getattr(apex.optimizers, name) is sentinel


def test_a_name_fp16kit_lacks_fails_with_a_clear_message() -> None:
    mod = compat._module("apex.fake", "test module")
    compat._lazy_from(mod, "fp16kit.kernels", ("FusedSGD",))
    with pytest.raises(AttributeError, match=r"maps to fp16kit.kernels.FusedSGD, which this fp16kit does not provide"):
        mod.FusedSGD  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        mod.Nope  # noqa: B018


def test_refuses_when_a_real_apex_is_importable(tmp_path, monkeypatch) -> None:
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"a real apex is importable: apex \(.*apex.__init__\.py\).*force=True"):
        compat.install_apex()
    assert "apex" not in sys.modules
    compat.install_apex(force=True)
    try:
        import apex

        assert not hasattr(apex, "REAL") and apex.amp is fp16kit.amp
    finally:
        compat.uninstall_apex()


def test_run_returns_the_exit_code_and_sets_argv(tmp_path, capsys) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nfrom apex import amp\nprint(__name__, sys.argv[1:], amp.__name__)\n"
                      "sys.exit(int(sys.argv[1]))\n")
    argv = list(sys.argv)
    try:
        assert fp16kit_main(["run", str(script), "3", "--flag"]) == 3
        assert capsys.readouterr().out.split("\n")[0] == "__main__ ['3', '--flag'] fp16kit.amp"
        assert sys.argv == argv, "sys.argv is restored"
        script.write_text("raise ValueError('boom')\n")
        with pytest.raises(ValueError, match="boom"):
            fp16kit_main(["run", str(script)])
        script.write_text("x = 1\n")
        assert fp16kit_main(["run", str(script)]) == 0
        with pytest.raises(FileNotFoundError, match="no such script"):
            fp16kit_main(["run", str(tmp_path / "missing.py")])
    finally:
        compat.uninstall_apex()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_two_ranks(script: str, tmp_path, port: str) -> tuple[list[subprocess.Popen], list[str]]:
    """Two ranks of ``script`` on 127.0.0.1:``port`` (gloo on the loopback interface), 120 s at most."""
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen([sys.executable, "-m", "fp16kit", "run", script, str(tmp_path / f"r{rank}.pt")],
                                      env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    deadline = time.monotonic() + 120
    try:  # wait for both; a rank that failed (rank 0 could not bind the port) leaves the other waiting: stop it
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 7) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            p.kill()
    return procs, [p.communicate()[0] for p in procs]


def test_apex_style_script_runs_unchanged_on_one_and_two_gloo_processes(tmp_path) -> None:
    script = str(HERE / "apex_style_script.py")
    try:  # one process, in this process; then two gloo processes launched torchrun-style
        assert compat.run_script(script, [str(tmp_path / "one.pt")]) == 7
    finally:
        compat.uninstall_apex()
    # The script is a user's torchrun-style script (env:// rendezvous on MASTER_PORT), so the port is picked
    # here; another process may take it before rank 0 binds it (issue 22): then the run is retried on a new one.
    for _attempt in range(3):
        procs, outs = _launch_two_ranks(script, tmp_path, str(_free_port()))
        if not any("address already in use" in out.lower() for out in outs):
            break
    assert [p.returncode for p in procs] == [7, 7], outs
    single, r0, r1 = (torch.load(tmp_path / f, weights_only=True) for f in ("one.pt", "r0.pt", "r1.pt"))
    assert single["losses"][-1] < single["losses"][0]
    for a, b in zip(r0["masters"], r1["masters"]):  # DDP keeps the replicas identical
        assert torch.equal(a, b)
    for a, b in zip(r0["masters"], single["masters"]):  # and the 2-rank run follows the global-batch run
        torch.testing.assert_close(a, b, rtol=0, atol=5e-3)


@pytest.mark.parametrize("flavour", ["apex", "fp16kit"])
def test_grads_after_a_grad_scaler_step(aliases, flavour) -> None:
    """apex's optimizers leave unscaled grads in ``p.grad`` after ``GradScaler.step`` (its tests compare them with
    torch.optim.Adam's); fp16kit's own leave them scaled, as torch's fused optimizers do (one write pass less).
    Both take the same step."""
    import apex.optimizers

    cls = apex.optimizers.FusedAdam if flavour == "apex" else fp16kit.optim.FusedAdam
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(4, 3)
    model = torch.nn.Linear(4, 3)
    model.load_state_dict(ref_model.state_dict())
    ref_opt, opt = torch.optim.Adam(ref_model.parameters(), lr=0.1), cls(model.parameters(), lr=0.1)
    ref_scaler, scaler = torch.amp.GradScaler("cpu", init_scale=1024.0), torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(8, 4)
    for m, o, sc in ((ref_model, ref_opt, ref_scaler), (model, opt, scaler)):
        sc.scale(m(x).square().mean()).backward()
        sc.step(o)
        sc.update()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())
        want = q.grad if flavour == "apex" else q.grad * 1024.0
        torch.testing.assert_close(p.grad, want)
