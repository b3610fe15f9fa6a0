"""Command line: `python -m kit <stage> ...`, one sub-command per stage, each defined in its own module.

Only the stage that is asked for is imported (`python -m kit convert --help` does not load pandas or the data
stack). Expected failures print `error: ...` on one line and exit 2 (`错误：...` when KIT_LANG or the project says
zh, kit.core.i18n); `--debug` or `KIT_DEBUG=1` shows tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional

from kit.core.i18n import ENV, check_language, t
from kit.errors import (
    EXIT_UNEXPECTED,
    EXIT_USER_ERROR,
    INSTALL_EXTRAS,
    KitError,
    debug_enabled,
    error_line,
    user_message,
)

# sub-command -> (module with `register(subparsers)`, one-line help shown by `python -m kit --help`)
STAGES = {
    "project": (
        "kit.core.project",
        "set the project's model, workspace and language once for every notebook and command",
    ),
    "doctor": ("kit.doctor.report", "check Python, torch, torch_npu, CANN, driver, devices, DeepSpeed"),
    "device-check": (
        "kit.doctor.device_check",
        "a few minutes on a new device: kit ops vs float64, model parity, 2-card step, training, profile",
    ),
    "demo": (
        "kit.core.notebooks",
        "run the numbered notebooks headless on the embedded defaults (make demo)",
    ),
    "env": ("kit.envs.cli", "conda envs / venvs on persistent storage, archives, Jupyter kernels with CANN"),
    "data": ("kit.data.cli", "prepare pretraining / fine-tuning data (HF + Megatron formats)"),
    "convert": ("kit.convert.cli", "convert weights HF <-> Megatron with TP/PP"),
    "megatron": (
        "kit.train.preflight.cli",
        "Megatron path on CPU: megatron-core preflight of the converted shards",
    ),
    "adapt": ("kit.adapt.cli", "NPU adaptation: remote-code fixes, kit-op parity check"),
    "plan": ("kit.plan.cli", "will a training run fit on the cards, and how fast (no weights needed)"),
    "train": ("kit.train.cli", "train with DeepSpeed (pretrain / sft / lora / retrain), launch, logs"),
    "job": (
        "kit.train.job.cli",
        "ModelArts training job on N nodes from a training config (dry run; --submit sends it)",
    ),
    "profile": ("kit.profiling.cli", "capture and analyze profiles, slow-operator advice"),
    "evaluate": ("kit.evaluate.cli", "base vs trained: held-out loss, multiple choice, answers, speed"),
    "serve": (
        "kit.serve.cli",
        "serve the trained model (OpenAI API), load-test it, package it for ModelArts",
    ),
    "obs": ("kit.storage.obs", "copy a stage's folder to or from OBS (OBS_HOME runs: docs/obs.md)"),
    "samples": ("kit.core.samples.cli", "build tiny seeded or demo checkpoints"),
}


def _unavailable(name: str, exc: ImportError):
    def run(_args) -> int:
        print(
            error_line(f"`python -m kit {name}` cannot run here: {exc} — {INSTALL_EXTRAS} and retry."),
            file=sys.stderr,
        )
        return EXIT_USER_ERROR

    return run


def _said(key: str, **values) -> str:
    """The catalog's line; in English when the language setting itself is what failed (the line is still written)."""
    try:
        return t(key, **values)
    except KitError:
        return t(key, _lang="en", **values)


def _requested_stage(argv: list) -> Optional[str]:
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in STAGES else None
    return None


def build_parser(argv: Optional[list] = None) -> argparse.ArgumentParser:
    """The parser; only the stage named in `argv` is imported (all of them when argv is None)."""
    parser = argparse.ArgumentParser(prog="python -m kit", description="Ascend notebook kit, stage by stage.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks (also KIT_DEBUG=1)")
    sub = parser.add_subparsers(dest="stage", required=True)
    wanted = _requested_stage(argv) if argv is not None else None
    for name, (module, help_text) in STAGES.items():
        if argv is not None and name != wanted:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # e.g. an optional dependency of one stage is missing
            sub.add_parser(name, help=f"(unavailable: {exc})").set_defaults(func=_unavailable(name, exc))
            continue
        mod.register(sub)
    return parser


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in argv:  # accepted anywhere on the line, before or after the stage's own arguments
        argv = [a for a in argv if a != "--debug"]
        os.environ["KIT_DEBUG"] = "1"
    args = build_parser(argv).parse_args(argv)
    try:
        if os.environ.get(ENV, "").strip():  # an unknown KIT_LANG is refused before any work
            check_language(os.environ[ENV].strip(), ENV)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(error_line(_said("cli.interrupted")), file=sys.stderr)
        return 130
    except Exception as exc:
        if debug_enabled():
            raise
        message = user_message(exc)
        if message is not None:
            sys.stderr.write(error_line(message) + "\n")  # one write: ranks share the launcher's stderr
            return EXIT_USER_ERROR
        first = str(exc).splitlines()[0] if str(exc) else ""
        print(error_line(_said("cli.unexpected", kind=type(exc).__name__, first=first)), file=sys.stderr)
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
