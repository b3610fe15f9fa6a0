"""`python -m kit profile ...`: analyze a capture, compare two, write the sample profile, profile demo steps."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _check_folder(path: str, option: str) -> None:
    """An output folder option must not name an existing file."""
    if Path(path).exists() and not Path(path).is_dir():
        from kit.profiling.data import ProfileError

        raise ProfileError(
            f"{option} {path} is a file; pass a folder (new or existing) for the advice files."
        )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="analyze Ascend / torch.profiler captures, compare them, capture demo steps"
    )
    s = p.add_subparsers(dest="what", required=True)
    a = s.add_parser(
        "analyze", help="slow-operator advice for a capture folder, *_ascend_pt or *.pt.trace.json"
    )
    a.add_argument("path")
    a.add_argument(
        "--out", default=None, help="write advice.md/.html/.json and operators.csv into this folder"
    )
    a.add_argument("--overwrite", action="store_true", help="replace existing advice files in --out")
    a.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    a.add_argument(
        "--fail-on-problems", action="store_true", help="exit 1 when a rule finds a problem (for CI)"
    )
    a.add_argument(
        "--allow-unfinished", action="store_true", help="read an output folder without analyse.done"
    )
    a.add_argument("--cast-max-us", type=float, default=30.0)
    a.add_argument("--cast-share-pct", type=float, default=1.0)
    a.add_argument("--aicpu-max-us", type=float, default=1000.0)
    a.add_argument("--aicpu-share-pct", type=float, default=10.0)
    a.add_argument("--unit-ratio", type=float, default=0.8, help="in (0, 1]: every unit below it -> AOE")
    a.add_argument("--min-op-share-pct", type=float, default=1.0)
    a.add_argument("--ai-core-num", type=int, default=None, help="cube cores, when info.json is missing")
    a.add_argument("--aiv-num", type=int, default=None, help="vector cores, when info.json is missing")
    c = s.add_parser("compare", help="per-operator deltas and step time change between two captures")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--top", type=int, default=10)
    c.add_argument("--csv", default=None, help="also write the full comparison table here")
    m = s.add_parser("sample", help="write the sample Ascend profile (planted problems unless --clean)")
    m.add_argument("out")
    m.add_argument("--clean", action="store_true")
    m.add_argument("--level", default="Level1", choices=["Level0", "Level1", "Level2"])
    m.add_argument("--legacy-headers", action="store_true", help="Block Dim, no Device_id / Step Id")
    m.add_argument("--steps", type=int, default=5)
    m.add_argument("--overwrite", action="store_true")
    d = s.add_parser("demo", help="profile a few training steps of an HF model (default: the demo model)")
    d.add_argument("--model", default=None, help="HF folder (default: the demo model)")
    d.add_argument("--out", default=None, help="captures folder (default: the workspace's profiles/)")
    d.add_argument("--device", default="auto", choices=["auto", "npu", "cuda", "cpu"])
    d.add_argument("--wait", type=int, default=1)
    d.add_argument("--warmup", type=int, default=1)
    d.add_argument("--active", type=int, default=3)
    d.add_argument("--level", default="Level1")
    d.add_argument("--aic-metrics", default="PipeUtilization")
    d.add_argument("--batch-size", type=int, default=2)
    d.add_argument("--seq-len", type=int, default=64)
    d.add_argument("--tag", default="")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Expected failures raise ProfileError / ConfigError (KitError): `python -m kit` prints `error: ...`, exit 2."""
    import kit.profiling as kp

    if args.what == "analyze":
        from kit.configs import check

        th = check(
            kp.Thresholds(
                cast_max_us=args.cast_max_us,
                cast_share_pct=args.cast_share_pct,
                aicpu_max_us=args.aicpu_max_us,
                aicpu_share_pct=args.aicpu_share_pct,
                unit_ratio=args.unit_ratio,
                min_op_share_pct=args.min_op_share_pct,
                ai_core_num=args.ai_core_num,
                aiv_num=args.aiv_num,
            ),
            "profile analyze options",
        )  # before reading: a bad option must not wait for a million-row profile
        if args.out:
            _check_folder(args.out, "--out")
        advice = kp.advise(kp.load(args.path, allow_unfinished=args.allow_unfinished), th)
        print(
            json.dumps(advice.to_json(), indent=2, ensure_ascii=False) if args.json else advice.to_markdown()
        )
        for w in advice.data.warnings:
            print(f"warning: {w}", file=sys.stderr)
        if args.out:
            for role, path in advice.save(args.out, overwrite=args.overwrite).items():
                print(f"{role}: {path}", file=sys.stderr)
        return 1 if advice.problems and args.fail_on_problems else 0
    if args.what == "compare":
        if args.csv and Path(args.csv).is_dir():
            raise kp.ProfileError(
                f"--csv {args.csv} is a folder; give a file name, e.g. {Path(args.csv) / 'compare.csv'}"
            )
        cmp = kp.compare(args.before, args.after)
        print(cmp.summary(top=args.top))
        if args.csv:
            from kit.atomic import atomic_write_text

            atomic_write_text(args.csv, cmp.operators.to_csv(index=False))
        return 0
    if args.what == "sample":
        print(
            kp.write_sample_ascend_profile(
                args.out,
                clean=args.clean,
                steps=args.steps,
                level=args.level,
                legacy_headers=args.legacy_headers,
                overwrite=args.overwrite,
            )
        )
        return 0
    from kit.profiling.demo import profile_training

    cap = profile_training(
        args.model,
        out_dir=args.out,
        device=args.device,
        wait=args.wait,
        warmup=args.warmup,
        active=args.active,
        level=args.level,
        aic_metrics=args.aic_metrics,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        tag=args.tag,
    )
    print(cap.folder)
    for n in cap.notes:
        print(f"note: {n}", file=sys.stderr)
    return 0
