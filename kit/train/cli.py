"""`python -m kit train ...`: run (this process / one rank), launch (torchrun job), megatron (AscendCloud scripts), log."""

from __future__ import annotations

import argparse
import json
import sys


def _add_config_args(p: argparse.ArgumentParser) -> None:
    from kit.core.configs import add_config_arguments
    from kit.train.config import TrainConfig

    p.add_argument(
        "--config",
        default=None,
        help="a config.json written by the kit (TrainConfig fields); options given here override it",
    )
    # one option per TrainConfig field, help from its field docstring; unset options are absent, so the environment
    # (MODEL_TYPE, TRAIN_ITERS, ... as the ModelArts manual's scripts read them) and the manifests fill them
    add_config_arguments(p, TrainConfig, skip=("sources",))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train with DeepSpeed (kit trainer) or build the Megatron/MindSpeed command"
    )
    s = p.add_subparsers(dest="what", required=True)
    r = s.add_parser("run", help="train in this process (also what each rank of a launched job runs)")
    _add_config_args(r)
    r.add_argument("--no-progress", action="store_true", help="no progress bar (launched jobs)")
    r.add_argument(
        "--plan", default=None, help="a plan.json written by `kit train launch`: trained as it is (its ranks)"
    )
    la = s.add_parser(
        "launch", help="validate, then run NPROC_PER_NODE ranks with torchrun / the DeepSpeed launcher"
    )
    _add_config_args(la)
    la.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun")
    la.add_argument("--visible-devices", default=None, help="cards for this node, e.g. 0,1,2,3")
    la.add_argument(
        "--force",
        action="store_true",
        help="launch even where the planner says the run does not fit the cards",
    )
    m = s.add_parser(
        "megatron", help="print (or run) the AscendCloud script / pretrain_gpt.py command for the config"
    )
    _add_config_args(m)
    m.add_argument(
        "--code-dir",
        default=None,
        help="llm_train/AscendSpeed of the AscendCloud package (default: <WORK_DIR>/llm_train/AscendSpeed)",
    )
    m.add_argument(
        "--script",
        default=None,
        help="scripts/<model>/<name>.sh to drive with the manual's variables (MODEL_TYPE, RUN_TYPE, ...)",
    )
    m.add_argument("--execute", action="store_true", help="run it (needs the code package and NPUs)")
    lg = s.add_parser("log", help="parse a kit or Megatron/MindSpeed training log and print its summary")
    lg.add_argument("logs", nargs="+")
    lg.add_argument(
        "--seq-len", type=int, default=None, help="SEQ_LEN, to compute tokens/s/p for Megatron logs"
    )
    lg.add_argument("--cards", type=int, default=None, help="cards of the run, to compute tokens/s/p")
    lg.add_argument("--csv", default=None, help="write the per-iteration table of the first log here")
    p.set_defaults(func=run)


def _config(args: argparse.Namespace):
    """The config file's values, then the options typed (both explicit); the rest is resolved later."""
    from kit.core.configs import explicit_values, to_jsonable
    from kit.train.config import TrainConfig, from_dict, load_config

    values = {}
    if args.config:  # the keys the file holds (a file with only some lets the environment fill the rest)
        saved = load_config(args.config)
        values = {n: v for n, v in to_jsonable(saved).items() if n in saved.given or n == "sources"}
    values.update(explicit_values(args, TrainConfig))
    return from_dict(values, args.config or "command line")


def run(args: argparse.Namespace) -> int:
    if args.what == "log":
        return _log(args)
    if args.what == "launch":
        import os

        from kit.train.jobenv import launching_card

        skip = launching_card(os.environ)  # Ascend preset images run the boot command once per card
        if skip:
            print(f"kit train launch: {skip}", file=sys.stderr, flush=True)
            return 0
    if args.what == "run":
        from kit.storage.partial import sigterm_as_interrupt
        from kit.train.resolve import TrainPlan
        from kit.train.trainer import train

        # a launched rank trains the plan its launcher resolved; a plain run resolves its config once
        run = TrainPlan.load(args.plan) if args.plan else _config(args)
        # SIGTERM before the first step (loading) ends like Ctrl-C; from then on the trainer checkpoints and stops
        with sigterm_as_interrupt():
            result = train(run, progress=not args.no_progress)
        # one write (text and newline together): the launcher sets PYTHONUNBUFFERED, and print's two writes let
        # another rank's line land between them, so the status line was not recognised as the same one
        sys.stdout.write(f"kit train: {result.status} at iteration {result.iteration}: {result.message}\n")
        sys.stdout.flush()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # torch's advice for a process that ends: not left to interpreter teardown; through DeepSpeed, which then
            # drops its cached groups (a later run in the same process would otherwise meet the destroyed one)
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()
        from kit.errors import EXIT_PREEMPTED, EXIT_USER_ERROR

        # preempted: a checkpoint was saved and the run can resume (docs/reliability.md#exit-codes)
        codes = {"completed": 0, "preempted": EXIT_PREEMPTED, "upload_failed": EXIT_USER_ERROR}
        return codes.get(result.status, 3)
    cfg = _config(args)
    if args.what == "launch":
        from kit.storage.partial import sigterm_as_interrupt
        from kit.train.launch import launch

        # SIGTERM to this launcher is passed on like Ctrl-C: the job (its own session) checkpoints and stops
        with sigterm_as_interrupt():
            res = launch(
                cfg,
                launcher=args.launcher,
                visible_devices=args.visible_devices,
                echo=True,
                progress=False,
                force=args.force,
            )
        if res.status == "preempted":  # torchrun turns the ranks' EXIT_PREEMPTED into 1
            from kit.errors import EXIT_PREEMPTED

            return EXIT_PREEMPTED
        code = (
            res.rank_exit if res.rank_exit else res.returncode
        )  # a failed rank's own code (torchrun says 1)
        return code if code >= 0 else 128 - code  # killed by a signal: 128+N
    from kit.train.config import replace
    from kit.train.megatron import build, execute
    from kit.train.resolve import resolve

    plan = build(resolve(replace(cfg, engine="megatron")), code_dir=args.code_dir, script=args.script)
    print(plan.describe())
    if plan.problems:
        return 2
    return execute(plan) if args.execute else 0


def _log(args: argparse.Namespace) -> int:
    from kit.train.logs import parse_log, summarize

    for i, path in enumerate(args.logs):
        df = parse_log(path, seq_len=args.seq_len, cards=args.cards)
        print(json.dumps({"log": path, **summarize(df)}, indent=2))
        if i == 0 and args.csv:
            df.to_csv(args.csv, index=False)
    return 0
