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


def _unavailable(name: str, exc: ImportError):
    def run(_args) -> int:
        raise SystemExit(
            f"`python -m kit {name}` cannot run here: {exc}. Install the kit with its extras "
            f"(`pip install -e .[data,convert,train,profile,envs,samples,notebooks]`) and retry."
        )

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kit", description="Ascend notebook kit, stage by stage.")
    sub = parser.add_subparsers(dest="stage", required=True)
    for module in STAGES.values():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # e.g. an optional dependency of one stage is missing
            name = next(k for k, v in STAGES.items() if v == module)
            sub.add_parser(name, help=f"(unavailable: {exc})").set_defaults(func=_unavailable(name, exc))
            continue
        mod.register(sub)
    return parser


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
