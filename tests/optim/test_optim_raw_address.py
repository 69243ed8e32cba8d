"""Raw-address safety of the optimizer steps (issue 9, item 2): state and grads that do not fit their params
are rejected with a clear error before any kernel sees their addresses.

The kernels read and write ``numel(param)`` elements of every tensor in a row; before the checks, a truncated
``exp_avg`` loaded from a checkpoint overwrote neighbouring memory, an empty ``exp_avg_sq`` crashed the
process and a smaller grad (``p.grad.data = smaller``) was read past its end. Such cases may crash, so they
run in a child process (one per backend, every case in it, each case reported on its own line): a crash
fails the cases that did not report, instead of killing the test session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    r"""
    import json, sys, warnings
    import torch
    from fp16kit.kernels import use_backend
    from fp16kit.optim import FusedAdam, FusedLAMB

    BACKEND = sys.argv[1]

    def params(dtype=torch.float32):
        gen = torch.Generator().manual_seed(0)
        out = []
        for shape in [(300,), (4100,), (3, 7)]:
            p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            p.grad = torch.randn(shape, generator=gen).to(dtype)
            out.append(p)
        return out

    def snapshot(opt, ps):
        out = [p.detach().clone() for p in ps]
        for p in ps:
            out += [t.clone() for t in opt.state.get(p, {}).values()]
        return out

    def unchanged(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    def expect_error(fn, *needles):
        try:
            fn()
        except ValueError as exc:
            msg = str(exc)
            missing = [n for n in needles if n not in msg]
            return (not missing), f"message lacks {missing}: {msg}" if missing else msg
        return False, "no error"

    def stepped(cls, dtype=torch.float32, **kw):
        ps = params(dtype)
        opt = cls(ps, lr=0.01, **kw)
        opt.step()
        return ps, opt

    def loaded(cls, key, value_fn, **kw):
        ps, opt = stepped(cls, **kw)
        sd = opt.state_dict()
        sd["state"][1][key] = value_fn(sd["state"][1][key])
        ps2 = params()
        opt2 = cls(ps2, lr=0.01, **kw)
        opt2.step()
        before = snapshot(opt2, ps2)
        ok, msg = expect_error(lambda: opt2.load_state_dict(sd), "param_groups[0]['params'][1]", repr(key))
        if ok:
            opt2.step()  # still usable: the old state was kept
            ok = all(torch.isfinite(t).all() for t in snapshot(opt2, ps2)) and len(before) == len(snapshot(opt2, ps2))
        return ok, msg

    def at_step(cls, mutate, *needles, dtype=torch.float32, **kw):
        ps, opt = stepped(cls, dtype, **kw)
        mutate(ps, opt)
        before = snapshot(opt, ps)
        ok, msg = expect_error(opt.step, *needles)
        return ok and unchanged(before, snapshot(opt, ps)), msg

    def set_data(ps, opt):
        ps[1].grad.data = torch.randn(100)

    def set_state(key, value_fn, index=1):
        def mutate(ps, opt):
            opt.state[ps[index]][key] = value_fn(opt.state[ps[index]][key])
        return mutate

    CASES = {}
    for cls in (FusedLAMB, FusedAdam):
        n = cls.__name__
        CASES[f"{n}-load-truncated-exp_avg"] = (loaded, cls, "exp_avg", lambda t: t[:10].clone())
        CASES[f"{n}-load-empty-exp_avg_sq"] = (loaded, cls, "exp_avg_sq", lambda t: torch.empty(0))
        CASES[f"{n}-load-reshaped-exp_avg"] = (loaded, cls, "exp_avg", lambda t: t.reshape(41, 100))
        CASES[f"{n}-grad-data-smaller"] = (at_step, cls, set_data, "gradient", "param_groups[0]['params'][1]", "(100,)")
        CASES[f"{n}-state-truncated"] = (at_step, cls, set_state("exp_avg", lambda t: t[:5].clone()), "'exp_avg'")
        CASES[f"{n}-state-empty"] = (at_step, cls, set_state("exp_avg_sq", lambda t: torch.empty(0)), "'exp_avg_sq'")
        CASES[f"{n}-state-fp16"] = (at_step, cls, set_state("exp_avg", lambda t: t.half()), "dtype")
        CASES[f"{n}-state-strided"] = (
            at_step, cls, set_state("exp_avg", lambda t: torch.zeros(2 * t.numel())[::2]), "contiguous"
        )
        CASES[f"{n}-master-truncated"] = (
            lambda c, m, *needles: at_step(c, m, *needles, dtype=torch.float16, master_weights=True),
            cls, set_state("master", lambda t: t[:7].clone()), "'master'",
        )

    with use_backend(BACKEND):
        for name, (fn, *args) in CASES.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ok, msg = fn(*args)
            except Exception as exc:  # a wrong error class counts as a failure
                ok, msg = False, f"{type(exc).__name__}: {exc}"
            print(json.dumps({"case": name, "ok": bool(ok), "msg": msg[:400]}), flush=True)
    """
)

CASE_NAMES = [
    f"{cls}-{case}"
    for cls in ("FusedLAMB", "FusedAdam")
    for case in (
        "load-truncated-exp_avg",
        "load-empty-exp_avg_sq",
        "load-reshaped-exp_avg",
        "grad-data-smaller",
        "state-truncated",
        "state-empty",
        "state-fp16",
        "state-strided",
        "master-truncated",
    )
]

_results: dict[str, dict] = {}


def _run_child(backend: str) -> dict:
    if backend not in _results:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, backend], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT
        )
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        _results[backend] = {
            "rc": proc.returncode,
            "stderr": proc.stderr[-2000:],
            "cases": {x["case"]: x for x in lines},
        }
    return _results[backend]


def _check(backend: str, case: str) -> None:
    res = _run_child(backend)
    got = res["cases"].get(case)
    assert got is not None, f"the child process died before reporting {case} (rc={res['rc']}): {res['stderr']}"
    assert got["ok"], f"{case}: {got['msg']}"


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_state_or_grad_rejected_torch_backend(case):
    _check("torch", case)


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASE_NAMES)
def test_bad_state_or_grad_rejected_triton_interpreter(case):
    _check("auto", case)
