"""`python -m kit adapt ...`: fix remote-code model folders, check kit ops against float64."""

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
        from kit.storage.atomic import atomic_write_text

        atomic_write_text(args.json, json.dumps(rows, indent=2))
    return 0 if all(row["ok"] for row in rows) else 1
