"""FSDP2 (DTensor ``Shard(0)`` params, ``fully_shard``) with the bf16 modes without fp32 masters, on 2 gloo processes
(``_spawn.py``), with the torch fallback and, under ``TRITON_INTERPRET=1``, the Triton kernels (interpreter):

* ``master_weights="split"``, FusedLAMB: the sharded stages (stage 1, the all-reduce of the partial norms, stage 2)
  with the split epilogue step every shard's reassembled masters bit for bit as ``master_weights=True`` on the same
  shards, every step (trust ratio and clipping on); with elementwise LAMB (no trust ratio, no clipping) the
  shards are also the one-process split and ``True`` results bit for bit.
* ``master_weights="stochastic"``, FusedAdam and elementwise FusedLAMB: every rank draws the one-process bits (each
  shard's first element's index in its param, the one-process rows), so the sharded params are the one-process
  stochastic params bit for bit, over 3 steps with a skipped one (an inf grad in rank 1's shard).
* split with 8-bit moments (``state_bits=8``), FusedAdam and FusedLAMB: shards of the whole tensors' 8-bit blocks;
  masters, params, codes and absmax bit for bit those of ``master_weights=True`` with 8-bit moments.
* stochastic FusedLAMB with the trust ratio (whose sharded norms round otherwise than one process's): each step
  rounds the fp32 values of a ``master_weights=True`` run started from the same params and moments with exactly
  the bits one process draws for them (``stochastic_round_list`` over the whole tensors).

The params: odd shapes, so the shards start inside a Philox counter's 8 elements, one whose rank-1 shard is empty
(``(1, 7)``), and an fp32 param between bf16 ones (updated directly; the kernel group is then not the whole list).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 3
INF_STEP = 1
SHAPES = ((37, 5), (300,), (11,), (5,), (1, 7))
FP32 = 2  # the index of the fp32 param
SEED = 1234
LAMB_FULL = {"lr": 1e-2, "weight_decay": 0.01, "max_grad_norm": 1.0}
LAMB_ELEMENTWISE = {"lr": 1e-2, "weight_decay": 0.0, "max_grad_norm": 0.0}  # no trust ratio, no clipping
ADAM = {"lr": 1e-2, "weight_decay": 0.01}


def _inits() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(torch.float32 if i == FP32 else torch.bfloat16)
            for i, s in enumerate(SHAPES)]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    grads = [(torch.randn(s, generator=g) * 3.0).to(torch.float32 if i == FP32 else torch.bfloat16)
             for i, s in enumerate(SHAPES)]
    if step == INF_STEP:
        grads[1][-1] = float("inf")  # in rank 1's shard only
    return grads


def _fsdp_params(mesh) -> list[torch.nn.Parameter]:
    from torch.distributed.fsdp import fully_shard

    module = torch.nn.Module()
    for i, t in enumerate(_inits()):
        module.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))
    fully_shard(module, mesh=mesh)
    return list(module.parameters())


def _set_grads(sharded: list, plain: list | None, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for i, g in enumerate(_grads(step)):
        sharded[i].grad = distribute_tensor(g.clone(), sharded[i].device_mesh, sharded[i].placements)
        if plain is not None:
            plain[i].grad = g.clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


def _full(params: list) -> list[torch.Tensor]:
    return [p.detach().full_tensor() for p in params]


def _split_lamb(mesh) -> dict:
    """FSDP2 split FusedLAMB against FSDP2 ``True`` (full LAMB) and against one process (elementwise LAMB)."""
    from fp16kit.optim import FusedLAMB

    out = {}
    split, ref = _fsdp_params(mesh), _fsdp_params(mesh)
    split_opt = FusedLAMB(split, master_weights="split", on_nonfinite="skip", **LAMB_FULL)
    ref_opt = FusedLAMB(ref, master_weights=True, on_nonfinite="skip", **LAMB_FULL)
    same = []
    for step in range(STEPS):
        _set_grads(split, None, step)
        _set_grads(ref, None, step)
        split_opt.step()
        ref_opt.step()
        masters = split_opt.split_masters()  # local: the reassembled master of each bf16 shard, fp32 params as such
        refs = [ref_opt.state[q]["master"].to_local() if q.dtype == torch.bfloat16 else q.to_local() for q in ref]
        same.append(_same(masters, refs) and _same([p.to_local() for p in split], [q.to_local() for q in ref]))
    out["full_vs_true"] = same
    out["full_step"] = [float(g["step"]) for g in split_opt.param_groups]
    out["all_reduces"] = split_opt._shard_plan.all_reduces  # grad norm + flag, then the trust-ratio norms

    sharded = _fsdp_params(mesh)
    one = [torch.nn.Parameter(t.clone()) for t in _inits()]
    one_true = [torch.nn.Parameter(t.clone()) for t in _inits()]
    opts = [FusedLAMB(ps, master_weights=m, on_nonfinite="skip", **LAMB_ELEMENTWISE)
            for ps, m in ((sharded, "split"), (one, "split"), (one_true, True))]
    same = []
    for step in range(STEPS):
        _set_grads(sharded, one, step)
        for p, q in zip(one, one_true):
            q.grad = p.grad.clone()
        for opt in opts:
            opt.step()
        same.append(_same(_full(sharded), [p.detach() for p in one])
                    and _same(_full(sharded), [p.detach() for p in one_true]))
    out["elementwise_vs_one_process"] = same
    return out


def _stochastic_vs_one_process(mesh, cls, cfg: dict) -> list[bool]:
    sharded = _fsdp_params(mesh)
    one = [torch.nn.Parameter(t.clone()) for t in _inits()]
    opts = [cls(ps, master_weights="stochastic", rounding_seed=SEED, on_nonfinite="skip", **cfg)
            for ps in (sharded, one)]
    same = []
    for step in range(STEPS):
        _set_grads(sharded, one, step)
        before = _full(sharded)
        for opt in opts:
            opt.step()
        moved = not _same(_full(sharded), before)
        same.append(_same(_full(sharded), [p.detach() for p in one]) and moved == (step != INF_STEP))
    same.append([float(g["step"]) for g in opts[0].param_groups] == [STEPS - 1.0])
    return same


def _stochastic_lamb_draws(mesh) -> list[bool]:
    """Stochastic FusedLAMB with the trust ratio: a ``True`` run given the stochastic run's params and moments before
    each step computes the same fp32 values; the stochastic params are those rounded with the one-process bits."""
    from fp16kit.kernels.bf16_weights.modes import stochastic_round_list
    from fp16kit.optim import FusedLAMB

    sto, mst = _fsdp_params(mesh), _fsdp_params(mesh)
    sto_opt = FusedLAMB(sto, master_weights="stochastic", rounding_seed=SEED, on_nonfinite="skip", **LAMB_FULL)
    mst_opt = FusedLAMB(mst, master_weights=True, on_nonfinite="skip", **LAMB_FULL)
    same = []
    for step in range(STEPS):
        if step:  # the True run restarted from the stochastic run's state
            for p, q in zip(sto, mst):
                q.detach().to_local().copy_(p.detach().to_local())
                a, b = sto_opt.state[p], mst_opt.state[q]
                for key in ("exp_avg", "exp_avg_sq"):
                    b[key].to_local().copy_(a[key].to_local())
                if "master" in b:
                    b["master"].to_local().copy_(p.detach().to_local().float())
        _set_grads(sto, None, step)
        _set_grads(mst, None, step)
        before = _full(sto)
        sto_opt.step()
        mst_opt.step()
        x = [mst_opt.state[q]["master"].full_tensor() if q.dtype == torch.bfloat16 else q.detach().full_tensor()
             for q in mst]
        rows = [i for i, q in enumerate(mst) if q.dtype == torch.bfloat16]
        step_no = sto_opt.param_groups[0]["step"]
        want = list(x)
        for i, r in zip(rows, stochastic_round_list([x[i] for i in rows], SEED, rows, 0, step_no)):
            want[i] = r
        if step == INF_STEP:
            want = before  # skipped: nothing written
        same.append(_same(_full(sto), want))
    return same


#: 8-bit moments on FSDP2 shards: (64, 256) and (40, 256) shard into 8192 and 5120 elements starting at multiples of
#: 256 (the whole tensor's blocks, 8-bit); (11,) keeps fp32 moments.
SHAPES8 = ((64, 256), (40, 256), (11,))


def _split_8bit(mesh, cls, cfg: dict) -> list[bool]:
    """split + 8-bit moments on FSDP2 shards against ``master_weights=True`` + 8-bit on the same shards: masters,
    params and every shared state tensor (codes, absmax, fp32 moments) bit for bit, each step (one skipped)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from fp16kit.kernels import split_halves

    def params() -> list:
        gen = torch.Generator().manual_seed(3)
        module = torch.nn.Module()
        for i, shape in enumerate(SHAPES8):
            module.register_parameter(f"p{i}", torch.nn.Parameter(torch.randn(shape, generator=gen).bfloat16()))
        fully_shard(module, mesh=mesh)
        return list(module.parameters())

    def raw(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.detach().contiguous().reshape(-1).view(torch.uint8)

    split, ref = params(), params()
    opts = [cls(ps, master_weights=m, state_bits=8, on_nonfinite="skip", **cfg)
            for ps, m in ((split, "split"), (ref, True))]
    same = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(200 + step)
        grads = [(torch.randn(shape, generator=gen) * 3.0).bfloat16() for shape in SHAPES8]
        if step == INF_STEP:
            grads[0][-1, -1] = float("inf")  # in rank 1's shard only
        for ps in (split, ref):
            for p, g in zip(ps, grads):
                p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements)
        for opt in opts:
            opt.step()
        masters = opts[0].split_masters()
        refs = [opts[1].state[q]["master"].to_local() for q in ref]
        states = all(
            torch.equal(raw(a[key]), raw(b[key]))
            for a, b in ((opts[0].state[p], opts[1].state[q]) for p, q in zip(split, ref))
            for key in a.keys() & b.keys() if isinstance(a[key], torch.Tensor) and key != "step"
        )
        his = [split_halves(m)[0] for m in refs]  # the params: the masters' high halves (ties away from zero)
        same.append(_same(masters, refs) and _same([p.to_local() for p in split], his) and states)
    eight = [opts[0].state[p]["exp_avg"].dtype == torch.uint8 for p in split]
    same.append(eight == [True, True, False])
    return same


def _refusal(mesh) -> str | None:
    """A shard that is not a contiguous range of its param (``Shard(1)``): stochastic rounding refuses it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from fp16kit.optim import FusedAdam

    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6, dtype=torch.bfloat16), mesh, [Shard(1)]))
    p.grad = distribute_tensor(torch.ones(4, 6, dtype=torch.bfloat16), mesh, [Shard(1)])
    try:
        FusedAdam([p], master_weights="stochastic", rounding_seed=1).step()
    except NotImplementedError as e:
        return str(e)
    return None


def _job(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fp16kit.kernels import use_backend
    from fp16kit.kernels.backend import interpreter_active, triton_available
    from fp16kit.optim import FusedAdam, FusedLAMB

    mesh = init_device_mesh("cpu", (world,))
    backends = ["torch"] + (["auto"] if triton_available() and interpreter_active() else [])
    out = {"backends": backends}
    for backend in backends:
        with use_backend(backend):
            out[backend] = {
                "split_lamb": _split_lamb(mesh),
                "stochastic_adam": _stochastic_vs_one_process(mesh, FusedAdam, ADAM),
                "stochastic_lamb": _stochastic_vs_one_process(mesh, FusedLAMB, LAMB_ELEMENTWISE),
                "stochastic_lamb_draws": _stochastic_lamb_draws(mesh),
                "split_8bit_adam": _split_8bit(mesh, FusedAdam, ADAM),
                "split_8bit_lamb": _split_8bit(mesh, FusedLAMB, LAMB_FULL),
            }
    out["refusal"] = _refusal(mesh)
    torch.save(out, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import _spawn

    out = tmp_path_factory.mktemp("bf16_fsdp2")
    _spawn.run(_job, 2, out, timeout=400)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _each(ranks):
    from fp16kit.kernels.backend import interpreter_active, triton_available

    for res in ranks:  # the ranks inherit TRITON_INTERPRET: under it they run the Triton kernels too
        assert res["backends"] == ["torch"] + (["auto"] if triton_available() and interpreter_active() else [])
        for backend in res["backends"]:
            yield backend, res[backend]


def test_fsdp2_split_lamb_equals_fp32_masters_bit_for_bit(ranks):
    for backend, res in _each(ranks):
        split = res["split_lamb"]
        assert split["full_vs_true"] == [True] * STEPS, backend
        assert split["full_step"] == [STEPS - 1.0], backend  # the inf on rank 1 skipped both ranks
        assert split["all_reduces"] == 2, backend
        assert split["elementwise_vs_one_process"] == [True] * STEPS, backend


@pytest.mark.parametrize("name", ["stochastic_adam", "stochastic_lamb"])
def test_fsdp2_stochastic_equals_one_process_bit_for_bit(ranks, name):
    for backend, res in _each(ranks):
        assert res[name] == [True] * (STEPS + 1), (backend, name)


def test_fsdp2_stochastic_lamb_with_trust_ratio_draws_the_one_process_bits(ranks):
    for backend, res in _each(ranks):
        assert res["stochastic_lamb_draws"] == [True] * STEPS, backend


def test_stochastic_refuses_shards_that_are_not_contiguous_ranges(ranks):
    for res in ranks:
        assert res["refusal"] is not None and "contiguous range" in res["refusal"], res["refusal"]


@pytest.mark.parametrize("name", ["split_8bit_adam", "split_8bit_lamb"])
def test_fsdp2_split_with_8bit_moments_equals_fp32_masters_with_8bit_moments(ranks, name):
    for backend, res in _each(ranks):
        assert res[name] == [True] * (STEPS + 1), (backend, name)
