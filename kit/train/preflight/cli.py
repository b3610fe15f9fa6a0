"""`python -m kit megatron preflight ...`: megatron-core runs notebook 03's shards on notebook 02's data on CPU ranks."""

from __future__ import annotations

import argparse
import json
import sys

from kit.errors import error_line


def register(sub: argparse._SubParsersAction) -> None:
    from kit.core.configs import add_config_arguments
    from kit.train.preflight.run import PreflightConfig

    p = sub.add_parser(
        "megatron", help="Megatron path: megatron-core preflight of the converted shards on CPU"
    )
    s = p.add_subparsers(dest="what", required=True)
    pf = s.add_parser(
        "preflight",
        help="TP x PP (x DP) CPU ranks: strict load, loss / grad norm / steps vs HF, checkpoint back to HF",
        description="Inputs come from the workspace's manifests (notebook 03's newest converted checkpoint, "
        "notebook 02's newest data with Megatron files) unless given. Exit 0: every check passed; 2: a check "
        "failed (one line each) or the inputs do not fit.",
    )
    add_config_arguments(pf, PreflightConfig)
    pf.add_argument(
        "--engine",
        choices=("megatron-core", "mindspeed"),
        default="megatron-core",
        help="megatron-core: CPU ranks here; mindspeed: the plan's own MindSpeed-LLM command (needs NPUs)",
    )
    pf.add_argument("--json", action="store_true", help="print the whole result as JSON instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kit.core.configs import explicit_values
    from kit.train.preflight.run import PreflightConfig, mindspeed_refusal
    from kit.train.preflight.run import run as preflight

    if args.engine == "mindspeed":
        from kit.errors import InputError

        raise InputError(mindspeed_refusal())
    result = preflight(PreflightConfig(**explicit_values(args, PreflightConfig)))
    if args.json:
        print(json.dumps(result.summary(), indent=2, default=str))
    else:
        print(result.table().to_string(index=False))
        print(
            f"megatron preflight: {'passed' if result.passed else 'FAILED'} in {result.wall_s:.1f} s; {result.folder}"
        )
    for line in result.failures():
        print(error_line(line), file=sys.stderr)
    return 0 if result.passed else 2
