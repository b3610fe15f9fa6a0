"""`python -m kit adapt ...`: fix remote-code model folders, check kit ops against float64, the device check."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("adapt", help="NPU adaptation: remote-code fixes, kit-op parity check")
    s = p.add_subparsers(dest="what", required=True)
    f = s.add_parser(
        "fix-remote-code",
        help="apply known fixes (Baichuan tokenizer, torch.jit.script) to a model folder's .py files",
    )
    f.add_argument("model_dir")
    f.add_argument("--dry-run", action="store_true", help="only say what would change")
    c = s.add_parser(
        "parity", help="run every kit op on this device and compare with float64 (do this on NPU)"
    )
    c.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    c.add_argument("--json", default=None, help="also write the rows to this JSON file")
    d = s.add_parser(
        "device-check",
        help="a few minutes on the device: every op vs float64, model parity, 2-card step, adapted training, profile",
    )
    d.add_argument("--json", default=None, help="write the full report to this JSON file")
    d.add_argument(
        "--work-dir", default=None, help="folder for the model, data, run and profile (default: temp)"
    )
    d.add_argument("--model", default=None, help="HF model folder (default: a tiny seeded Llama)")
    d.add_argument("--steps", type=int, default=4, help="training steps (at least 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.what == "fix-remote-code":
        from kit.adapt.remote_code import fix_remote_code

        results = fix_remote_code(args.model_dir, dry_run=args.dry_run)
        for r in results:
            print(
                f"{r.status:<16} {r.fix}  {r.file}  ({r.detail})"
                + (f"  backup: {r.backup}" if r.backup else "")
            )
        if not results:
            print(f"no known fix applies to the Python files in {args.model_dir}")
        return 0
    if args.what == "device-check":
        from kit.adapt.device_check import run_device_check

        report = run_device_check(args.json, args.work_dir, args.model, args.steps)
        return 0 if report["ok"] else 1
    import torch

    from kit.ops.parity import parity_report

    rows = parity_report(dtype=getattr(torch, args.dtype) if args.dtype else None)
    for row in rows:
        flag = "ok  " if row["ok"] else "FAIL"
        print(
            f"{flag} {row['op']:<32} {row['backend']:<5} {row['dtype']:<8} max rel err {row['max_rel_err']:.2e}"
            f" (tolerance {row['tolerance']:.0e})"
        )
    if args.json:
        from kit.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=2))
    return 0 if all(row["ok"] for row in rows) else 1
