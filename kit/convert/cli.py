"""`python -m kit convert ...`: HF <-> Megatron conversion, options generated from ConvertConfig; also accepts the
ModelLink `util.py` flags of the ModelArts user manual."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
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
    from kit.convert.config import ConvertConfig
    from kit.core.configs import add_config_arguments

    p = sub.add_parser(
        "convert",
        help="convert weights HF <-> Megatron (TP x PP), or re-shard Megatron",
        description="Kit form: --source HF --target OUT --tp 2 --pp 2. The ModelArts user manual's ModelLink form "
        "(section 'HuggingFace权重转换操作') works too: --model-type GPT --loader llama2_hf --saver megatron "
        "--target-tensor-parallel-size 8 --target-pipeline-parallel-size 8 --load-dir HF --save-dir OUT "
        "--tokenizer-model TOK.",
    )
    add_config_arguments(p, ConvertConfig)  # one option per field, help from its field docstring
    # ModelLink util.py spellings of the same fields (the README documents them): aliases, not new settings.
    for flag, dest in (
        ("--load-dir", "source"),
        ("--save-dir", "target"),
        ("--target-tensor-parallel-size", "tp"),
        ("--target-pipeline-parallel-size", "pp"),
        ("--target-expert-parallel-size", "ep"),
        ("--key-flavor", "flavor"),
        ("--params-dtype", "dtype"),
    ):
        kind = int if dest in ("tp", "pp", "ep") else str
        p.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=f"same as --{dest}")
    p.add_argument("--use-mcore-models", action="store_true", help="ModelLink flag; same as --flavor local")
    p.add_argument(
        "--verify", action="store_true", help="after HF->Megatron: logits check against the HF model"
    )
    p.add_argument("--no-progress", action="store_true")
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
    if getattr(args, "direction", None):
        return args.direction
    loader = (args.loader or "").lower()
    to_hf = (args.saver or "").lower() in ("hf", "huggingface") or bool(args.save_model_type)
    if loader == "megatron" or loader == "mcore":
        return "megatron_to_hf" if to_hf else "megatron_to_megatron"
    return "hf_to_megatron"


@contextlib.contextmanager
def _lean_process():
    """Less start-up work for the conversion (its wall time is benchmarked against a copy): numpy, imported only to
    count NaN / inf (kit.convert.weights_check), comes without OpenBLAS worker threads (nothing here does linear algebra in
    numpy; they would take CPU from the writer threads), and the objects imported so far are frozen for the
    garbage collector, so its collections during the conversion do not walk them again (unfrozen after)."""
    gc.freeze()  # before numpy's import too: the collections it triggers then skip what was imported before
    try:
        if "numpy" not in sys.modules:
            unset = "OPENBLAS_NUM_THREADS" not in os.environ
            if unset:
                os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read once, when OpenBLAS loads
            try:
                import numpy  # noqa: F401
            finally:
                if unset:
                    del os.environ["OPENBLAS_NUM_THREADS"]  # not passed on to anything this process starts
        gc.freeze()  # and numpy's objects
        yield
    finally:
        gc.unfreeze()


def run(args: argparse.Namespace) -> int:
    from kit.convert.config import ConvertConfig
    from kit.convert.result import run as run_conversion
    from kit.core.configs import explicit_values
    from kit.errors import InputError
    from kit.storage.partial import sigterm_as_interrupt

    if args.model_type != "GPT":
        raise InputError(f"--model-type {args.model_type!r}: only GPT (decoder-only) models are converted.")
    values = explicit_values(args, ConvertConfig)
    missing = [
        f"--{n} (--{alias})"
        for n, alias in (("source", "load-dir"), ("target", "save-dir"))
        if n not in values
    ]
    if missing:
        raise InputError(f"{' and '.join(missing)} required: the folder to convert and the output folder.")
    if not values.get("family") and args.loader and args.loader.endswith("_hf"):
        values["family"] = args.loader
    if values.get("dtype"):
        values["dtype"] = _DTYPE_ALIASES.get(values["dtype"], values["dtype"])
    values["direction"] = _direction(args)
    cfg = ConvertConfig(**values)
    # Expected failures (ConversionError, ConfigError, an existing output, ...) propagate to `python -m kit`,
    # which prints them as one `error: ...` line with exit code 2. A SIGTERM cleans up like Ctrl-C.
    with sigterm_as_interrupt(), _lean_process():
        result = run_conversion(cfg, progress=not args.no_progress)
    summary = result.summary()
    for item in summary.get("leftover_partials", []):
        if item["removed"]:
            print(f"removed leftover partial output {item['path']} ({item['mib']:.1f} MiB)", file=sys.stderr)
        else:
            print(
                f"note: {item['path']} ({item['mib']:.1f} MiB) is left from an interrupted run; "
                f"--clean-partial removes it",
                file=sys.stderr,
            )
    tok = Path(args.tokenizer_model) if args.tokenizer_model else None
    if tok is not None and tok.is_file() and cfg.direction != "megatron_to_hf":
        dst = Path(cfg.target) / "hf_meta" / tok.name
        if not dst.exists():
            from kit.convert.hf_io import copy_small
            from kit.convert.manifests import refresh_tokenizer_hash

            copy_small(tok, dst)
            refresh_tokenizer_hash(cfg.target)  # the manifest describes the folder as it is now
    if args.verify and cfg.direction == "hf_to_megatron":
        from kit.convert.verify import logits_check

        # the weights are written: a run stopped during the check still says so
        print(f"converted into {cfg.target}; now the logits check", file=sys.stderr, flush=True)
        summary["logits_check"] = check = logits_check(cfg.source, cfg.target)
        if check["passed"] is None:
            print(check["skipped"], file=sys.stderr)
    print(json.dumps(summary, indent=2, default=str))
    if args.verify and summary.get("logits_check", {}).get("passed") is False:
        return 1
    return 0
