"""The `hopdec` command line: one subcommand per job, each implemented in the module that owns it."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
COMMANDS = {
    "synth": ("loader.synth", "write a deterministic synthetic checkpoint for a config"),
    "inspect": ("loader.inspect", "validate a checkpoint and print tensors, formats and per-rank bytes"),
    "demo": ("executor.demo", "tiny model: prefill, greedy DSpark decode, timings"),
    "devicecheck": ("executor.devicecheck", "run every GPU test and benchmark; write report.json"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hopdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            p.set_defaults(_missing=f"'hopdec {name}' is not available in this build ({module} missing)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "_missing", None):
        print(args._missing, file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
