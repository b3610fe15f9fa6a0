"""`python -m kit serve [start|bench|package|check]`: serve notebook 04's model, load-test it, package it for ModelArts."""

from __future__ import annotations

import argparse
import json
import sys

from kit.core.configs import add_config_arguments, explicit_values
from kit.errors import error_line
from kit.serve.config import BenchConfig, PackageConfig, ServeConfig


def _workspace_args(p) -> None:
    from kit.core.project import add_workspace_arguments

    add_workspace_arguments(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the trained model (OpenAI API: transformers serve / vLLM / vllm-ascend), load-test, package",
        description="Without a sub-command: `start`. The model comes from notebook 04's training-run manifest "
        "(default: the named run: notebook 04's, else the last one finished) or --model-path.",
    )
    add_config_arguments(p, ServeConfig)
    _workspace_args(p)
    p.set_defaults(func=run_start)
    s = p.add_subparsers(dest="what")
    st = s.add_parser("start", help="start the engine, print its URL, serve until Ctrl-C / SIGTERM")
    add_config_arguments(st, ServeConfig)
    _workspace_args(st)
    st.set_defaults(func=run_start)
    b = s.add_parser(
        "bench", help="load test: concurrency sweep + Poisson rate sweep, vLLM result JSON, CSV, plot"
    )
    add_config_arguments(b, BenchConfig)
    add_config_arguments(b, ServeConfig)
    _workspace_args(b)
    b.set_defaults(func=run_bench)
    k = s.add_parser("package", help="ModelArts custom-engine folder: model/, run.sh, Dockerfile")
    add_config_arguments(k, PackageConfig)
    k.add_argument(
        "--run",
        default=None,
        help="training-run folder (default: the named run: notebook 04's, else the last one finished)",
    )
    k.add_argument("--model-path", default=None, help="HF folder to package instead of the run's model")
    k.add_argument("--check", action="store_true", help="then run its run.sh here (CPU engine) and probe it")
    _workspace_args(k)
    k.set_defaults(func=run_package)
    c = s.add_parser(
        "check", help="run a package's run.sh here with the CPU engine; probe /health and a completion"
    )
    c.add_argument("folder", help="the package folder")
    c.add_argument("--port", type=int, default=0, help="loopback port (default: a free one)")
    c.add_argument(
        "--engine", default="transformers", choices=("transformers", "vllm"), help="CPU engine run.sh starts"
    )
    c.add_argument(
        "--engine-python", default=None, help="python of the engine's env (vllm: default the built CPU env)"
    )
    c.set_defaults(func=run_check)


def _ws(args):
    from kit.core.workspace import get_workspace

    return get_workspace(args.workspace, model=args.workspace_model)


def run_start(args: argparse.Namespace) -> int:
    from kit.serve.start import serve
    from kit.storage.partial import sigterm_as_interrupt

    # Ctrl-C or SIGTERM, while the engine starts or serves, stops it and ends like every stage: `error: interrupted`,
    # exit 130 (docs/reliability.md#exit-codes)
    with sigterm_as_interrupt():
        server = serve(ServeConfig(**explicit_values(args, ServeConfig)), _ws(args))
        try:
            print(json.dumps(server.summary(), indent=2))
            print("serving; Ctrl-C stops it", flush=True)
            code = server.proc.wait()
            print(error_line(f"the engine exited with code {code}; log: {server.log_path}"), file=sys.stderr)
            return 1
        finally:
            server.stop()


def run_bench(args: argparse.Namespace) -> int:
    from kit.serve.loadtest import bench

    result = bench(
        BenchConfig(**explicit_values(args, BenchConfig)),
        _ws(args),
        ServeConfig(**explicit_values(args, ServeConfig)),
    )
    print(result.table.to_string())
    print(f"results: {result.folder}")
    return 0


def run_package(args: argparse.Namespace) -> int:
    from kit.serve.modelarts import check_package, package

    serve_cfg = ServeConfig(run=args.run, model_path=args.model_path)
    result = package(PackageConfig(**explicit_values(args, PackageConfig)), _ws(args), serve_cfg)
    print(json.dumps(result.summary(), indent=2))
    if args.check:
        print(json.dumps(check_package(result.folder), indent=2, ensure_ascii=False))
    return 0


def run_check(args: argparse.Namespace) -> int:
    from kit.serve.modelarts import check_package

    out = check_package(args.folder, port=args.port, python=args.engine_python, engine=args.engine)
    print(json.dumps(out, indent=2, ensure_ascii=False))
    return 0
