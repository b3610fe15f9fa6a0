"""`python -m kit data ...`: prepare pretraining / fine-tuning data, check a prepared folder, list templates.

The options of `pretrain` and `sft` are generated from DataConfig (kit.core.configs.add_config_arguments): one option
per field, its help the field's documentation, defaults not restated here.
"""

from __future__ import annotations

import argparse
import json
import sys

# fields that mean nothing for one kind (left out of its --help)
_ONLY_SFT = (
    "template",
    "enable_thinking",
    "system",
    "train_on_prompt",
    "mask_history",
    "overlong",
    "pack",
    "pack_window",
)
_ONLY_PRETRAIN = ("add_bos", "keep_special_tokens")


def _add_prepare(sub: argparse._SubParsersAction, kind: str, help_text: str) -> None:
    from kit.core.configs import add_config_arguments
    from kit.data.config import DataConfig

    p = sub.add_parser(kind, help=help_text, description=help_text)
    skip = ("kind",) + (_ONLY_SFT if kind == "pretrain" else _ONLY_PRETRAIN)
    if kind == "dpo":  # pairs: answers only, one pair per row
        skip += ("train_on_prompt", "mask_history", "pack", "pack_window", "megatron")
    add_config_arguments(p, DataConfig, skip=skip, positional=("inputs",))
    p.add_argument(
        "--workspace",
        default=None,
        help="workspace root, when --out-dir is not given (default: KIT_WORKSPACE / runs/ws)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model folder name inside the workspace (default: the project's, else demo)",
    )
    p.set_defaults(func=run, kind=kind)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `data` stage to the kit's command line."""
    p = sub.add_parser("data", help="prepare pretraining / fine-tuning data (HF + Megatron formats)")
    s = p.add_subparsers(dest="what", required=True)
    _add_prepare(s, "pretrain", "plain text -> max_length samples + <name>_text_document.bin/.idx")
    _add_prepare(s, "sft", "dialogs -> packed, answer-masked samples + <name>_packed_*_document.bin/.idx")
    _add_prepare(
        s,
        "dpo",
        "preference pairs -> prompt, chosen and rejected token ids per row (HF rows; MindSpeed-LLM pairwise files)",
    )
    c = s.add_parser(
        "check",
        help="check a prepared <name>_hf folder against its manifest (every row, the Megatron files, the "
        "tokenizer hash), print the manifest",
    )
    c.add_argument("path")
    c.set_defaults(func=run)
    t = s.add_parser("templates", help="list the chat templates")
    t.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The DataConfig the command line describes: the options given, the rest DataConfig's defaults."""
    from kit.core.configs import explicit_values
    from kit.data.config import DataConfig

    values = explicit_values(args, DataConfig)
    values["kind"] = args.kind
    return DataConfig(**values)


def run(args: argparse.Namespace) -> int:
    if args.what == "templates":
        from kit.data.templates import TEMPLATES

        for t in TEMPLATES.values():
            mindspeed = f"--prompt-type {t.prompt_type}" if t.prompt_type else "no MindSpeed-LLM prompt type"
            print(f"{t.name:10s} user={t.user!r} assistant={t.assistant!r}  [{mindspeed}]  ({t.source})")
        print("tokenizer  the tokenizer's own chat_template")
        return 0
    if args.what == "check":
        from kit.data.check import check_prepared
        from kit.data.prepared import read_prepared

        done = check_prepared(args.path)
        prepared = read_prepared(args.path)
        print(json.dumps(prepared.manifest.fields, indent=2, ensure_ascii=False))
        print(
            f"ok: {done['samples']} samples, columns {done['columns']}, every row's lengths and token ids"
            + (
                f"; held out: {done['heldout_rows']} rows in {prepared.heldout['path']}"
                if prepared.heldout
                else ""
            )
            + f"; {done['megatron_files']} Megatron files (hashes {done['megatron_hashes']}); tokenizer "
            f"{done['tokenizer']}"
        )
        return 0
    from kit.core.workspace import get_workspace
    from kit.data.pipeline import prepare

    cfg = config_from_args(args)
    ws = None if cfg.out_dir else get_workspace(args.workspace, model=args.model)
    from kit.storage.partial import sigterm_as_interrupt

    # expected failures are KitErrors (and OSErrors such as a full disk): `kit.__main__` prints them as one line;
    # SIGTERM removes the temporary outputs like Ctrl-C; the plot is written before the manifest
    with sigterm_as_interrupt():
        result = prepare(cfg, ws, plot=True)
    print(json.dumps(result.summary(), indent=2, ensure_ascii=False))
    for w in result.report.warnings:
        print(f"warning: {w}", file=sys.stderr)  # stdout stays one JSON document
    return 0
