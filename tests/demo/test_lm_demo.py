"""The language-model demo (``python -m fp16kit demo``): the split, the model, the measurements, and a ``--quick``
run of every mode end to end (table and picture written)."""

from __future__ import annotations

import math

import pytest
import torch

from fp16kit.demo.lm import SIZES, ByteLM, LMConfig
from fp16kit.demo.modes import MODES, held_bytes
from fp16kit.demo.text import is_validation, list_sources, load_corpus


def _tree(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_split_is_by_file_deterministic_and_skips_tests_and_packages(tmp_path):
    files = {f"pkg{i % 7}/mod{i}.py": f"# module {i}\nx = {i}\n" * (i + 1) for i in range(200)}
    skipped = {"test/test_x.py": "no", "site-packages/p/q.py": "no", "a/tests/t.py": "no", "a/idle_test/t.py": "no",
               "a/__pycache__/m.py": "no", "notes.txt": "no"}
    _tree(tmp_path, {**files, **skipped})
    assert list_sources(tmp_path) == sorted(files)
    a, b = load_corpus(tmp_path), load_corpus(tmp_path)
    val = [rel for rel in sorted(files) if is_validation(rel)]
    assert 5 <= len(val) <= 40  # about 10% of 200
    assert (a.train_files, a.val_files) == (200 - len(val), len(val))
    # whole files on each side, concatenated in path order
    assert bytes(a.val.tolist()) == "".join(files[r] for r in val).encode()
    assert bytes(a.train.tolist()) == "".join(files[r] for r in sorted(files) if r not in val).encode()
    assert a.fingerprint == b.fingerprint and torch.equal(a.train, b.train)
    # a file's side depends on its own path only: adding files moves nothing else
    _tree(tmp_path, {"zzz/extra.py": "y = 1\n"})
    c = load_corpus(tmp_path)
    assert c.val_files + c.train_files == 201 and c.fingerprint != a.fingerprint
    assert bytes(c.val.tolist()).startswith(bytes(a.val.tolist())) or is_validation("zzz/extra.py")
    # the rule: SHA-256 of the relative path, first 8 hex digits, modulo 10 (known values)
    assert [is_validation(p) for p in ("os.py", "json/decoder.py", "asyncio/tasks.py")] == [
        int(__import__("hashlib").sha256(p.encode()).hexdigest()[:8], 16) % 10 == 0
        for p in ("os.py", "json/decoder.py", "asyncio/tasks.py")]


def test_the_stdlib_corpus_splits_the_same_way_twice():
    a, b = load_corpus(), load_corpus()
    assert a.fingerprint == b.fingerprint and a.train_files > 10 * a.val_files / 2 and a.val.numel() > 100_000
    assert "split by file" in a.describe() and a.fingerprint[:16] in a.describe()
    x1, y1 = a.validation(8, 16)
    x2, _ = b.validation(8, 16)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the next bytes
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(a.batch(g1, 4, 16)[0], b.batch(g2, 4, 16)[0])


def test_model_shapes_causality_and_sizes():
    cfg = SIZES["quick"]
    torch.manual_seed(0)
    model = ByteLM(cfg)
    idx = torch.randint(0, 256, (3, cfg.seq_len))
    logits = model(idx)
    assert logits.shape == (3, cfg.seq_len, 256) and logits.dtype == torch.float32
    changed = idx.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    assert torch.equal(model(changed)[:, :20], logits[:, :20])  # a byte sees only the bytes before it
    assert model(idx[:, :5]).shape == (3, 5, 256)
    with pytest.raises(ValueError, match="longer than seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="multiple of heads"):
        LMConfig(d_model=64, layers=1, heads=3, seq_len=8, batch=1)
    assert model.tok.weight is dict(model.named_parameters())["tok.weight"]  # the head is tied
    for name, c in SIZES.items():  # every Linear weight and the token embedding are large enough for 8-bit moments
        params = dict(ByteLM(c).named_parameters()) if name != "gpu" else {}
        assert all(p.numel() >= 4096 for k, p in params.items() if p.dim() == 2 and k != "pos.weight"), name
    assert sum(p.numel() for p in ByteLM(SIZES["cpu"]).parameters()) < 3_000_000


def test_held_bytes_counts_each_storage_once():
    buf = torch.zeros(100, dtype=torch.uint8)
    assert held_bytes(iter([buf[:50], buf[50:], buf])) == 100
    assert held_bytes(iter([torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16)])) == 60


def _rows(text):
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    rows = {}
    for line in lines[header + 2:]:
        if not line.strip():
            break
        rows[line.split()[0]] = line.split()
    return lines[header].split(), rows


def _expected_bytes(cfg, weight_bytes, moment_bits):
    params = list(ByteLM(cfg).parameters())
    n = sum(p.numel() for p in params)
    total = 0
    for p in params:
        total += weight_bytes * p.numel()
        total += (2 * p.numel() if moment_bits == 8 and p.numel() >= 4096 else 8 * p.numel())
    return total / n


def test_quick_run_trains_every_mode_and_writes_the_table_and_picture(tmp_path, capsys):
    from fp16kit.__main__ import main

    pytest.importorskip("matplotlib")
    out = tmp_path / "pics" / "lm.png"
    assert main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    header, rows = _rows(text)
    assert header[:4] == ["mode", "train", "loss", "val"]
    assert list(rows) == list(MODES)
    cfg = SIZES["quick"]
    for name, cells in rows.items():
        train, val, tokens = float(cells[1]), float(cells[2]), float(cells[-4].replace(",", ""))
        assert math.isfinite(train) and val < math.log(256), name  # it learned something in 6 steps
        assert tokens > 0, name
    bpp = {name: float(cells[-3]) for name, cells in rows.items()}
    assert bpp["fp32"] == bpp["torch-amp"] == bpp["fp32-lamb"] == bpp["amp-lamb"] == 12.0
    assert bpp["O2-lamb"] == bpp["bf16-master"] == 14.0  # 2-byte model + 4-byte masters + 8 bytes of moments
    assert (bpp["bf16-split"], bpp["bf16-stochastic"]) == (12.0, 10.0)
    for weights, name in ((6, "bf16-master-8bit"), (4, "bf16-split-8bit"), (2, "bf16-stochastic-8bit")):
        # codes 2 B/param for the matrices (+ a 4-byte absmax per 256 and padding), fp32 moments for the rest
        assert bpp[name] == pytest.approx(_expected_bytes(cfg, weights, 8), abs=0.06), name
        assert bpp[name] < bpp[name.removesuffix("-8bit")] - 5
    for name in ("fp32", "fp32-lamb", "bf16-master", "bf16-split", "bf16-stochastic"):
        assert rows[name][-2] == "0" and rows[name][-1] == "-", name  # no scaler, nothing skipped
    for name in ("torch-amp", "amp-lamb", "O2-lamb"):
        assert float(rows[name][-1]) >= 2.0**14, name  # a dynamic scale started at 2^16
    assert rows["fp32"][3] == "ref" and rows["amp-lamb"][4] == "(fp32-lamb)"
    assert "split by file" in text and f"picture: {out}" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_help_and_bad_arguments(capsys):
    from fp16kit.demo import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--steps", "--quick", "--size", "--modes", "--device", "--out", "--seed", "--task digits"):
        assert option in text, option
    assert main(["--modes", "fp32,fp8"]) == 2
    assert "unknown mode(s) ['fp8']" in capsys.readouterr().err
    assert main(["--steps", "2"]) == 2


def test_convergence_summary_pairs_each_mode_with_its_reference_at_the_same_seed():
    import importlib.util
    from pathlib import Path

    from fp16kit.demo.lm_train import LMResult

    path = Path(__file__).parents[2] / "benchmarks" / "convergence.py"
    spec = importlib.util.spec_from_file_location("convergence_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(mode, seed, val):
        m = MODES[mode]
        return LMResult(mode=mode, reference=m.reference, recipe=m.recipe, seed=seed, train_losses=[val],
                        eval_steps=[0, 1], val_losses=[5.0, val], final_train=val, final_val=val, tokens_per_s=100.0,
                        bytes_per_param=12.0, skipped=0, scale=None, params=10, seconds=1.0)

    runs = [run("fp32", 0, 2.6), run("fp32", 1, 2.5), run("bf16-split", 0, 2.62), run("bf16-split", 1, 2.49)]
    table, stats = bench.summarize(runs)
    assert stats["fp32"]["val_range"] == pytest.approx(0.1)
    assert stats["bf16-split"]["paired"] == pytest.approx([0.02, -0.01])
    assert stats["bf16-split"]["paired_max"] == pytest.approx(0.02)
    row = next(line for line in table.splitlines() if "`bf16-split`" in line)
    assert "+0.0050 / +0.0200" in row and "| 0.20 |" in row  # largest paired difference / the reference's range
