"""`python -m kit profile ...`: analyze a capture, compare two, write the sample profile, profile a training run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kit.core.configs import add_config_arguments, check, explicit_values
from kit.profiling.config import ProfileConfig, Thresholds

_NOT_OPTIONS = ("block_dim_vs_cores", "free_share_pct", "top_n")  # Thresholds fields `analyze` does not offer


def _check_folder(path: str, option: str) -> None:
    """An output folder option must not name an existing file."""
    if Path(path).exists() and not Path(path).is_dir():
        from kit.profiling.profile_data import ProfileError

        raise ProfileError(
            f"{option} {path} is a file; pass a folder (new or existing) for the advice files."
        )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="analyze Ascend / torch.profiler captures, compare them, profile a training run"
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
    # the advisor's limits, one option per Thresholds field (help from its field docstring)
    add_config_arguments(a, Thresholds, skip=_NOT_OPTIONS)
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
    d = s.add_parser(
        "demo",
        aliases=["run"],
        help="profile a few steps of notebook 04's training run (default: the named run: notebook 04's, else the last one finished)",
    )
    # one option per ProfileConfig field (help from its field docstring); the rest say which run and where
    add_config_arguments(d, ProfileConfig)
    d.add_argument(
        "--workspace",
        default=None,
        help="workspace root (default: the project's, else the kit's default workspace)",
    )
    d.add_argument(
        "--model",
        default=None,
        help="the model's folder name in the workspace (default: the project's, else demo)",
    )
    d.add_argument(
        "--training-run",
        default=None,
        help="training-run folder to profile (default: the named run: notebook 04's, else the last one finished)",
    )
    d.add_argument(
        "--model-path",
        default=None,
        help="only when the workspace has no training run: HF folder to train and profile (default: demo model)",
    )
    d.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="only when the workspace has no training run: tokens per sample (default: the data's)",
    )
    d.add_argument("--top", type=int, default=10, help="operators in the table and the plot")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Expected failures raise ProfileError / ConfigError (KitError): `python -m kit` prints `error: ...`, exit 2."""
    import kit.profiling as kp

    if args.what == "analyze":
        th = check(
            Thresholds(**explicit_values(args, Thresholds)), "profile analyze options"
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
            from kit.storage.atomic import atomic_write_text

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
    from kit.core.workspace import get_workspace
    from kit.profiling.training_run import run as profile_run

    cfg = kp.ProfileConfig(**explicit_values(args, kp.ProfileConfig))
    ws = get_workspace(args.workspace, model=args.model)
    from kit.storage.partial import sigterm_as_interrupt

    with (
        sigterm_as_interrupt()
    ):  # outside the training steps (which checkpoint and stop on SIGTERM) like Ctrl-C
        result = profile_run(
            cfg,
            ws,
            training_run=args.training_run,
            model_path=args.model_path,
            seq_len=args.seq_len,
            top=args.top,
            progress=False,
        )
    print(result.folder)
    for n in result.notes:
        print(f"note: {n}", file=sys.stderr)
    return 0
