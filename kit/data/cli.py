"""`python -m kit data ...`: prepare pretraining / fine-tuning data, check a prepared folder, list templates."""

from __future__ import annotations

import argparse
import json
import sys


def _add_prepare(sub: argparse._SubParsersAction, kind: str, help_text: str) -> None:
    p = sub.add_parser(kind, help=help_text)
    p.add_argument(
        "inputs", nargs="*", help="files or folders (.jsonl .json .parquet .csv .txt); default: sample"
    )
    p.add_argument("--name", default="corpus" if kind == "pretrain" else "alpaca", help="output name")
    p.add_argument(
        "--tokenizer", default=None, help="local HF tokenizer/model folder (default: sample tokenizer)"
    )
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer folder's own code")
    p.add_argument("--max-length", type=int, default=2048, help="tokens per sample (SEQ_LEN)")
    p.add_argument("--out-dir", default=None, help="output folder (default: the workspace's data folder)")
    p.add_argument("--workspace", default=None, help="workspace root (default: KIT_WORKSPACE / runs/ws)")
    p.add_argument("--model", default="demo", help="model name in the workspace")
    p.add_argument("--input-format", default="auto", help="auto, text, alpaca, sharegpt or openai")
    p.add_argument("--columns", default="{}", help='field mapping as JSON, e.g. \'{"text": "content"}\'')
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--max-records", type=int, default=None)
    p.add_argument("--on-error", default="raise", choices=["raise", "skip"])
    p.add_argument("--no-megatron", action="store_true", help="skip the Megatron .bin/.idx files")
    p.add_argument("--overwrite", action="store_true")
    if kind == "pretrain":
        p.add_argument("--add-bos", action="store_true", help="BOS before each document")
        p.add_argument(
            "--keep-special-tokens",
            action="store_true",
            help="special-token strings in the text ('<|endoftext|>') become control tokens "
            "(default: tokenized as plain text; counted in the report either way)",
        )
    else:
        p.add_argument("--template", default="telechat", help="see `python -m kit data templates`")
        p.add_argument("--system", default=None, help="system prompt for dialogs without one")
        p.add_argument("--train-on-prompt", action="store_true")
        p.add_argument("--mask-history", action="store_true")
        p.add_argument("--overlong", default="truncate", choices=["truncate", "drop"])
        p.add_argument("--no-pack", action="store_true", help="one dialog per sample")
    p.set_defaults(func=run, kind=kind)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `data` stage to the kit's command line."""
    p = sub.add_parser("data", help="prepare pretraining / fine-tuning data (HF + Megatron formats)")
    s = p.add_subparsers(dest="what", required=True)
    _add_prepare(s, "pretrain", "plain text -> max_length samples + <name>_text_document.bin/.idx")
    _add_prepare(s, "sft", "dialogs -> packed, answer-masked samples + <name>_packed_*_document.bin/.idx")
    c = s.add_parser("check", help="load and validate a prepared <name>_hf folder, print its meta")
    c.add_argument("path")
    c.set_defaults(func=run)
    t = s.add_parser("templates", help="list the chat templates")
    t.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The DataConfig the command-line arguments describe."""
    from kit.configs import ConfigError
    from kit.data.config import DataConfig

    try:
        columns = json.loads(args.columns)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [
                f'the value of --columns, {args.columns!r}, is not JSON ({exc}); write e.g. \'{{"text": "content"}}\'.'
            ],
            "the command line",
        ) from None
    kw = dict(
        kind=args.kind,
        inputs=list(args.inputs),
        name=args.name,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        max_length=args.max_length,
        out_dir=args.out_dir,
        input_format=args.input_format,
        columns=columns,
        num_workers=args.num_workers,
        batch_size=args.batch_size,
        max_records=args.max_records,
        on_error=args.on_error,
        megatron=not args.no_megatron,
        overwrite=args.overwrite,
    )
    if args.kind == "pretrain":
        kw.update(add_bos=args.add_bos, keep_special_tokens=args.keep_special_tokens)
    else:
        kw.update(
            template=args.template,
            system=args.system,
            train_on_prompt=args.train_on_prompt,
            mask_history=args.mask_history,
            overlong=args.overlong,
            pack=not args.no_pack,
        )
    return DataConfig(**kw)


def run(args: argparse.Namespace) -> int:
    if args.what == "templates":
        from kit.data.templates import TEMPLATES

        for t in TEMPLATES.values():
            print(f"{t.name:10s} user={t.user!r} assistant={t.assistant!r}  ({t.source})")
        print("tokenizer  the tokenizer's own chat_template")
        return 0
    if args.what == "check":
        from kit.data.output import load_prepared

        ds, meta = load_prepared(args.path, return_meta=True)
        print(json.dumps(meta, indent=2, ensure_ascii=False))
        print(f"ok: {len(ds)} samples, columns {ds.column_names}")
        return 0
    from kit.data.pipeline import prepare
    from kit.workspace import get_workspace

    cfg = config_from_args(args)
    ws = None if cfg.out_dir else get_workspace(args.workspace, model=args.model)
    # expected failures are KitErrors (and OSErrors such as a full disk): `kit.__main__` prints them as one line
    result = prepare(cfg, ws)
    result.plot_lengths()
    print(json.dumps(result.summary(), indent=2, ensure_ascii=False))
    for w in result.report.warnings:
        print(f"warning: {w}", file=sys.stderr)  # stdout stays one JSON document
    return 0
