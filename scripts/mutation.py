"""AST mutation testing of chosen functions: does the test suite notice when the code is wrong?

For each target (a file, the functions to mutate, the tests that cover them) every mutant is one small change to
one node of one function: an arithmetic or bitwise operator swapped, a comparison moved across its boundary or
negated, ``and``/``or`` swapped, a ``not`` or a unary minus removed, a constant perturbed (0<->1, n -> n+1,
True<->False, a float doubled or zeroed), a return value replaced by None, a call statement or an augmented
assignment deleted, a slice bound or an index moved by one. String constants, docstrings, annotations, f-strings,
``raise`` statements and warning/logging calls are never mutated.

A mutant is written into a private copy of the package (the checkout is never touched), its tests run in a fresh
process that imports that copy first (forked from a parent that pre-imported torch and triton, or a plain
subprocess with ``--no-fork``), with a timeout of 3x the unmutated run (at least ``--min-timeout`` s): a failing
test, an error or a timeout kills it. Results are kept per mutant id ``file:line:col:operator`` in
``benchmarks/results/mutation/results.json`` (a re-run skips mutants already judged; ``--rerun survived`` runs the
survivors again); survivors judged equivalent by inspection are listed in ``equivalent.json`` next to it, matched
by function, operator and the changed source text, so the explanations survive line moves.

    nice -n 15 python scripts/mutation.py -j 2 --sample 40 --seed 1        # run (resumes), then the table
    python scripts/mutation.py --summary                                   # the table of the stored results
    python scripts/mutation.py --list --target state8                      # the mutants, not run
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.util
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "mutation"

_Q = "tests/kernels/test_state8_quantizer.py::"
_S8 = "tests/optim/test_state8.py::"
_CPU8 = "tests/optim/test_state8_cpu_path.py::"
_BF = "tests/optim/test_bf16_weights.py::"
_DS = "tests/optim/test_device_step.py::"
_DE = "tests/amp/test_dispatch_engine.py::"
_K = "fp16kit/kernels/"
_KO = "tests/test_mutation_kills_open.py::"

#: name -> (file, functions ("name" or "Class.name"), the pytest arguments of the tests that cover them: node ids,
#: fastest first; each subset runs in well under a minute unmutated on an idle core)
TARGETS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "state8": (_K + "state8/rule.py", (
        "_host_book", "book", "num_blocks", "_offset", "_host_lut", "_lut", "_high_halves", "_codes", "_quotients",
        "quantize", "quantize_into", "dequantize", "uses_state8", "_align16", "new_state", "absmax_of",
        "check_room", "to_state8", "from_state8"), (
        _Q + "test_books_match_the_spec", _Q + "test_book_layout_stated_in_the_docstring", _Q + "test_edge_blocks",
        _Q + "test_bad_input_is_named", _CPU8 + "test_table_lookup_is_searchsorted",
        _CPU8 + "test_high_halves_both_ways",
        _S8 + "test_step_is_the_fp32_rule_on_dequantized_state_then_the_spec_quantizer",
        _S8 + "test_checkpoints_round_trip_and_convert", _S8 + "test_bad_checkpoints_and_arguments_are_named",
        "tests/test_mutation_kills.py")),
    "state8_fallback": (_K + "state8/fallback.py", (
        "_dequantized", "_requantize", "adam8_", "_adam_chunk", "_cpu_rows", "_picker", "_chunk", "lamb8_stage1",
        "_lamb8_direction_cpu", "lamb8_"), (
        _S8 + "test_step_is_the_fp32_rule_on_dequantized_state_then_the_spec_quantizer",
        _S8 + "test_skip_writes_nothing", "-m", "not interpreter and not gpu",
        _S8 + "test_staged_lamb_matches_lamb_update",
        _CPU8 + "test_cpu_path_is_the_masked_sequence_bit_for_bit[adam-dtype1]",
        _CPU8 + "test_cpu_path_is_the_masked_sequence_bit_for_bit[lamb-dtype0]",
        _CPU8 + "test_cpu_path_is_the_masked_sequence_bit_for_bit[adam_l2-dtype0]",
        _CPU8 + "test_cpu_path_is_the_masked_sequence_bit_for_bit[lamb_l2_nvlamb-dtype1]",
        _KO + "test_the_cpu_8bit_path_steps_a_last_row_and_rows_without_model_copies",
        _KO + "test_fused_adam_steps_a_lone_8bit_param_on_the_cpu_path",
        "tests/test_mutation_kills.py")),
    "state8_triton": (_K + "state8/triton.py", (
        "_search", "quantize_block", "dequantize_block", "_block_span", "_absmax_pointer", "_load_moment",
        "_store_moment", "load_state", "store_state"), (
        _Q + "test_triton_ties_every_midpoint",
        _S8 + "test_triton_matches_torch_bit_for_bit[dtype0-adam]",
        _S8 + "test_triton_matches_torch_bit_for_bit[dtype1-lamb]",
        "tests/test_mutation_kills.py::test_the_triton_quantizer_codes_an_all_zero_block_as_torch_does",
        "tests/test_mutation_kills.py::test_moments_after_three_kernel_steps_equal_the_torch_implementations",
        _KO + "test_the_kernels_write_nothing_past_an_8bit_moments_absmax")),
    "bf16_weights": (_K + "bf16_weights/modes.py", (
        "Bf16Weights.offset", "Bf16Weights.epilogue", "epilogue_mode", "launch_arguments", "row_table", "low_rows",
        "split_halves", "join_halves", "_mul_hi_lo", "philox_uint32", "_philox_rounds", "stochastic_round",
        "stochastic_round_list", "_local_index", "round_with_bits", "fallback_step", "widen", "epilogue_rows",
        "write_back"), (
        _BF + "test_split_nan_is_written_as_the_canonical_nan", _BF + "test_philox_is_philox4x32_10",
        _BF + "test_stochastic_round_list_offsets_draw_the_whole_tensors_bits",
        _BF + "test_split_is_exact_and_matches_the_float64_reference",
        _BF + "test_stochastic_rule_matches_the_float64_reference",
        _BF + "test_split_equals_fp32_masters_bit_for_bit_torch_backend",
        _BF + "test_a_skipped_step_writes_nothing_and_draws_nothing",
        _BF + "test_stochastic_step_is_the_rule_applied_to_the_fp32_result",
        _BF + "test_fp32_params_beside_bf16_ones_are_updated_directly",
        _BF + "test_stochastic_update_of_shards_with_offsets_equals_the_whole_update",
        _KO + "test_shards_at_offsets_draw_one_philox_counter_per_8_elements",
        _KO + "test_stochastic_bits_past_element_2_35_follow_the_counter_layout",
        "-m", "not interpreter and not gpu", "tests/test_mutation_kills.py")),
    "bf16_triton": (_K + "bf16_weights/modes.py", (
        "load_master", "rng_step", "_split_bits", "_stochastic_bits", "store_weights"), (
        _BF + "test_triton_device_functions_equal_the_torch_twins",
        _BF + "test_split_equals_fp32_masters_bit_for_bit_triton[host-vector-plain-adam]",
        _BF + "test_stochastic_step_is_the_rule_applied_to_the_fp32_result[adam-triton]",
        _BF + "test_stochastic_update_of_shards_with_offsets_equals_the_whole_update",
        _KO + "test_stochastic_bits_past_element_2_35_equal_the_triton_twin")),
    "rounding": (_K + "engine/rounding.py", ("round_to", "to_fp32"), (
        _BF + "test_triton_device_functions_equal_the_torch_twins",
        _S8 + "test_triton_matches_torch_bit_for_bit[dtype1-adam]",
        "tests/test_mutation_kills.py::test_the_kernels_write_nan_as_the_canonical_bf16_nan",
        "tests/test_mutation_kills.py::test_the_kernels_round_exact_ties_to_even_as_torch_does",
        "tests/test_mutation_kills.py::test_the_kernels_round_to_fp16_as_torch_does",
        "tests/test_mutation_kills.py::test_the_bf16_rounding_is_a_bit_pattern_in_the_sm90_ptx")),
    "step_scalars": (_K + "engine/step_scalars.py", (
        "DeviceStep.hp64", "DeviceStep.arguments", "split3_cached", "split3", "join3", "pow_int", "finish_ticket",
        "next_step", "bias_correction64", "lr64", "inv_scale64", "advance_step"), (
        "tests/kernels/test_step_scalars.py", _DS + "test_skipped_step_does_not_advance_and_counts",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[fp32-adam]",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[tensor-lr-changed-adam]",
        "tests/test_mutation_kills.py")),
    "device_step": ("fp16kit/optim/_device_step.py", (
        "DeviceStepMixin._device_step", "DeviceStepMixin._adam_like_step", "DeviceStepMixin._on_device",
        "DeviceStepMixin._device_buffers", "DeviceStepMixin._step_on_device"), (
        _DS + "test_skipped_step_does_not_advance_and_counts",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[fp32-adam]",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[tensor-lr-changed-adam]",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[fp32-scaler-overflow-lamb]",
        "tests/test_mutation_kills.py")),
    "skip_counters": ("fp16kit/optim/_report.py", ("ReportMixin._counter", "ReportMixin._count"), (
        _DS + "test_skipped_step_does_not_advance_and_counts",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[fp32-scaler-overflow-lamb]",
        "tests/test_mutation_kills.py")),
    "device_step_ops": (_K + "optimizers.py", ("_lamb_or_adam", "_kernel_hps", "step_check"), (
        _DS + "test_skipped_step_does_not_advance_and_counts",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[fp32-adam]",
        _DS + "test_device_step_equals_the_host_vector_step_bit_for_bit[fp16-master-adam]",
        _S8 + "test_skip_writes_nothing", _S8 + "test_staged_lamb_matches_lamb_update", "-m", "not gpu",
        "tests/test_mutation_kills.py")),
    "dispatch_registration": ("fp16kit/amp/_dispatch.py", (
        "_desired", "_rank", "_torch_rules", "_torch_kernel_ops", "plan", "live_plan", "cuda_overrides", "_register",
        "_refresh", "include_key", "install", "uninstall", "installed_ops", "_make_kernel", "_functional_rows",
        "_wrap_functional", "_unwrap_functional"), (
        _DE + "test_overrides_only_where_fp16kit_differs_from_torch",
        _DE + "test_torch_autocast_keys_carry_no_kernel_of_ours_with_the_default_table",
        _DE + "test_a_user_edited_row_that_torch_cuda_casts_gets_a_cuda_kernel",
        _DE + "test_rows_without_an_aten_op_are_listed", _DE + "test_inside_a_region_the_ops_follow_fp16kit",
        _DE + "test_the_plan_follows_the_table", _DE + "test_uninstall_removes_the_kernels",
        _DE + "test_python_level_rows_are_wrapped_while_installed", _DE + "test_composite_rows_follow_the_table",
        _DE + "test_a_wrapped_function_reads_the_live_row", _DE + "test_leaving_the_engine_uninstalls_it",
        _DE + "test_plain_torch_autocast_is_unaffected_outside_fp16kit_regions",
        _KO + "test_a_wrapper_held_past_uninstall_applies_no_row",
        _KO + "test_live_plan_computes_the_plans_it_is_not_handed",
        _KO + "test_the_autocast_cuda_kernel_of_a_user_row_takes_the_dispatch_keyset",
        _KO + "test_reinstalling_the_engine_keeps_one_table_listener",
        "tests/test_mutation_kills.py")),
}


@dataclass
class Mutant:
    id: str  # file:line:col:operator
    target: str
    file: str
    function: str
    operator: str
    start: tuple[int, int]  # (line, byte column) of the replaced node
    end: tuple[int, int]
    original: str
    replacement: str

    @property
    def key(self) -> str:
        """What identifies the mutant across line moves: function, operator, the text changed."""
        return f"{self.file}::{self.function}::{self.operator}::{self.original} -> {self.replacement}"


# -- generation ------------------------------------------------------------------------------------------------

_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
        ast.Pow: ast.Mult, ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
        ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr}
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
_NEGATE = {ast.Lt: ast.GtE, ast.LtE: ast.Gt, ast.Gt: ast.LtE, ast.GtE: ast.Lt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
           ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_QUIET_CALLS = ("warn", "warning", "debug", "info", "error", "exception", "critical")


def _skipped_children(node: ast.AST) -> set[int]:
    """ids of child nodes not to mutate: annotations, docstrings."""
    skip: set[int] = set()
    for field in ("annotation", "returns"):
        if getattr(node, field, None) is not None:
            skip.add(id(getattr(node, field)))
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip.add(id(body[0]))
    return skip


def _quiet(node: ast.AST) -> bool:
    """Nodes whose mutation could only change a message: raise, f-strings, warnings/logging calls."""
    if isinstance(node, (ast.Raise, ast.JoinedStr)):
        return True
    if isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name in _QUIET_CALLS
    return False


def _changes(node: ast.AST) -> list[tuple[str, ast.AST | str]]:
    """``(operator, replacement)`` for one node: a new node, or a source string."""
    out: list[tuple[str, ast.AST | str]] = []
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        out.append((f"binop_{type(node.op).__name__}", ast.BinOp(node.left, _BIN[type(node.op)](), node.right)))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1:
        op = type(node.ops[0])
        if op in _BOUNDARY:
            out.append((f"cmp_boundary_{op.__name__}", ast.Compare(node.left, [_BOUNDARY[op]()], node.comparators)))
        if op in _NEGATE:
            out.append((f"cmp_negate_{op.__name__}", ast.Compare(node.left, [_NEGATE[op]()], node.comparators)))
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append((f"boolop_{type(node.op).__name__}", ast.BoolOp(other, node.values)))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append((f"unary_drop_{type(node.op).__name__}", node.operand))
    elif isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)) and node.value is not None:
        v = node.value
        if isinstance(v, bool):
            out.append(("const_bool", ast.Constant(not v)))
        elif isinstance(v, int):
            out.append(("const_int", ast.Constant(1 if v == 0 else 0 if v == 1 else v + 1)))
        elif isinstance(v, float):
            out.append(("const_float_x2", ast.Constant(v * 2 if v else 1.0)))
            if v:
                out.append(("const_float_zero", ast.Constant(0.0)))
    elif isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        out.append(("return_none", "return None"))
    elif isinstance(node, ast.AugAssign) or (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        out.append(("stmt_delete", "pass"))
    elif isinstance(node, ast.Subscript):
        s = node.slice
        if isinstance(s, ast.Slice):
            if s.lower is not None:
                out.append(("slice_lower_plus1", ast.Subscript(node.value, ast.Slice(
                    ast.BinOp(s.lower, ast.Add(), ast.Constant(1)), s.upper, s.step), node.ctx)))
            if s.upper is not None:
                out.append(("slice_upper_minus1", ast.Subscript(node.value, ast.Slice(
                    s.lower, ast.BinOp(s.upper, ast.Sub(), ast.Constant(1)), s.step), node.ctx)))
        elif isinstance(s, (ast.Name, ast.BinOp, ast.Attribute)):
            out.append(("index_plus1", ast.Subscript(node.value, ast.BinOp(s, ast.Add(), ast.Constant(1)), node.ctx)))
    return out


def _functions(tree: ast.Module, names: tuple[str, ...]) -> dict[str, ast.AST]:
    found: dict[str, ast.AST] = {}
    for top in tree.body:
        if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)) and top.name in names:
            found[top.name] = top
        if isinstance(top, ast.ClassDef):
            for sub in top.body:
                qual = f"{top.name}.{sub.name}" if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) else ""
                if qual in names:
                    found[qual] = sub
    missing = set(names) - found.keys()
    if missing:
        raise SystemExit(f"mutation.py: no function {sorted(missing)} in the target file")
    return found


def generate(target: str, file: str, functions: tuple[str, ...], root: Path = ROOT) -> list[Mutant]:
    """Every mutant of ``functions`` of ``file`` (relative to ``root``), in source order, ids unique."""
    source = (root / file).read_text()
    tree = ast.parse(source)
    lines = source.encode().splitlines(keepends=True)
    out: list[Mutant] = []
    seen: dict[str, int] = {}

    def segment(n: ast.AST) -> str:
        a, b = (n.lineno - 1, n.col_offset), (n.end_lineno - 1, n.end_col_offset)
        if a[0] == b[0]:
            return lines[a[0]][a[1]:b[1]].decode()
        return (lines[a[0]][a[1]:] + b"".join(lines[a[0] + 1:b[0]]) + lines[b[0]][:b[1]]).decode()

    def visit(node: ast.AST, fname: str, skip: set[int]) -> None:
        if id(node) in skip or _quiet(node):
            return
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name) \
                and node.value.func.id == "print":
            return
        if hasattr(node, "lineno"):
            for op, new in _changes(node):
                text = new if isinstance(new, str) else f"({ast.unparse(new)})"
                base = f"{file}:{node.lineno}:{node.col_offset}:{op}"
                seen[base] = seen.get(base, 0) + 1
                mid = base if seen[base] == 1 else f"{base}#{seen[base]}"
                out.append(Mutant(mid, target, file, fname, op, (node.lineno, node.col_offset),
                                  (node.end_lineno, node.end_col_offset), segment(node), text))
        inner = skip | _skipped_children(node)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or fname:  # nested defs: mutated too
                visit(child, fname, inner)

    for fname, fn in _functions(tree, functions).items():
        skip = _skipped_children(fn) | {id(d) for d in fn.decorator_list} | {id(fn.args)}
        for stmt in fn.body:
            visit(stmt, fname, skip)
    return out


def apply(mutant: Mutant, source: str) -> str:
    """``source`` with the mutant's node replaced (byte columns, as ``ast`` gives them)."""
    lines = source.encode().splitlines(keepends=True)
    (l0, c0), (l1, c1) = mutant.start, mutant.end
    head, tail = lines[l0 - 1][:c0], lines[l1 - 1][c1:]
    new = b"".join(lines[: l0 - 1]) + head + mutant.replacement.encode() + tail + b"".join(lines[l1:])
    text = new.decode()
    compile(text, mutant.file, "exec")  # a mutant that is not Python is a bug of this script: fail loudly
    return text


# -- running ---------------------------------------------------------------------------------------------------

class Slot:
    """A private copy of the package a worker mutates (one file at a time, restored after)."""

    def __init__(self, root: Path, packages: set[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mutant-"))
        for package in packages:
            shutil.copytree(root / package, self.dir / package, ignore=shutil.ignore_patterns("__pycache__"))
        self.proc: tuple[int, float, float, Mutant | None, Path] | None = None

    def write(self, file: str, text: str) -> None:
        (self.dir / file).write_text(text)


def _pytest_args(tests: list[str]) -> list[str]:
    """Stop at the first failure; Hypothesis draws the same examples every run."""
    seed = ["--hypothesis-seed=0"] if importlib.util.find_spec("hypothesis") else []
    return [*tests, "-x", "-q", "-p", "no:cacheprovider", *seed]


def _child(slot: Slot, root: Path, tests: list[str], log: Path) -> None:
    """In the forked child: import the slot's package first and run the tests (never returns)."""
    try:
        os.setpgid(0, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(root)
        sys.dont_write_bytecode = True
        for pkg in os.listdir(slot.dir):  # a package the parent imported must come from the slot's copy here
            for name in [n for n in sys.modules if n == pkg or n.startswith(pkg + ".")]:
                del sys.modules[name]
        sys.path.insert(0, str(slot.dir))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(slot.dir), os.environ.get("PYTHONPATH", "")])
        import pytest

        os._exit(pytest.main(_pytest_args(tests)))
    except BaseException:
        import traceback

        traceback.print_exc()
    os._exit(3)


def start(slot: Slot, root: Path, tests: list[str], timeout: float, mutant: Mutant | None, fork: bool) -> None:
    log = slot.dir / "log.txt"
    if fork:
        pid = os.fork()
        if pid == 0:
            _child(slot, root, tests, log)
        handle: int | subprocess.Popen = pid
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(slot.dir), os.environ.get("PYTHONPATH", "")]),
               "PYTHONDONTWRITEBYTECODE": "1"}
        code = f"import sys; sys.path.insert(0, {str(slot.dir)!r}); import pytest; sys.exit(pytest.main(sys.argv[1:]))"
        with open(log, "w") as f:
            handle = subprocess.Popen([sys.executable, "-c", code, *_pytest_args(tests)],
                                      cwd=root, env=env, stdout=f, stderr=f, start_new_session=True)
    slot.proc = (handle, time.monotonic(), timeout, mutant, log)


def poll(slot: Slot) -> tuple[str, float] | None:
    """``(status, seconds)`` once the slot's run ended: "passed", "failed" or "timeout"."""
    handle, t0, timeout, _m, _log = slot.proc
    if isinstance(handle, int):
        done, status = os.waitpid(handle, os.WNOHANG)
        code = os.waitstatus_to_exitcode(status) if done else None
    else:
        code = handle.poll()
    took = time.monotonic() - t0
    if code is not None:
        slot.proc = None
        return ("passed" if code == 0 else "failed"), took
    if took > timeout:
        kill(slot)
        return "timeout", took
    return None


def kill(slot: Slot) -> None:
    """End the slot's run: its own process group (the child and whatever it spawned)."""
    handle = slot.proc[0]
    pid = handle if isinstance(handle, int) else handle.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if isinstance(handle, int):
        os.waitpid(pid, 0)
    else:
        handle.wait()
    slot.proc = None


def _fingerprint(root: Path, file: str, tests: list[str]) -> str:
    """What a baseline depends on: the target file, the test files and the pytest arguments."""
    h = hashlib.sha256(json.dumps(tests).encode() + (root / file).read_bytes())
    for t in tests:
        path = root / t.split("::")[0]
        h.update(path.read_bytes() if path.is_file() else b"")
    return h.hexdigest()


def _baselines(slots: list[Slot], root: Path, files: dict[str, str], tests_of: dict[str, list[str]],
               known: dict, fork: bool) -> dict[str, float]:
    """Seconds of each target's unmutated tests (which must pass): run on the free slots, or reused from ``known``
    (updated) when the target file, the test files and the arguments are unchanged."""
    base: dict[str, float] = {}
    todo = []
    for target, file in sorted(files.items()):
        fp = _fingerprint(root, file, tests_of[target])
        if known.get(target, {}).get("fingerprint") == fp:
            base[target] = known[target]["seconds"]
        else:
            todo.append((target, fp))
    running: dict[int, tuple[str, str]] = {}
    while todo or running:
        for i, slot in enumerate(slots):
            if slot.proc is None and todo:
                running[i] = todo.pop(0)
                start(slot, root, tests_of[running[i][0]], 3600, None, fork)
            elif slot.proc is not None and (r := poll(slot)) is not None:
                target, fp = running.pop(i)
                if r[0] != "passed":
                    raise SystemExit(f"mutation.py: the unmutated tests of {target} fail:\n"
                                     + (slot.dir / "log.txt").read_text()[-3000:])
                base[target] = r[1]
                known[target] = {"seconds": round(r[1], 2), "fingerprint": fp}
                print(f"baseline {target}: {r[1]:.1f} s", flush=True)
        time.sleep(0.05)
    return base


def run_all(mutants: list[Mutant], root: Path, tests_of: dict[str, list[str]], results: dict, save,
            jobs: int, fork: bool, min_timeout: float, baselines: dict | None = None) -> None:
    """Judge ``mutants`` (``results[id]`` filled in, ``save()`` after each), after a baseline run per target
    (``baselines``: the stored ones, reused while their fingerprint holds, and updated)."""
    baselines = {} if baselines is None else baselines
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still ends its children (finally)
    packages = {Path(m.file).parts[0] for m in mutants}  # the top folder of each mutated file: its package
    slots = [Slot(root, packages) for _ in range(max(1, jobs))]
    try:
        base = _baselines(slots, root, {m.target: m.file for m in mutants}, tests_of, baselines, fork)
        by_target: dict[str, list[Mutant]] = {}
        for m in mutants:
            by_target.setdefault(m.target, []).append(m)
        queue = [m for group in itertools.zip_longest(*by_target.values()) for m in group if m]  # round robin
        originals = {m.file: (root / m.file).read_text() for m in mutants}
        while queue or any(s.proc for s in slots):
            for slot in slots:
                if slot.proc is None and queue:
                    m = queue.pop(0)
                    slot.write(m.file, apply(m, originals[m.file]))
                    start(slot, root, tests_of[m.target], max(3 * base[m.target], min_timeout), m, fork)
                elif slot.proc is not None:
                    m = slot.proc[3]
                    if (r := poll(slot)) is None:
                        continue
                    status = "survived" if r[0] == "passed" else "killed"
                    results[m.id] = {**asdict(m), "status": status, "how": r[0], "seconds": round(r[1], 2),
                                     "timeout": round(max(3 * base[m.target], min_timeout), 1)}
                    slot.write(m.file, originals[m.file])
                    save()
                    print(f"{status:8} {r[1]:6.1f}s {m.id}  {m.original.strip()[:50]!r} -> {m.replacement[:50]!r}",
                          flush=True)
            time.sleep(0.05)
    finally:
        for slot in slots:
            if slot.proc is not None:
                kill(slot)
            shutil.rmtree(slot.dir, ignore_errors=True)


# -- results ---------------------------------------------------------------------------------------------------

def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def equivalents(out: Path) -> dict[str, str]:
    """mutant key -> why it is equivalent (``equivalent.json``: a list of ``{"key", "id", "why"}``)."""
    return {e["key"]: e["why"] for e in json.loads((out / "equivalent.json").read_text())} \
        if (out / "equivalent.json").exists() else {}


def _key(r: dict) -> str:
    return f"{r['file']}::{r['function']}::{r['operator']}::{r['original']} -> {r['replacement']}"


def summary(results: dict, generated: dict[str, int], equiv: dict[str, str]) -> str:
    """A markdown table per target, then every surviving mutant (with its explanation when equivalent)."""
    rows = ["| target | mutants | run | killed | survived | equivalent | killed / (run - equivalent) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    totals = [0, 0, 0, 0, 0]
    survivors = []
    for target in sorted(set(generated) | {r["target"] for r in results.values()}):
        mine = [r for r in results.values() if r["target"] == target]
        killed = sum(r["status"] == "killed" for r in mine)
        eq = [r for r in mine if r["status"] == "survived" and _key(r) in equiv]
        live = [r for r in mine if r["status"] == "survived" and _key(r) not in equiv]
        survivors += [(r, equiv.get(_key(r))) for r in mine if r["status"] == "survived"]
        n = [generated.get(target, 0), len(mine), killed, len(live), len(eq)]
        totals = [a + b for a, b in zip(totals, n)]
        rows.append(f"| {target} | " + " | ".join(map(str, n)) + f" | {_score(killed, len(mine) - len(eq))} |")
    rows.append("| **all** | " + " | ".join(f"**{t}**" for t in totals)
                + f" | **{_score(totals[2], totals[1] - totals[4])}** |")
    lines = ["\n".join(rows), ""]
    for r, why in sorted(survivors, key=lambda x: x[0]["id"]):
        lines.append(f"- `{r['id']}` ({r['function']}): `{r['original'].strip()[:80]}` -> `{r['replacement'][:80]}`: "
                     + (f"equivalent: {why}" if why else "**survived** (no explanation yet)"))
    return "\n".join(lines)


def _score(killed: int, of: int) -> str:
    return f"{100 * killed / of:.1f}%" if of else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=1, help="mutants run at once")
    ap.add_argument("--target", action="append", help="a target name of TARGETS (default: all)")
    ap.add_argument("--only", action="append", default=[],
                    help="FILE:FUNCTION[@TEST,TEST...]: a target given here instead of TARGETS")
    ap.add_argument("--sample", type=int, help="the first N mutants per target after a shuffle seeded by --seed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rerun", choices=("survived", "all"), help="judge these stored results again")
    ap.add_argument("--ids", nargs="*", default=[], help="only these mutant ids")
    ap.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    ap.add_argument("--summary", action="store_true", help="print the stored results' table, run nothing")
    ap.add_argument("--no-fork", action="store_true", help="a fresh interpreter per mutant instead of a fork")
    ap.add_argument("--min-timeout", type=float, default=20.0, help="seconds; the timeout is max(3x baseline, this)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout (holds the package and the tests)")
    ap.add_argument("--out", type=Path, default=OUT, help="where results.json, equivalent.json, summary.md live")
    a = ap.parse_args(argv)
    targets = dict(TARGETS)
    if a.only:
        targets = {}
        for spec in a.only:
            where, _, tests = spec.partition("@")
            file, _, fn = where.partition(":")
            targets[where] = (file, (fn,), tuple(tests.split(",")) if tests else ())
    chosen = a.target or sorted(targets)
    mutants: list[Mutant] = []
    generated: dict[str, int] = {}
    for name in chosen:
        file, fns, _tests = targets[name]
        mine = generate(name, file, fns, a.root)
        generated[name] = len(mine)
        if a.sample is not None:  # a seeded shuffle, then the first N: a smaller sample is a prefix of a larger one
            random.Random(f"{a.seed}:{name}").shuffle(mine)
            mine = mine[: a.sample]
        mutants += mine
    if a.ids:
        mutants = [m for m in mutants if m.id in set(a.ids)]
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "results.json"
    stored = load(path)
    results = stored.get("mutants", {})
    meta = stored.get("meta", {})
    if a.list:
        for m in mutants:
            print(f"{m.id} [{m.function}] {m.original.strip()[:60]!r} -> {m.replacement[:60]!r}")
        return 0
    if not a.summary:
        if a.rerun:
            todo = [m for m in mutants if m.id not in results or a.rerun == "all"
                    or results[m.id]["status"] == a.rerun]
        else:
            todo = [m for m in mutants if m.id not in results]
        meta = {**meta, "sample": a.sample, "seed": a.seed, "generated": {**meta.get("generated", {}), **generated},
                "command": "python scripts/mutation.py " + " ".join(argv if argv is not None else sys.argv[1:])}

        def save() -> None:
            path.write_text(json.dumps({"meta": meta, "mutants": results}, indent=1, sort_keys=True) + "\n")

        if not a.no_fork:  # what every run imports, imported once before the forks (the package itself: by each run)
            os.environ.setdefault("TRITON_INTERPRET", "1")
            for mod in ("numpy", "torch", "triton", "pytest", "hypothesis"):
                if importlib.util.find_spec(mod) is not None:
                    __import__(mod)
        tests_of = {name: list(targets[name][2]) for name in chosen}
        print(f"{len(todo)} mutants to run ({len(mutants)} chosen, {sum(generated.values())} generated)", flush=True)
        if todo:
            meta.setdefault("baselines", {})
            run_all(todo, a.root, tests_of, results, save, a.jobs, not a.no_fork, a.min_timeout, meta["baselines"])
        save()
    picked = {m.id for m in mutants}
    shown = {k: r for k, r in results.items() if k in picked or a.summary}
    table = summary(shown, meta.get("generated", generated) if a.summary else generated, equivalents(a.out))
    print(table)
    if not a.list and a.out == OUT and not a.only:
        (a.out / "summary.md").write_text("# Mutation testing: results\n\n" + f"Command: `{meta.get('command')}`\n\n"
                                          + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
