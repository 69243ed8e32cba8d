"""Command line: ``python -m fp16kit [info|demo|doctor|run]`` (``info`` is the default)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp16kit", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="versions, devices, and which kernel backend runs on each device, and why")
    demo = sub.add_parser("demo", help="train a small model at opt levels O0-O3 and bf16; table and plot",
                          add_help=False)
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    sub.add_parser("doctor", help="watch a model's gradients (the demo's, or yours: --model MODULE:FACTORY): "
                   "fp16/bf16 ranges, loss scale, layers for fp32",
                   add_help=False)
    sub.add_parser("run", help="run an unmodified apex script on fp16kit: run [--force] SCRIPT [ARGS...]",
                   add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:  # everything after "doctor" is its own
        from .doctor.cli import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["run"]:  # the script's own arguments pass through untouched
        from .compat import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["demo"]:  # hand everything after "demo" over untouched (REMAINDER drops leading options)
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(list(args.demo_args) + rest)
    from ._info import report

    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
