"""`python -m kit plan MODEL --seq-len N ...`: will it fit on these cards, and how fast (kit.plan)."""

from __future__ import annotations

import argparse

from kit.plan.cards import CARDS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="will the training run fit on the cards, and how fast: every ZeRO / TP x PP x EP plan, ranked",
        description="Reads MODEL's config.json only (no weights) and traces one micro-batch at full size on fake "
        "tensors. Sequence length: --seq-len, else the prepared data's (--data).",
    )
    p.add_argument("model", help="model folder with config.json (HF or converted), or the config.json file")
    p.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default: --data's max_length)"
    )
    p.add_argument("--data", default=None, help="a prepared-data folder (notebook 02): its max_length")
    p.add_argument(
        "--mbs", type=int, default=1, help="micro-batch per card (smaller ones that keep GBS are tried)"
    )
    p.add_argument("--gbs", type=int, default=None, help="global batch in sequences (default MBS x cards)")
    p.add_argument("--cards", type=int, default=8, help="cards in all (nodes x cards per node)")
    p.add_argument(
        "--card", default="910B-64G", choices=[*CARDS, "here"], help="the card ('here': this device)"
    )
    p.add_argument("--card-memory-gib", type=float, default=None, help="override the card's memory")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the card's dense bf16 peak")
    p.add_argument("--lora-r", type=int, default=0, help="LoRA rank (0: full training)")
    p.add_argument(
        "--dpo",
        default="",
        choices=["", "adapters_off", "precompute", "copy"],
        help="plan a DPO run with this reference (2 sequences per pair; adapters_off needs --lora-r)",
    )
    p.add_argument(
        "--pairs", type=int, default=None, help="DPO: pairs in the data (default: --data's samples)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument(
        "--engine", nargs="+", default=["deepspeed", "megatron"], choices=["deepspeed", "megatron"]
    )
    p.add_argument(
        "--zero-stage", type=int, default=None, choices=[0, 1, 2, 3], help="mark the run's ZeRO stage"
    )
    p.add_argument(
        "--mfu", type=float, default=None, help="model FLOPs utilisation for the speeds (default 0.40)"
    )
    p.add_argument("--mfu-from", default=None, help="a finished run's folder: its own MFU for the speeds")
    p.add_argument("--all", action="store_true", help="list every plan, not the first ten")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import pandas as pd

    from kit.errors import InputError
    from kit.plan.planner import DEFAULT_MFU, PlanInputs, make_plan
    from kit.plan.report import memory_table, plans_table, run_mfu, verdict

    seq, pairs = args.seq_len, args.pairs
    if args.data and (seq is None or (args.dpo and pairs is None)):
        from kit.data.prepared import read_prepared

        fields = read_prepared(args.data).manifest.fields
        seq = seq or int(fields.get("max_length") or 0) or None
        pairs = pairs if pairs is not None else int(fields.get("num_samples") or 0)
    if not seq:
        raise InputError("give --seq-len, or --data with a prepared-data folder that records its max_length.")
    inputs = PlanInputs(
        model=args.model,
        seq_len=seq,
        mbs=args.mbs,
        gbs=args.gbs,
        cards=args.cards,
        card=args.card,
        card_memory_gib=args.card_memory_gib,
        peak_tflops=args.peak_tflops,
        lora_r=args.lora_r,
        dtype=args.dtype,
        engines=tuple(args.engine),
        mfu=args.mfu or DEFAULT_MFU,
        zero_stage=args.zero_stage,
        dpo_reference=args.dpo,
        pairs=pairs or 0,
    )
    report = make_plan(inputs)
    if args.mfu_from:
        report = make_plan(replace(inputs, mfu=run_mfu(args.mfu_from, report)))
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(verdict(report))
        print()
        print(memory_table(report).to_string())
        print()
        print(plans_table(report, len(report.rows) if args.all else 10).to_string())
    print(
        f"\nspeeds at MFU {report.inputs.mfu:.3g}; traced in {report.trace_seconds:.0f} s "
        "(what each term is and how it was checked: docs/planner.md)"
    )
    return 0
