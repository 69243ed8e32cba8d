"""GPU readiness on a CPU-only machine: launch options, table uploads, CUDA graph rules and write checks.

The Triton kernels are replaced by recorders (``fake_kernels``), so every launcher runs its real host code
(planning, address tables, uploads, checks) without executing a kernel: fast, and what matters here is the
host side. docs/kernels.md, "GPU readiness", states the contracts tested:

- every launch passes its kernel's pinned ``LAUNCH`` options (``enable_fp_fusion``, ``num_warps``);
- a table miss uploads once, from pinned memory, non-blocking (no host sync); a steady step over more than 64
  (parameter group x dtype) tables and mixed-dtype lists builds and copies nothing;
- during CUDA graph capture a table build raises, and a table used by the capture is held from the LRU;
- written rows that share memory are rejected before any launch, on every launcher path.

The same paths are run with ``torch.cuda.set_sync_debug_mode("error")`` where CUDA exists (skipped otherwise).
"""

from __future__ import annotations

import importlib
from collections import OrderedDict

import pytest
import torch

from fp16kit.kernels import copy_, exponent_histogram, l2norm, unscale_and_check
from fp16kit.kernels.engine import table as _table
from fp16kit.optim import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from fp16kit.optim.functional import adam_step_, lamb_step_

#: CPU tests take the Triton path (kernels faked below), not the torch fallback: that needs interpreter mode.
interpreter = pytest.mark.interpreter

MODULES = ["adagrad", "adam", "copy", "histogram", "l2norm", "lamb", "novograd", "sgd", "unscale"]
OPTIMIZERS = {
    FusedAdam: {"lr": 0.1},
    FusedLAMB: {"lr": 0.1, "max_grad_norm": 1.0},
    FusedSGD: {"lr": 0.1, "momentum": 0.9},
    FusedAdagrad: {"lr": 0.1},
    FusedNovoGrad: {"lr": 0.1},
}


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, name: str, launches: list) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.name, kwargs))


@pytest.fixture
def fake_kernels(monkeypatch) -> list[tuple[str, dict]]:
    """Every kernel of every module replaced by a recorder; fresh table caches. Returns the launch log."""
    launches: list[tuple[str, dict]] = []
    for name in MODULES:
        module = importlib.import_module(f"fp16kit.kernels.triton.{name}")
        for kernel in {key.removesuffix("_state8") for key in module.LAUNCH}:  # a _state8 key: a variant's options
            monkeypatch.setattr(module, kernel, _Recorder(kernel, launches))
    monkeypatch.setattr(_table, "_tables", OrderedDict())
    monkeypatch.setattr(_table, "_graph_tables", {})
    monkeypatch.setattr(_table, "_indices", {})
    return launches


@pytest.fixture
def counts(monkeypatch) -> dict[str, int]:
    """Counts of table builds, host-to-device uploads, and ``torch.tensor(..., device=...)`` calls (a pageable
    copy: a host sync on CUDA)."""
    seen = {"builds": 0, "uploads": 0, "tensor_with_device": 0}
    build, upload, tensor = _table._build, _table.upload, torch.tensor

    def counting_build(*args, **kwargs):
        seen["builds"] += 1
        return build(*args, **kwargs)

    def counting_upload(*args, **kwargs):
        seen["uploads"] += 1
        return upload(*args, **kwargs)

    def counting_tensor(*args, **kwargs):
        seen["tensor_with_device"] += kwargs.get("device") is not None
        return tensor(*args, **kwargs)

    monkeypatch.setattr(_table, "_build", counting_build)
    monkeypatch.setattr(_table, "upload", counting_upload)
    monkeypatch.setattr(torch, "tensor", counting_tensor)
    return seen


def _groups(n_groups: int, seed: int = 0) -> list[dict]:
    """``n_groups`` parameter groups of a fp32 and a bf16 parameter (two dtype tables each), grads set once."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for i in range(n_groups):
        params = [torch.nn.Parameter(torch.randn(40 + i, generator=gen)),
                  torch.nn.Parameter(torch.randn(30 + i, generator=gen).bfloat16())]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        groups.append({"params": params})
    return groups


def _every_launch_path() -> None:
    """One call of every public op and optimizer over a mixed-dtype list."""
    xs = [torch.randn(50), torch.randn(20).half(), torch.randn(30).bfloat16(), torch.randn(10)]
    unscale_and_check(xs, 0.5, torch.zeros(1), sq_norm=torch.zeros(1, dtype=torch.float64))
    l2norm(xs, per_tensor=True, found_inf=torch.zeros(1))
    copy_([torch.empty(50).half(), torch.empty(20)], [xs[0], xs[1]])
    exponent_histogram(xs)
    for cls, kwargs in OPTIMIZERS.items():
        cls(_groups(2), **kwargs).step()
    FusedNovoGrad(_groups(1), lr=0.1, norm_type=0).step()  # the inf-norm kernel
    novograd = FusedNovoGrad(_groups(1), lr=0.1)
    novograd.step()
    novograd.step()  # the device step (the first creates the state): its per-tensor moments kernel


@interpreter
def test_every_launch_passes_its_pinned_options(fake_kernels):
    _every_launch_path()
    pinned: dict[str, set[int]] = {}
    for name in MODULES:
        for key, options in importlib.import_module(f"fp16kit.kernels.triton.{name}").LAUNCH.items():
            assert options.get("enable_fp_fusion") is False, key
            # "<kernel>_state8": the same kernel's launch options with 8-bit moments (its QSTATE epilogue)
            pinned.setdefault(key.removesuffix("_state8"), set()).add(options["num_warps"])
    assert {name for name, _ in fake_kernels} == set(pinned), "some kernel was never launched by the paths above"
    for name, kwargs in fake_kernels:
        assert kwargs.get("enable_fp_fusion") is False, (name, kwargs)
        assert kwargs.get("num_warps") in pinned[name], (name, kwargs)


def test_table_upload_is_pinned_and_non_blocking(monkeypatch):
    """A table for a CUDA device is packed in pinned memory and copied with non_blocking=True, and the table keeps
    the pinned buffer (no CUDA here: ``pin_memory``/``to`` are recorded and stay on the CPU)."""
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin",)) or self)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        device = torch.device(args[0]) if args and isinstance(args[0], (str, torch.device)) else None
        if device is not None and device.type == "cuda":
            calls.append(("to", device.type, kwargs.get("non_blocking", False)))
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    lists = [[torch.zeros(5000), torch.zeros(7)], [torch.zeros(5000), torch.zeros(7)]]
    table = _table._build(lists, _table.BLOCK, torch.device("cuda"))
    assert calls == [("pin",), ("to", "cuda", True)]
    assert table.host is not None and table.host.numel() == table.ptrs.numel() + 3 * 2 + 2 * table.num_chunks


@interpreter
@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedSGD, FusedAdagrad, FusedNovoGrad])
def test_steady_step_over_many_tables_builds_and_copies_nothing(fake_kernels, counts, cls):
    """35 groups x 2 dtypes = 70 (group x dtype) tables, over the old 64-entry cache that missed every step;
    LAMB's clipping norm scatters a mixed-dtype list (an index upload on every call before). FusedNovoGrad's first
    step (it creates the state) takes the host-vector step: its device step's tables are built at the second."""
    opt = cls(_groups(35), **OPTIMIZERS[cls])
    opt.step()
    if cls is FusedNovoGrad:
        opt.step()
    assert counts["builds"] >= 70 and counts["uploads"] >= counts["builds"]
    for key in counts:
        counts[key] = 0
    opt.step()
    opt.step()
    assert counts == {"builds": 0, "uploads": 0, "tensor_with_device": 0}


@interpreter
def test_mixed_dtype_norm_uploads_its_index_once(fake_kernels, counts):
    xs = [torch.randn(50), torch.randn(20).half(), torch.randn(30), torch.randn(10).bfloat16()]
    l2norm(xs, per_tensor=True)
    first = dict(counts)
    assert first["tensor_with_device"] == 0 and first["uploads"] == first["builds"] + 3  # an index per dtype group
    l2norm(xs, per_tensor=True)
    assert counts == first


@pytest.fixture
def capturing(monkeypatch):
    """Pretend the current stream is being captured into a CUDA graph while ``state["on"]``."""
    state = {"on": False}
    monkeypatch.setattr(_table, "_capturing", lambda device: state["on"])
    monkeypatch.setattr(_table, "_tables", OrderedDict())
    monkeypatch.setattr(_table, "_graph_tables", {})
    monkeypatch.setattr(_table, "_indices", {})
    return state


def test_table_build_during_capture_raises(capturing):
    capturing["on"] = True
    with pytest.raises(RuntimeError, match=r"during CUDA graph capture.*eagerly before capturing"):
        _table.chunk_table([[torch.zeros(10)]])
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        _table.index_tensor([0, 2], torch.device("cpu"))


def test_tables_used_by_a_capture_are_held_from_the_lru(capturing, monkeypatch):
    """The eviction rule: the LRU keeps CACHE_SIZE tables; a table used during capture stays alive (the same
    object, its device memory not freed) however many tables come after, until release_graph_tables()."""
    monkeypatch.setattr(_table, "CACHE_SIZE", 2)
    held, free = [[torch.zeros(10)]], [[torch.zeros(11)]]
    held_table, free_table = _table.chunk_table(held), _table.chunk_table(free)
    capturing["on"] = True
    assert _table.chunk_table(held) is held_table  # used by the "graph"
    capturing["on"] = False
    others = [[[torch.zeros(12 + i)]] for i in range(3)]
    for lists in others:
        _table.chunk_table(lists)  # pushes both out of the 2-entry LRU
    assert _table.chunk_table(held) is held_table  # held: not rebuilt, still alive
    assert _table.chunk_table(free) is not free_table  # evicted: rebuilt
    assert _table.release_graph_tables() == 1
    for lists in others:
        _table.chunk_table(lists)
    assert _table.chunk_table(held) is not held_table  # released: evictable again


def _overlapping_calls():
    """Each launcher path given written tensors that share memory; the path's name and a call."""
    base = torch.zeros(20)

    def overlapping_params() -> list[torch.nn.Parameter]:
        a, b = torch.nn.Parameter(base[0:10]), torch.nn.Parameter(base[5:15])
        a.grad, b.grad = torch.ones(10), torch.ones(10)
        return [a, b]

    p, g, m = torch.zeros(10), torch.ones(10), torch.zeros(10)
    state = {"step": torch.zeros(1), "lr": 0.1}
    yield "unscale_and_check out", lambda: unscale_and_check([g, g.clone()], 1.0, torch.zeros(1), out=[p, p])
    yield "copy_ dst", lambda: copy_([p, p], [g, g.clone()])
    yield "adam_step_ params", lambda: adam_step_([p, p], [g, g], [m.clone(), m.clone()], [m.clone(), m.clone()],
                                                  **state)
    yield "lamb_step_ exp_avgs", lambda: lamb_step_([p, p.clone()], [g, g], [m, m], [m.clone(), m.clone()], **state)
    for cls, kwargs in OPTIMIZERS.items():
        yield f"{cls.__name__} params", lambda cls=cls, kwargs=kwargs: cls(overlapping_params(), **kwargs).step()


@interpreter
@pytest.mark.parametrize("path", [name for name, _ in _overlapping_calls()])
def test_every_launcher_path_rejects_shared_written_memory(fake_kernels, path):
    call = dict(_overlapping_calls())[path]
    with pytest.raises(ValueError, match=r"same memory as|overlaps"):
        call()
    writers = {"_unscale_kernel", "_copy_kernel", "_adam_kernel", "_lamb_stage1_kernel", "_lamb_stage2_kernel",
               "_sgd_kernel", "_adagrad_kernel", "_novograd_kernel"}
    assert not [name for name, _ in fake_kernels if name in writers], "a writing kernel was launched"


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled_triton")
def test_no_host_sync_on_any_launch_path_cuda(monkeypatch):
    """Cold (every table a miss) and warm steps over > 64 tables and mixed dtypes, under sync debug mode.
    Run on a GPU machine with ``TRITON_INTERPRET=0 pytest -m gpu`` (as tests/kernels/test_gpu.py)."""
    monkeypatch.setattr(_table, "_tables", OrderedDict())
    monkeypatch.setattr(_table, "_indices", {})
    dev = torch.device("cuda")
    xs = [torch.randn(5000, device=dev), torch.randn(300, device=dev).half(), torch.randn(70, device=dev).bfloat16()]
    outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    flag, sq = torch.zeros(1, device=dev), torch.zeros(1, dtype=torch.float64, device=dev)
    opts = []
    for cls, kwargs in OPTIMIZERS.items():
        groups = _groups(35 if cls in (FusedAdam, FusedLAMB) else 2)
        for g in groups:
            g["params"] = [torch.nn.Parameter(p.detach().to(dev)) for p in g["params"]]
            for p in g["params"]:
                p.grad = torch.randn_like(p)
        opts.append(cls(groups, **kwargs))
    for opt in opts:
        opt.step()  # creates the optimizer state and its constants (not a launch path)
    # Cold: every table a miss (an empty cache, fresh gradient buffers), then warm.
    monkeypatch.setattr(_table, "_tables", OrderedDict())
    monkeypatch.setattr(_table, "_indices", {})
    for opt in opts:
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            unscale_and_check(xs, 0.5, flag, out=outs, sq_norm=sq)
            l2norm(xs, per_tensor=True, found_inf=flag)
            copy_([torch.empty_like(x) for x in xs], xs)
            for opt in opts:
                opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
