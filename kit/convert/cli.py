"""`python -m kit convert ...`: HF <-> Megatron conversion; also accepts the seed's ModelLink `util.py` flags."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import threading
from pathlib import Path

_DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert weights HF <-> Megatron (TP x PP), or re-shard Megatron",
        description="Seed form: --model-type GPT --loader llama2_hf --saver megatron --target-tensor-parallel-size 8 "
        "--target-pipeline-parallel-size 8 --load-dir HF --save-dir OUT --tokenizer-model TOK. "
        "Kit form: --source HF --target OUT --tp 2 --pp 2.",
    )
    p.add_argument("--source", "--load-dir", dest="source", required=True, help="folder to convert")
    p.add_argument("--target", "--save-dir", dest="target", required=True, help="output folder")
    p.add_argument(
        "--direction",
        choices=("hf_to_megatron", "megatron_to_hf", "megatron_to_megatron"),
        help="default: from --loader/--saver, else hf_to_megatron",
    )
    p.add_argument("--tp", "--target-tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--pp", "--target-pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--num-layer-list", default=None, help="uneven PP: layers per stage, e.g. 3,5")
    p.add_argument(
        "--family", default=None, help="llama | chatglm | baichuan (default: config.json model_type)"
    )
    p.add_argument(
        "--flavor",
        "--key-flavor",
        dest="flavor",
        default=None,
        choices=("local", "legacy", "te"),
        help="Megatron key names: local = megatron-core local spec (default), legacy, te",
    )
    p.add_argument("--use-mcore-models", action="store_true", help="ModelLink flag; same as --flavor local")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--padded-vocab-size", type=int, default=None)
    p.add_argument("--dtype", "--params-dtype", dest="dtype", default=None, choices=sorted(_DTYPE_ALIASES))
    p.add_argument(
        "--hf-config-dir", default=None, help="megatron->HF: original HF folder (config, tokenizer)"
    )
    p.add_argument("--max-shard-mb", type=int, default=2048)
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument(
        "--clean-partial",
        action="store_true",
        help="delete leftover .TARGET.partial-* folders of interrupted runs (they are reported otherwise)",
    )
    p.add_argument(
        "--verify", action="store_true", help="after HF->Megatron: logits check against the HF model"
    )
    p.add_argument("--no-progress", action="store_true")
    # ModelLink util.py flags (seed 002), accepted so the user's command runs unchanged.
    p.add_argument("--model-type", default="GPT", help="accepted for util.py compatibility; only GPT")
    p.add_argument("--loader", default=None, help="llama2_hf | chatglm3_hf | baichuan2_hf | megatron")
    p.add_argument("--saver", default=None, help="megatron | hf")
    p.add_argument(
        "--save-model-type", default=None, help="ModelLink: save_huggingface_llama / hf -> HF output"
    )
    p.add_argument(
        "--tokenizer-model", default=None, help="tokenizer file to keep beside the converted weights"
    )
    p.set_defaults(func=run)


def _direction(args: argparse.Namespace) -> str:
    if args.direction:
        return args.direction
    loader = (args.loader or "").lower()
    to_hf = (args.saver or "").lower() in ("hf", "huggingface") or bool(args.save_model_type)
    if loader == "megatron" or loader == "mcore":
        return "megatron_to_hf" if to_hf else "megatron_to_megatron"
    return "hf_to_megatron"


def _on_sigterm(signum, frame):  # a kill cleans up like Ctrl-C: temporary folders are removed on the way out
    raise KeyboardInterrupt(f"terminated by signal {signum}")


def _partials(target: str, clean: bool) -> None:
    from kit.atomic import leftover_partials, remove_partials

    found = remove_partials(target) if clean else leftover_partials(target)
    for path, size in found:
        if clean:
            print(f"removed leftover partial output {path} ({size / 1024**2:.1f} MiB)", file=sys.stderr)
        else:
            print(
                f"note: {path} ({size / 1024**2:.1f} MiB) is left from an interrupted run; "
                f"--clean-partial removes it",
                file=sys.stderr,
            )


def run(args: argparse.Namespace) -> int:
    from kit.convert.config import ConvertConfig
    from kit.convert.convert import convert

    if args.model_type != "GPT":
        print(
            f"error: --model-type {args.model_type!r}: only GPT (decoder-only) models are converted.",
            file=sys.stderr,
        )
        return 2
    family = args.family
    if not family and args.loader and args.loader.endswith("_hf"):
        family = args.loader
    cfg = ConvertConfig(
        source=args.source,
        target=args.target,
        direction=_direction(args),
        tp=args.tp,
        pp=args.pp,
        num_layer_list=[int(x) for x in args.num_layer_list.split(",")] if args.num_layer_list else None,
        family=family,
        flavor=args.flavor or "local",
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        padded_vocab_size=args.padded_vocab_size,
        dtype=_DTYPE_ALIASES.get(args.dtype) if args.dtype else None,
        hf_config_dir=args.hf_config_dir,
        max_shard_mb=args.max_shard_mb,
        overwrite=args.overwrite,
        clean_partial=args.clean_partial,
    )
    _partials(cfg.target, args.clean_partial)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    # Expected failures (ConversionError, ConfigError, an existing output, ...) propagate to `python -m kit`,
    # which prints them as one `error: ...` line with exit code 2.
    summary = convert(cfg, progress=not args.no_progress)
    tok = Path(args.tokenizer_model) if args.tokenizer_model else None
    if tok is not None and tok.is_file() and cfg.direction != "megatron_to_hf":
        dst = Path(cfg.target) / "hf_meta" / tok.name
        if not dst.exists():
            shutil.copy2(tok, dst)
    if args.verify and cfg.direction == "hf_to_megatron":
        from kit.convert.verify import logits_check

        summary["logits_check"] = logits_check(cfg.source, cfg.target)
    print(json.dumps(summary, indent=2, default=str))
    if args.verify and not summary.get("logits_check", {}).get("passed", True):
        return 1
    return 0
