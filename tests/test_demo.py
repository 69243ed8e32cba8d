"""``python -m fp16kit demo`` in its short mode: every run trains, the table is printed, the PNG is written."""

from __future__ import annotations

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from fp16kit.__main__ import main as cli_main
from fp16kit.demo import main


def test_quick_demo_trains_every_level_and_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "plots" / "demo.png"
    assert cli_main(["demo", "--quick", "--no-progress", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    assert lines[header].split()[:4] == ["run", "final", "loss", "test"]
    rows = {line.split()[0]: line.split() for line in lines[header + 2:header + 7]}
    assert list(rows) == ["O0", "O1", "O2", "O3", "O2-bf16"]
    for label, cells in rows.items():
        final_loss, accuracy = float(cells[1]), float(cells[2].rstrip("%"))
        assert final_loss < 1.0, label  # 60 steps take the loss from ln(10) = 2.3 well below 1
        assert accuracy > 70.0, label  # chance is 10%
        assert float(cells[4]) == (1.0 if label in ("O0", "O3") else float(cells[4]))
    assert float(rows["O2"][4]) >= 65536.0 / 2  # dynamic: started at 2**16
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"plot: {out}" in text


def test_help_documents_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--steps", "--quick", "--device", "--out", "--runs", "--optimizer", "--scale-window"):
        assert option in text


def test_bad_arguments_are_reported(capsys):
    assert main(["--runs", "O4"]) == 2
    assert "unknown run(s) ['O4']" in capsys.readouterr().err
    assert main(["--steps", "0"]) == 2
