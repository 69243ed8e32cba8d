"""Trust, round 4: optimizer state and hyper-parameters. One regression test (or a few) per defect, each failing on
the code before its fix: 8-bit moments on non-contiguous tensors, the functional API's square guard, 8-bit state
through ``torch.save``, absurd hyper-parameters, shared step counters, step counters past ``2**31``, and the smaller
promises (docs/guarantees.md, "Optimizer state and hyper-parameters (round 4)")."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fp16kit.kernels import use_backend
from fp16kit.optim import FusedAdam, FusedLAMB

OPT8 = {"adam": FusedAdam, "lamb": FusedLAMB}


# ---------------------------------------------------------------------------------------------------------------
# 1. 8-bit moments on non-contiguous params, grads and model copies


def _conv_net(channels_last: bool, dtype: torch.dtype) -> nn.Module:
    """A conv weight of 32 * 16 * 3 * 3 = 4608 elements (8-bit moments; channels_last makes it non-contiguous), a
    transposed linear weight of 4096 (non-contiguous), and small tensors (fp32 moments)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 32, 3), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 8, 4, bias=False))
    with torch.no_grad():
        net.add_module("proj", nn.Linear(64, 64, bias=False))
        net[3].weight.mul_(0.1)
    net = net.to(dtype)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
        w = net.proj.weight
        net.proj.weight = nn.Parameter(w.detach().t().contiguous().t())  # the same values, transposed strides
    return net


def _train_conv(kind: str, layouts: tuple[tuple[bool, str], ...], dtype: torch.dtype = torch.float32, steps: int = 3,
                **kw):
    """Nets ``(channels_last?, backend)`` stepped side by side on the same gradients (the first net's, copied into
    grads laid out like each param, as a channels_last backward makes them): ``(nets, optimizers, losses)``."""
    nets = [_conv_net(strided, dtype) for strided, _ in layouts]
    master = dtype != torch.float32
    opts = [OPT8[kind](n.parameters(), lr=0.01, weight_decay=0.01, state_bits=8, master_weights=master, **kw)
            for n in nets]
    x = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    losses = []
    for _ in range(steps):
        for o in opts:
            o.zero_grad()
        net = nets[0]
        loss = (net[:4](x).float() ** 2).mean() + (net.proj.weight.float().sum(0) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        for other in nets[1:]:
            for p, q in zip(net.parameters(), other.parameters()):
                q.grad = torch.empty_like(q).copy_(p.grad)
        for o, (_, backend) in zip(opts, layouts):
            with use_backend(backend):
                o.step()
    for n, (strided, _) in zip(nets, layouts):
        assert n[0].weight.is_contiguous() != strided and n.proj.weight.is_contiguous() != strided
    return nets, opts, losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "o2_bf16"])
@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item1_state8_non_contiguous_rows_equal_the_contiguous_run(kind, dtype):
    """channels_last conv weight and transposed weight (fp32), and the same as bf16 model copies of fp32 masters
    (amp O2's layout): params, masters, codes and absmax bit for bit the contiguous run's (the torch backend)."""
    (want, got), (want_opt, got_opt), losses = _train_conv(kind, ((False, "torch"), (True, "torch")), dtype)
    assert losses[-1] < losses[0]
    for a, b in zip(got.parameters(), want.parameters()):
        assert torch.equal(a, b)
        sa, sb = got_opt.state[a], want_opt.state[b]
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    assert got_opt.state[got[0].weight]["exp_avg"].dtype == torch.uint8
    assert got_opt.state[got.proj.weight]["exp_avg"].dtype == torch.uint8


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item1_state8_non_contiguous_rows_under_the_interpreter(kind):
    """Under the Triton interpreter the non-contiguous rows are stepped by the torch implementation (the planner's
    rule for every layout the kernels do not take): bit for bit the contiguous run of that implementation on the same
    gradients (the small rows run the kernels). LAMB without clipping: the global gradient norm is each backend's own
    sum (its rounding differs)."""
    kw = {"max_grad_norm": 0.0} if kind == "lamb" else {}
    (want, got), _, _ = _train_conv(kind, ((False, "torch"), (True, "auto")), steps=2, **kw)
    for name in ("0.weight", "proj.weight"):
        a, b = (dict(m.named_parameters())[name] for m in (got, want))
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------------------
# 2. The functional API's square guard


def _functional_rows(n: int = 5):
    p = torch.linspace(-1, 1, n)
    g = torch.full((n,), 0.5)
    g[2] = 1e25  # finite, but its square overflows fp32: v would become inf
    return [p], [g], [torch.zeros(n)], [torch.zeros(n)]


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("fn", ["adam", "lamb"])
def test_item2_functional_steps_skip_a_grad_whose_square_overflows(fn, backend):
    """``adam_step_`` and ``lamb_step_(max_grad_norm=0)`` skip a finite grad of 1e25 as FusedAdam does: the flag is
    raised, nothing is written (no inf in exp_avg_sq), the step counter stays."""
    from fp16kit.optim import adam_step_, lamb_step_

    params, grads, ms, vs = _functional_rows()
    before = params[0].clone()
    step = torch.zeros(1)
    with use_backend(backend):
        if fn == "adam":
            flag = adam_step_(params, grads, ms, vs, step=step, lr=0.1)
        else:
            flag = lamb_step_(params, grads, ms, vs, step=step, lr=0.1, max_grad_norm=0.0)
    assert float(flag) == 1.0
    assert torch.equal(params[0], before) and float(step) == 0.0
    assert torch.equal(vs[0], torch.zeros(5)) and torch.equal(ms[0], torch.zeros(5))
    p = torch.nn.Parameter(before.clone())
    p.grad = grads[0].clone()
    opt = (FusedAdam([p], lr=0.1) if fn == "adam" else FusedLAMB([p], lr=0.1, max_grad_norm=0.0))
    opt.on_nonfinite = "skip"
    with use_backend(backend):
        opt.step()
    assert torch.equal(p, before) and float(opt.param_groups[0]["step"]) == 0.0
    # below the guard (|g| < 2**63) the functional step runs, as FusedAdam's does
    params, grads, ms, vs = _functional_rows()
    grads[0][2] = 1e18
    with use_backend(backend):
        flag = adam_step_(params, grads, ms, vs, step=step, lr=0.1)
    assert float(flag) == 0.0 and float(step) == 1.0 and bool(torch.isfinite(vs[0]).all())


# ---------------------------------------------------------------------------------------------------------------
# 3. 8-bit state through torch.save to a file and torch.load(weights_only=True)


def _rows8(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((4096 + 300,), (7, 5))]


def _steps(opt, params, start: int, stop: int) -> None:
    for k in range(start, stop):
        g = torch.Generator().manual_seed(100 + k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _make8(kind: str, params, mode):
    return OPT8[kind](params, lr=0.01, weight_decay=0.01, state_bits=8, master_weights=mode,
                      **({"rounding_seed": 7} if mode == "stochastic" else {}))


@pytest.mark.parametrize("mode", [False, True, "split", "stochastic"], ids=["fp32", "master", "split", "stochastic"])
@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item3_state8_resumes_through_torch_save_and_weights_only_load(kind, mode, tmp_path):
    """FusedAdam and FusedLAMB, 8-bit moments (a ragged 8-bit tensor and a small fp32-moment one), fp32 params and
    bf16 params with fp32 masters, split and stochastic: two steps, ``torch.save`` of the state_dict to a file,
    ``torch.load(weights_only=True)`` into a new optimizer, two more steps: bit for bit the uninterrupted run."""
    dtype = torch.float32 if mode is False else torch.bfloat16
    want = _rows8(dtype)
    want_opt = _make8(kind, want, mode)
    _steps(want_opt, want, 0, 4)

    first = _rows8(dtype)
    opt = _make8(kind, first, mode)
    _steps(opt, first, 0, 2)
    torch.save({"model": [p.detach() for p in first], "optim": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    got = [torch.nn.Parameter(t.clone()) for t in saved["model"]]
    resumed = _make8(kind, got, mode)
    resumed.load_state_dict(saved["optim"])
    assert resumed.state[got[0]]["exp_avg"].dtype == torch.uint8
    _steps(resumed, got, 2, 4)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(got, want):
        sa, sb = resumed.state[a], want_opt.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.slow  # ~6 s of Trainer set-up and checkpoint writes (the default suite's budget); the mechanism is the
# torch.save test above
def test_item3_hf_trainer_checkpoint_resume_with_an_8bit_optimizer(tmp_path):
    """The stock ``transformers.Trainer`` saves an 8-bit FusedAdam's state at every step (``save_steps=1``) and a fresh
    Trainer resumes from the first checkpoint (``resume_from_checkpoint``) to the uninterrupted run's weights."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "integrations"))
    from hf_helpers import MaskedLMData
    from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

    class Ordered(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    def trainer(out: str) -> Trainer:
        torch.manual_seed(0)
        config = BertConfig(vocab_size=160, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=37, max_position_embeddings=16, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        model = BertForMaskedLM(config)  # word embeddings 160 x 32: 8-bit moments
        args = TrainingArguments(output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=2,
                                 save_steps=1, save_strategy="steps", report_to=[], use_cpu=True, disable_tqdm=True,
                                 learning_rate=1e-2, seed=0, logging_steps=1)
        opt = FusedAdam(model.parameters(), lr=1e-2, state_bits=8)
        return Ordered(model=model, args=args, train_dataset=MaskedLMData(n=16), optimizers=(opt, None))

    whole = trainer("a")
    whole.train()
    emb = whole.model.bert.embeddings.word_embeddings.weight
    assert whole.optimizer.state[emb]["exp_avg"].dtype == torch.uint8
    resumed = trainer("b")
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------------
# 4. Absurd hyper-parameters


# (key, value, other constructor arguments): beyond float32, or a step size formed from them beyond it
ABSURD = [("lr", 1e39, {}), ("lr", 3e38, {}), ("weight_decay", 1e300, {}), ("weight_decay", 1e39, {}),
          ("weight_decay", 1e36, {"lr": 1e3}), ("eps", 1e39, {})]


def _small_opt(kind: str, **kw):
    p = torch.nn.Parameter(torch.linspace(-1, 1, 6))
    p.grad = torch.full((6,), 0.25)
    return p, OPT8[kind]([p], **kw)


@pytest.mark.parametrize(
    "kind,key,value,kw", [(k, *kv) for k in sorted(OPT8) for kv in ABSURD] + [("lamb", "max_grad_norm", 1e39, {})]
)
def test_item4_absurd_hyperparameters_raise_everywhere(kind, key, value, kw):
    """At construction, after a hand edit of ``param_groups`` (at the step, before anything is written), and in
    ``load_state_dict`` (nothing changes): a ValueError naming the key and float32's range."""
    with pytest.raises(ValueError, match=rf"{key}|lr"):
        _small_opt(kind, **kw, **{key: value})
    p, opt = _small_opt(kind, **kw)
    before = p.detach().clone()
    sd = opt.state_dict()
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=r"float32"):
        opt.step()
    assert torch.equal(p, before) and float(opt.param_groups[0].get("step", 0)) == 0
    opt.param_groups[0][key] = sd["param_groups"][0][key]
    opt.step()
    bad = {**sd, "param_groups": [{**sd["param_groups"][0], key: value}]}
    good = opt.state_dict()
    with pytest.raises(ValueError, match=r"float32"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0][key] == good["param_groups"][0][key]
    assert bool(torch.isfinite(p).all())


@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item4_a_scheduler_that_drives_lr_past_float32_is_refused_at_the_step(kind):
    p, opt = _small_opt(kind, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1e42 if step >= 1 else 1.0)
    opt.step()
    sched.step()
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"lr.*float32"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item4_a_float64_tensor_lr_beyond_float32_skips_on_the_device(kind):
    p, opt = _small_opt(kind, lr=torch.tensor(1e39, dtype=torch.float64), on_nonfinite="skip")
    before = p.detach().clone()
    opt.step()
    assert torch.equal(p, before) and int(opt.hparam_skips) == 1


# ---------------------------------------------------------------------------------------------------------------
# 5. Every group owns its step counter


def _every_optimizer():
    from fp16kit.optim import FusedAdagrad, FusedMixedPrecisionLamb, FusedNovoGrad, FusedSGD

    return {"adam": FusedAdam, "lamb": FusedLAMB, "sgd": FusedSGD, "adagrad": FusedAdagrad,
            "novograd": FusedNovoGrad, "mixed_lamb": FusedMixedPrecisionLamb}


ALL_OPTS = ["adam", "lamb", "sgd", "adagrad", "novograd", "mixed_lamb"]


def _grads(*params):
    for p in params:
        p.grad = torch.full_like(p, 0.1)


def _steps_of(opt) -> list[float]:
    return [float(g["step"].reshape(-1)[0]) if isinstance(g["step"], torch.Tensor) else float(g["step"])
            for g in opt.param_groups]


@pytest.mark.parametrize("name", ALL_OPTS)
def test_item5_a_group_copied_from_another_owns_its_step_counter(name):
    """``add_param_group`` of a dict copied from group 0 (its step tensor included); groups that share one tensor at
    construction; a state_dict loaded into a second optimizer; a counter assigned by hand from another group: each
    group advances its own counter only."""
    cls = _every_optimizer()[name]
    a, b, c = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    opt = cls([a], lr=0.01)
    _grads(a)
    opt.step()
    copied = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    opt.add_param_group({**copied, "params": [b]})
    _grads(a, b)
    for _ in range(4):
        opt.step()
    assert _steps_of(opt) == [5.0, 5.0]  # group 1 started from the copied count (1), and only its own steps
    assert opt.param_groups[0]["step"] is not opt.param_groups[1]["step"]

    twin = cls([{"params": [torch.nn.Parameter(torch.ones(3))]}, {"params": [torch.nn.Parameter(torch.ones(3))]}],
               lr=0.01)
    twin.load_state_dict(opt.state_dict())
    for p in (q for g in twin.param_groups for q in g["params"]):
        p.grad = torch.full_like(p, 0.1)
    twin.step()
    assert _steps_of(twin) == [6.0, 6.0] and _steps_of(opt) == [5.0, 5.0]

    shared = torch.full((1,), 2.0)
    both = cls([{"params": [a], "step": shared}, {"params": [c], "step": shared}], lr=0.01)
    _grads(a, c)
    both.step()
    both.param_groups[1]["step"] = both.param_groups[0]["step"]  # by hand
    both.step()
    assert _steps_of(both) == [4.0, 4.0]


# ---------------------------------------------------------------------------------------------------------------
# 7d. When a group's counter advances: only on a step (not skipped) in which one of its params has a gradient


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize("name", ALL_OPTS)
def test_item7d_a_group_without_grads_keeps_its_counter(name, backend):
    """torch's rule per group: group 1's params have no grad for three steps, so its counter stays 0 while group 0's
    counts 3 (host-vector step on the torch backend; the device step under the interpreter); a step with no grad
    anywhere moves nothing."""
    cls = _every_optimizer()[name]
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = cls([{"params": [a]}, {"params": [b]}], lr=0.01)
    with use_backend(backend):
        opt.step()  # no grad anywhere
        assert all(float(g.get("step", 0)) == 0 for g in opt.param_groups)
        _grads(a)
        for _ in range(3):
            opt.step()
        assert _steps_of(opt) == [3.0, 0.0]
        _grads(b)
        opt.step()
    assert _steps_of(opt) == [4.0, 1.0]


def test_item7d_frozen_then_trained_param_matches_torch_adamw():
    """The rule is torch's for a group whose params share their grad pattern: a param frozen for three steps then
    trained takes its first bias correction (t = 1), as ``torch.optim.AdamW``'s per-param counter does."""
    ours_p = [torch.nn.Parameter(torch.linspace(-1, 1, 5)) for _ in range(2)]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = FusedAdam([{"params": [ours_p[0]]}, {"params": [ours_p[1]]}], lr=0.1, weight_decay=0.01)
    ref = torch.optim.AdamW([{"params": [ref_p[0]]}, {"params": [ref_p[1]]}], lr=0.1, weight_decay=0.01,
                            foreach=False)
    for k in range(5):
        for ps in (ours_p, ref_p):
            ps[0].grad = torch.linspace(0.1, 0.5, 5) * (k + 1)
            ps[1].grad = None if k < 3 else torch.linspace(-0.3, 0.2, 5)
        ours.step()
        ref.step()
    for a, b in zip(ours_p, ref_p):  # a few fp32 ulps of the largest weight (the rounding orders differ)
        atol = 8 * torch.finfo(torch.float32).eps * float(b.detach().abs().max())
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


# ---------------------------------------------------------------------------------------------------------------
# 6. Step counters past 2**31 (from a checkpoint)


def _resumed_at(name: str, step: float, backend: str, host_vector: bool = False, **kw) -> torch.Tensor:
    cls = _every_optimizer()[name]
    dtype = torch.bfloat16 if kw.get("master_weights") == "stochastic" else torch.float32
    p = torch.nn.Parameter(torch.linspace(-1, 1, 7).to(dtype))
    opt = cls([p], lr=0.01, **kw)
    if host_vector:  # the kernels with the host's float64 hyper-parameter vector instead of the device step
        opt._on_device = lambda device: False
    p.grad = torch.linspace(0.3, -0.2, 7).to(dtype)
    opt.step()  # the state exists; then the checkpoint's counter
    sd = opt.state_dict()
    sd["param_groups"][0]["step"] = torch.tensor([step], dtype=torch.float32)
    opt.load_state_dict(sd)
    with use_backend(backend):
        for _ in range(2):
            opt.step()
    return p.detach().float().clone()


@pytest.mark.interpreter
@pytest.mark.parametrize("name,kw", [(n, {}) for n in ALL_OPTS] + [
    (n, {"master_weights": "stochastic", "rounding_seed": 3}) for n in ("adam", "lamb")])
def test_item6_step_counter_past_2_31_agrees_across_backends(name, kw):
    """A checkpoint's counter of 2**31 + 5: the device step under the interpreter (the kernels derive the bias
    corrections and stochastic rounding's counter word from it in 64-bit integers) gives the torch backend's
    weights within a few fp32 ulps, finite; stochastic bf16 writes draw the same bits as the kernels' host-vector
    step, which takes the counter from the host (bit for bit)."""
    big = float(2**31 + 5)
    got = _resumed_at(name, big, "auto", **kw)
    assert bool(torch.isfinite(got).all())
    if "master_weights" in kw:
        assert torch.equal(got, _resumed_at(name, big, "auto", host_vector=True, **kw))
    else:
        want = _resumed_at(name, big, "torch", **kw)
        torch.testing.assert_close(got, want, rtol=0, atol=8 * torch.finfo(torch.float32).eps)


# ---------------------------------------------------------------------------------------------------------------
# 7. The smaller promises


@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item7a_torch_compile_of_an_8bit_step_raises_not_implemented(kind):
    """``torch.compile(opt.step)`` with ``state_bits=8`` raises the documented NotImplementedError (Dynamo runs a frame
    that raises while traced eagerly: the eager step under torch.compile raises too), and nothing was made or
    written; the eager step afterwards runs."""
    p = torch.nn.Parameter(torch.linspace(-1, 1, 4096))
    p.grad = torch.full_like(p, 0.5)
    opt = OPT8[kind]([p], lr=0.01, state_bits=8)
    before = p.detach().clone()
    torch._dynamo.reset()
    with pytest.raises(NotImplementedError, match=r"torch\.compile of a state_bits=8 step"):
        torch.compile(opt.step)()
    assert torch.equal(p, before) and not opt.state[p]
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.uint8 and not torch.equal(p, before)


@pytest.mark.parametrize("seed", [None, "abc", 2**64 + 5, -1, 2**63, True, 1.5])
@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item7b_rounding_seed_is_validated_at_construction_load_and_step(kind, seed):
    p = torch.nn.Parameter(torch.linspace(-1, 1, 6).bfloat16())
    p.grad = torch.full_like(p, 0.5)
    if seed is not None:
        with pytest.raises(ValueError, match="rounding_seed"):
            OPT8[kind]([p], lr=0.01, master_weights="stochastic", rounding_seed=seed)
    opt = OPT8[kind]([p], lr=0.01, master_weights="stochastic", rounding_seed=5)
    sd = opt.state_dict()
    bad = {**sd, "param_groups": [{**sd["param_groups"][0], "rounding_seed": seed}]}
    with pytest.raises(ValueError, match="rounding_seed"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["rounding_seed"] == 5
    opt.param_groups[0]["rounding_seed"] = seed
    before = p.detach().clone()
    with pytest.raises(ValueError, match="rounding_seed"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", [0, 2**63 - 1])
def test_item7b_valid_seeds_draw_the_same_bits_on_both_backends(seed):
    def run(backend):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 9).bfloat16())
        opt = FusedAdam([p], lr=0.01, master_weights="stochastic", rounding_seed=seed)
        with use_backend(backend):
            for _ in range(2):
                p.grad = torch.linspace(0.3, -0.2, 9).bfloat16()
                opt.step()
        return p.detach()

    assert torch.equal(run("torch"), run("auto"))


@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item7c_a_negative_absmax_in_a_checkpoint_is_refused_at_load(kind, tmp_path):
    p = torch.nn.Parameter(torch.linspace(-1, 1, 4096))
    p.grad = torch.linspace(0.5, -0.5, 4096)
    opt = OPT8[kind]([p], lr=0.01, state_bits=8)
    opt.step()
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    sd = torch.load(tmp_path / "o.pt", weights_only=True)
    sd["state"][0]["exp_avg_absmax"][3] *= -1  # exp_avg: no later check would see its block's flipped signs
    kept = opt.state[p]["exp_avg"].clone()
    with pytest.raises(ValueError, match=r"exp_avg_absmax.*negative"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[p]["exp_avg"], kept)


@pytest.mark.parametrize("mode", ["split", "stochastic"])
@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item7f_a_bf16_mode_without_bf16_params_is_refused(kind, mode):
    """The choice: refuse (ValueError naming the fix) when no param is bf16, since the mode would do nothing; fp32
    params beside bf16 ones stay accepted (updated directly)."""
    with pytest.raises(ValueError, match=r"no param is\s+bfloat16.*model.to\(torch.bfloat16\)"):
        OPT8[kind]([torch.nn.Parameter(torch.ones(3))], master_weights=mode)
    mixed = [torch.nn.Parameter(torch.ones(3).bfloat16()), torch.nn.Parameter(torch.ones(3))]
    assert OPT8[kind](mixed, master_weights=mode).bf16_weights == mode


@pytest.mark.parametrize("kind", sorted(OPT8))
def test_item7g_state_bits_8_with_only_small_tensors_warns_once_naming_the_threshold(kind):
    small = [torch.nn.Parameter(torch.ones(64, 63)), torch.nn.Parameter(torch.ones(10))]
    with pytest.warns(UserWarning, match=r"at least 4096 elements.*largest has 4032") as record:
        opt = OPT8[kind](small, state_bits=8)
    assert len([w for w in record if "state_bits=8" in str(w.message)]) == 1
    for p in small:
        p.grad = torch.ones_like(p)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # no second warning
        OPT8[kind]([*small, torch.nn.Parameter(torch.ones(4096))], state_bits=8)  # one large tensor: silent


def test_item7e_cpu_scratch_stays_within_the_documented_bound(monkeypatch):
    """docs/optim.md ("Transient and process-wide memory"): the CPU fallback's fp32 scratch buffers hold at most
    ``65536 + 2 * max(65536, N_max) + max(65536, N_small)`` elements, whatever the model's size."""
    from fp16kit.kernels.fallback import scratch as fb_scratch

    monkeypatch.setattr(fb_scratch, "_scratch", {})
    monkeypatch.setattr(fb_scratch, "_views", {})
    sizes = [200_000, 70_000, 5000, 300, 300]
    params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in sizes]
    opt = FusedLAMB(params, lr=0.01, master_weights=True)
    for p in params:
        p.grad = torch.randn(p.shape).bfloat16()
    opt.step()
    held = sum(t.numel() for t in fb_scratch._scratch.values())
    assert 0 < held <= 65536 + 2 * max(65536, max(sizes)) + max(65536, sum(n for n in sizes if n < 16384))


# ---------------------------------------------------------------------------------------------------------------
# Found by the configuration matrix: a compiled step of apex's SGD/Adagrad/NovoGrad on the Triton backend


def _apex_pass(kind: str) -> tuple:
    """Fixed fp32 inputs (a 6x5 and a 7-element row) for one ``sgd_update``/``adagrad_update``/``novograd_update``:
    ``(call, written)``, ``call()`` runs the pass and ``written`` lists every tensor it may write."""
    from fp16kit.kernels.optimizers import adagrad_update, novograd_update, sgd_update

    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(6, 5, generator=gen), torch.randn(7, generator=gen)]
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    state = [torch.randn(p.shape, generator=gen).abs() for p in params]
    flag = torch.zeros(1)
    if kind == "sgd":
        hp = torch.tensor([0.1, 0.9, 1.0, 0.01, 1.0], dtype=torch.float64)
        return (lambda: sgd_update(params, grads, state, [None, None], hp, flag, first_run=[False, False],
                                   weight_decay=True, wd_after_momentum=False, nesterov=False)), [*params, *state, flag]
    if kind == "adagrad":
        hp = torch.tensor([0.01, 1e-10, 0.01, 1.0], dtype=torch.float64)
        return (lambda: adagrad_update(params, grads, state, [None, None], hp, flag, l2_mode=False, decoupled=True)), \
            [*params, *state, flag]
    sq = [torch.ones(1), torch.ones(1)]
    hp = torch.tensor([1e-3, 0.95, 1.0, 0.01, 0.05, 1.0], dtype=torch.float64)
    bc2 = torch.tensor(0.14, dtype=torch.float64)
    return (lambda: novograd_update(params, grads, state, sq, [None, None], hp, flag, new=[False, False], beta2=0.98,
                                    eps=1e-8, bc2_sqrt=bc2, norm_type=2, init_zero=False, reg_inside_moment=False)), \
        [*params, *state, *sq, flag]


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", [pytest.param("sgd", marks=pytest.mark.slow),
                                  pytest.param("adagrad", marks=pytest.mark.slow), "novograd"])
def test_apex_passes_compile_on_the_triton_backend_and_equal_eager(kind):
    """``torch.compile`` of a call to apex's update passes (what ``torch.compile(opt.step)`` of FusedSGD, FusedAdagrad
    and FusedNovoGrad traces, their result checks included) on the Triton backend: Dynamo used to trace into Triton's
    interpreter and fail on its uint64 address arithmetic (``KeyError(torch.uint64)``); its launches now run as
    they do eagerly inside the compiled call, with the eager bits. (NovoGrad's pass launches a norm kernel and the
    update kernel; the whole compiled steps: the matrix's ``compiled`` cells.)"""
    torch._dynamo.reset()
    with use_backend("auto"):
        eager, want = _apex_pass(kind)
        eager()
        call, got = _apex_pass(kind)
        torch.compile(call, backend="eager")()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"tensor {i} differs from the eager pass"


@pytest.mark.interpreter
def test_a_kernel_launch_inside_a_compiled_region_runs_under_the_interpreter():
    """Every fp16kit kernel a compiled region reaches eagerly (FusedAdam/FusedLAMB with ``master_weights="split"`` or
    ``"stochastic"`` call ``l2norm`` and the update launchers from frames Dynamo resumed) runs under Triton's
    interpreter instead of being traced into: Dynamo failed on the interpreter's uint64 pointer arithmetic. The
    guard is the interpreter's launch itself (``fp16kit/kernels/backend.py``), shown here on a kernel of one line;
    the optimizers' compiled steps: the next test and the matrix's ``compiled`` cells."""
    import triton
    import triton.language as tl

    import fp16kit.kernels  # noqa: F401  (installs the guard)

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)

    x = torch.arange(5, dtype=torch.float32)
    torch._dynamo.reset()
    torch.compile(lambda: add_one[(1,)](x, x.numel(), BLOCK=8), backend="eager")()
    assert torch.equal(x, torch.arange(1, 6, dtype=torch.float32))


def _eager_compile_cases() -> list:
    from fp16kit.optim import FusedAdagrad, FusedNovoGrad, FusedSGD

    bf16 = [(cls, {"master_weights": mode, **({"rounding_seed": 3} if mode == "stochastic" else {})})
            for cls in (FusedAdam, FusedLAMB) for mode in ("split", "stochastic")]
    apex = [(FusedSGD, {"momentum": 0.9}), (FusedAdagrad, {}), (FusedNovoGrad, {})]
    return [pytest.param(cls, kw, id=f"{cls.__name__}-{kw.get('master_weights', 'apex')}") for cls, kw in bf16 + apex]


@pytest.mark.parametrize("backend", ["torch", pytest.param("auto", marks=pytest.mark.interpreter)])
@pytest.mark.parametrize(("cls", "kw"), _eager_compile_cases())
def test_compiled_steps_without_dispatcher_ops_run_eagerly_as_one_graph_break(cls, kw, backend):
    """The bf16 weight modes and apex's other optimizers have no dispatcher op for their passes: under
    ``torch.compile`` their step runs eagerly, one graph break (traced, their planning and host checks broke four
    steps into 40-210 frames, past the recompile limit in split mode; now 8), and the compiled steps give the eager
    bits (the eager host-vector step: a compiled step is one, docs/optim.md)."""
    from torch._dynamo.utils import counters

    def four_steps(compiled: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(5)
        ps = [nn.Parameter(torch.randn(6, 5, generator=gen).bfloat16()),
              nn.Parameter(torch.randn(70, 64, generator=gen).bfloat16().t())]  # a kernel row and a strided one
        opt = cls(ps, lr=0.01, **kw)
        if not compiled:
            opt._on_device = lambda device: False  # the eager host-vector step (the compiled step must be that one)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        with use_backend(backend):
            for _ in range(4):
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=gen).bfloat16()
                step()
        return [t.detach().clone() for p in ps for t in (p, *opt.state[p].values()) if isinstance(t, torch.Tensor)]

    torch._dynamo.reset()
    counters.clear()
    compiled = four_steps(True)
    assert counters["frames"]["total"] <= 12, dict(counters["frames"])
    for a, b in zip(compiled, four_steps(False), strict=True):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


@pytest.mark.slow  # four compiled optimizer steps under the interpreter (~30 s); the mechanism is tested just above
@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["split", "stochastic"])
@pytest.mark.parametrize("kind", sorted(OPT8))
def test_compiled_bf16_mode_steps_on_the_triton_backend_equal_eager(kind, mode):
    """``torch.compile(opt.step)`` of FusedAdam/FusedLAMB with split or stochastic bf16 weights on the Triton backend
    (the configuration matrix's full product found them failing while tracing): three steps, the eager bits."""

    def three_steps(compiled: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(4)
        p = torch.nn.Parameter(torch.randn(6, 5, generator=gen).bfloat16())
        opt = OPT8[kind]([p], lr=0.01, master_weights=mode, **({"rounding_seed": 3} if mode == "stochastic" else {}))
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        with use_backend("auto"):
            for _ in range(3):
                p.grad = torch.randn(6, 5, generator=gen).bfloat16()
                step()
        return [p.detach().clone(), *(t.clone() for t in opt.state[p].values() if isinstance(t, torch.Tensor))]

    torch._dynamo.reset()
    for a, b in zip(three_steps(True), three_steps(False), strict=True):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16)
                           if b.dtype == torch.bfloat16 else b)
