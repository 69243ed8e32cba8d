"""``python -m fp16kit doctor`` on the demo model, and the demo's doctor picture, in their short modes."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from fp16kit.__main__ import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"


def test_doctor_command_writes_table_json_and_pictures(tmp_path, capsys):
    out = tmp_path / "doc"
    assert cli_main(["doctor", "--quick", "--every", "20", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fp16kit doctor on the demo MLP" in text and "recommended loss scale" in text
    assert (out / "doctor.txt").read_text().startswith("fp16kit doctor on the demo MLP")
    data = json.loads((out / "doctor.json").read_text())
    assert data["samples"] == 3 and data["steps"] == 60
    # O0 trains in fp32: the advice is at the scale recommended for fp16, and says so
    assert data["loss_scale_basis"] == "recommended" and data["loss_scale"] > 1.0
    assert "recommended for float16" in text
    assert [e["kind"] for e in data["entries"]].count("activation") == 6  # 3 Linear, BatchNorm, 2 ReLU
    fp16 = data["formats"]["float16"]
    assert abs(sum(fp16["total"]["fractions"].values()) - 1.0) < 1e-12
    for name in ("doctor.png", "doctor-unscaled.png"):
        assert (out / name).read_bytes()[:8] == PNG


def test_doctor_command_options(tmp_path, capsys):
    out = tmp_path / "bf16"
    args = ["doctor", "--quick", "--every", "30", "--no-activations", "--dtype", "bfloat16", "--loss-scale", "1024"]
    assert cli_main([*args, "--out", str(out)]) == 0
    data = json.loads((out / "doctor.json").read_text())
    assert data["dtype"] == "bfloat16" and data["loss_scale"] == 1024.0 and data["samples"] == 2
    assert {e["kind"] for e in data["entries"]} == {"param"}


def test_doctor_command_rejects_a_scale_that_is_not_a_power_of_two(tmp_path, capsys):
    assert cli_main(["doctor", "--quick", "--every", "30", "--loss-scale", "3", "--out", str(tmp_path)]) == 2
    assert "power of two" in capsys.readouterr().err


def test_demo_writes_the_doctor_picture_of_its_o2_run(tmp_path, capsys):
    out = tmp_path / "demo.png"
    assert cli_main(["demo", "--task", "digits", "--quick", "--no-progress", "--runs", "O2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    picture = tmp_path / "demo-doctor-O2.png"
    assert f"picture: {picture}" in text and picture.read_bytes()[:8] == PNG
