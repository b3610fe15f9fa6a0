"""Command line: `python -m kit <stage> ...`, one sub-command per stage, each defined in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# sub-command -> module with `register(subparsers)`; modules are imported only when their stage exists.
STAGES = {
    "doctor": "kit.doctor",
    "env": "kit.envs.cli",
    "data": "kit.data.cli",
    "convert": "kit.convert.cli",
    "adapt": "kit.adapt.cli",
    "train": "kit.train.cli",
    "profile": "kit.profiling.cli",
    "samples": "kit.samples.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kit", description="Ascend notebook kit, stage by stage.")
    sub = parser.add_subparsers(dest="stage", required=True)
    for module in STAGES.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                continue  # stage not built yet
            raise
        mod.register(sub)
    return parser


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
