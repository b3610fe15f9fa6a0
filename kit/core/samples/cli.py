"""`python -m kit samples ...`: build tiny checkpoints, prepare the demo model."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("samples", help="build tiny seeded or demo checkpoints")
    s = p.add_subparsers(dest="what", required=True)
    t = s.add_parser("tiny", help="write a tiny seeded Llama checkpoint")
    t.add_argument("out")
    t.add_argument("--num-kv-heads", type=int, default=2)
    t.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--overwrite", action="store_true")
    m = s.add_parser("demo-model", help="convert the SmolLM2-135M-Instruct GGUF to an HF folder (cached)")
    m.add_argument("--cache", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.what == "tiny":
        from kit.core.samples.models import tiny_llama

        print(
            tiny_llama(
                args.out,
                num_kv_heads=args.num_kv_heads,
                tie_word_embeddings=args.tie,
                seed=args.seed,
                overwrite=args.overwrite,
            )
        )
    else:
        from kit.core.samples.smollm2 import demo_model_dir

        print(demo_model_dir(args.cache))
    return 0
