"""Regenerate the figures of docs/demo.md and docs/doctor.md from runs on this machine.

Every figure those pages show from a run sits in a generated block::

    <!-- doc-numbers:NAME -->
    ...
    <!-- /doc-numbers -->

and each block starts with a line naming the machine, the builds and the command that produced it. The
pictures (docs/images/demo.png, doctor.png, doctor-unscaled.png, doctor-bert.png) come from the same runs.
Figures that depend on the CPU and the torch build (losses, skipped steps, final scales, times) are an example
from that machine, not a promise; the demo's claims that hold everywhere are checked by tests/test_demo.py.

Run from a checkout with the demo extra (and transformers for the BERT example)::

    python scripts/doc_numbers.py            # all blocks
    python scripts/doc_numbers.py --only doctor-bert
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
IMAGES = DOCS / "images"
BLOCK = re.compile(r"(<!-- doc-numbers:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /doc-numbers -->)", re.S)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{cpu}, {os.cpu_count()} logical CPUs (shared), {platform.system()} {platform.machine()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, fp16kit {commit}; {when}")


def fp16kit(*args: str, cwd: Path = ROOT) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "fp16kit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True)
    return done.stdout


_MACHINE: list[str] = []  # filled once, before any run writes into the checkout


def block(command: str, text: str, lang: str = "") -> str:
    return (f"Produced by `python scripts/doc_numbers.py` (`{command}`) on {_MACHINE[0]}.\n\n"
            f"```{lang}\n{text.rstrip()}\n```\n")


def demo(tmp: Path) -> dict[str, str]:
    out = fp16kit("demo", "--task", "digits", "--no-progress", "--out", str(tmp / "demo.png"))
    shutil.copy(tmp / "demo.png", IMAGES / "demo.png")
    table = "\n".join(line for line in out.splitlines() if not line.startswith(("plot:", "doctor (", "mem (training")))
    adam = fp16kit("demo", "--task", "digits", "--no-progress", "--optimizer", "adam", "--runs", "O0,O1,O2,O3,O2-bf16",
                   "--doctor-every", "0", "--out", str(tmp / "adam.png"))
    adam_table = "\n".join(line for line in adam.splitlines()
                           if line.startswith(("run ", "---", "O0", "O1", "O2", "O3")))
    return {"demo-sgd": block("python -m fp16kit demo --task digits", table.strip()),
            "demo-adam": block("python -m fp16kit demo --task digits --optimizer adam", adam_table)}


def doctor_demo(tmp: Path) -> dict[str, str]:
    out = fp16kit("doctor", "--out", str(tmp / "doctor"))
    for name in ("doctor.png", "doctor-unscaled.png"):
        shutil.copy(tmp / "doctor" / name, IMAGES / name)
    text = out.split("\nwrote ")[0]
    return {"doctor-demo": block("python -m fp16kit doctor", text)}


BERT = '''
import torch
from transformers import BertConfig, BertForMaskedLM


def make():
    """The issue's tiny BERT (hidden 32, 2 layers, vocab 100), random tokens, the labels the tokens."""
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(20):
        ids = torch.randint(0, 100, (8, 16), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return BertForMaskedLM(cfg), batches
'''


def doctor_bert(tmp: Path) -> dict[str, str]:
    (tmp / "tiny_bert.py").write_text(BERT)
    out = fp16kit("doctor", "--model", "tiny_bert:make", "--steps", "20", "--every", "5", "--out", "bert", cwd=tmp)
    shutil.copy(tmp / "bert" / "doctor.png", IMAGES / "doctor-bert.png")
    at1 = fp16kit("doctor", "--model", "bert/doctor.json", "--loss-scale", "1", "--out", "bert1", cwd=tmp)
    shutil.copy(tmp / "bert1" / "doctor.png", IMAGES / "doctor-bert-unscaled.png")
    return {"doctor-bert": block("python -m fp16kit doctor --model tiny_bert:make --steps 20 --every 5",
                                 out.split("\nwrote ")[0]),
            "doctor-bert-unscaled": block("python -m fp16kit doctor --model bert/doctor.json --loss-scale 1",
                                          at1.split("\nwrote ")[0])}


def fill(path: Path, blocks: dict[str, str]) -> list[str]:
    text = path.read_text()
    done = []

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in blocks:
            return m.group(0)
        done.append(name)
        return m.group(1) + blocks[name] + m.group(4)

    path.write_text(BLOCK.sub(sub, text))
    return done


JOBS = {"demo": demo, "doctor-demo": doctor_demo, "doctor-bert": doctor_bert}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=sorted(JOBS), action="append", help="regenerate these blocks only")
    args = p.parse_args(argv)
    blocks: dict[str, str] = {}
    _MACHINE.append(machine())
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or JOBS:
            print(f"running {name} ...", flush=True)
            blocks.update(JOBS[name](Path(tmp)))
    filled = fill(DOCS / "demo.md", blocks) + fill(DOCS / "doctor.md", blocks)
    missing = sorted(set(blocks) - set(filled))
    print("filled: " + ", ".join(filled) + (f"; no place for {missing}" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
