"""`python -m kit job`: the ModelArts training job for a training config (dry run; `--submit` sends it)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from kit.core.configs import add_config_arguments
    from kit.train.cli import _add_config_args
    from kit.train.job.config import JobConfig

    p = sub.add_parser(
        "job",
        help="build (and with --submit, send) the ModelArts training job that runs a training config on N nodes",
        description="The training settings are those of `python -m kit train`; the job settings say where on OBS, "
        "which image, flavor, pool and how many nodes. Credentials come from the environment only "
        "(HUAWEICLOUD_SDK_AK, HUAWEICLOUD_SDK_SK, HUAWEICLOUD_SDK_PROJECT_ID, HUAWEICLOUD_SDK_REGION).",
    )
    _add_config_args(p)
    # a job setting that TrainConfig also has (say a launcher field) is the run's: one option, TrainConfig's
    add_config_arguments(p, JobConfig, skip=_shared_fields())
    p.add_argument(
        "--submit", action="store_true", help="send the job (default: print the request, send nothing)"
    )
    p.set_defaults(func=run)


def _shared_fields() -> tuple:
    from dataclasses import fields

    from kit.train.config import TrainConfig
    from kit.train.job.config import JobConfig

    train = {f.name for f in fields(TrainConfig)}
    return tuple(f.name for f in fields(JobConfig) if f.name in train)


def run(args: argparse.Namespace) -> int:
    from kit.core.configs import explicit_values
    from kit.train.cli import _config
    from kit.train.job import JobConfig, build_job
    from kit.train.resolve import resolve

    cfg = _config(args)
    job_values = explicit_values(args, JobConfig)
    job = JobConfig(**{k: v for k, v in job_values.items() if k not in _shared_fields()})
    plan = build_job(resolve(cfg, cfg.workspace()), job)
    print(plan.describe())
    if plan.problems:  # like `kit train megatron`: the plan is printed, its problems make it fail
        import sys

        from kit.errors import error_line

        print(
            error_line(f"the job has {len(plan.problems)} problem(s), listed above; nothing was sent."),
            file=sys.stderr,
        )
        return 2
    if args.submit:
        from kit.train.job.submit import submit

        print(
            f"submitted: training job {submit(plan)} (ModelArts console, Training Management > Training Jobs)"
        )
    return 0
