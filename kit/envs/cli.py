"""`python -m kit env ...`: list, create-venv, clone, pack, unpack, remove, kernel, check-kernel, restore, condarc."""

from __future__ import annotations

import argparse
import json


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--envs-root",
        default=None,
        help="persistent envs folder (default: /home/ma-user/work/envs "
        "on ModelArts, runs/envs here; env KIT_ENVS_ROOT)",
    )


def _clean(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--clean-partial",
        action="store_true",
        help="remove leftovers of interrupted runs (.NAME.partial-*) beside the output; they are always reported",
    )


def _imports(text: str) -> list:
    return [x for x in text.split(",") if x]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env", help="clone / pack / unpack envs on persistent storage, register Jupyter kernels"
    )
    s = p.add_subparsers(dest="action", required=True)
    _common(s.add_parser("list", help="envs under the envs root and those conda knows"))
    c = s.add_parser("create-venv", help="make a virtualenv (inheriting this python's packages)")
    c.add_argument("target")
    c.add_argument("--python", default=None)
    c.add_argument("--no-inherit", action="store_true", help="do not see the base interpreter's packages")
    c = s.add_parser("clone", help="clone an env to <envs-root>/{venvs,user_conda}/<name> or --target")
    c.add_argument("source", help="env folder or name")
    c.add_argument("--name", default=None)
    c.add_argument("--target", default=None)
    c.add_argument("--method", default="auto", help="auto, copy, conda-pack, conda-clone")
    c.add_argument("--ignore-editable-packages", action="store_true")
    c.add_argument("--verify", default="torch,torch_npu,deepspeed", help="comma-separated imports to check")
    c.add_argument("--overwrite", action="store_true")
    _clean(c)
    _common(c)
    c = s.add_parser("pack", help="pack an env to one archive (tar.zst multithreaded by default)")
    c.add_argument("source")
    c.add_argument("-o", "--output", default=None)
    c.add_argument(
        "--format", default=None, help="tar.zst, tar.gz, tar (default: from --output, else tar.zst)"
    )
    c.add_argument("--level", type=int, default=3)
    c.add_argument("-j", "--threads", type=int, default=0, help="0: every core; 1 with tar.gz: plain gzip")
    c.add_argument(
        "--ignore-editable-packages",
        action="store_true",
        help="pack although `pip install -e` packages are present (their sources are not shipped)",
    )
    c.add_argument("--overwrite", action="store_true")
    _clean(c)
    _common(c)
    c = s.add_parser("unpack", help="safely extract an archive into TARGET and fix its prefixes")
    c.add_argument("archive")
    c.add_argument("target")
    c.add_argument("--verify", default="torch,torch_npu,deepspeed")
    c.add_argument("--overwrite", action="store_true")
    _clean(c)
    c = s.add_parser("remove", help="delete an env folder and its kernels")
    c.add_argument("target")
    _common(c)
    c = s.add_parser("kernel", help="register an env as a Jupyter kernel with the CANN environment")
    c.add_argument("prefix")
    c.add_argument("--name", required=True)
    c.add_argument("--display-name", default=None)
    c.add_argument(
        "--set-env",
        action="append",
        default=None,
        help="a set_env.sh to capture (repeatable; default: detect; 'none' to skip)",
    )
    _common(c)
    c = s.add_parser(
        "check-kernel", help="start a kernel, run code in it, print its sys.prefix and variables"
    )
    c.add_argument("name")
    c.add_argument("--code", default="")
    c = s.add_parser("restore", help="after a restart: reinstall stored kernels, re-register envs_dirs")
    c.add_argument("--condarc", default=None)
    _common(c)
    c = s.add_parser("condarc", help="add <envs-root>/user_conda to envs_dirs in .condarc (idempotent)")
    c.add_argument("--condarc", default=None)
    _common(c)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kit.partial import sigterm_as_interrupt

    with sigterm_as_interrupt():  # a killed run removes its temporary output like Ctrl-C does
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import sys

    import kit.envs as envs
    from kit.partial import describe

    a = args.action
    if a == "list":
        out = [
            {"name": e.name, "kind": e.kind, "prefix": str(e.prefix)} for e in envs.list_envs(args.envs_root)
        ]
    elif a == "create-venv":
        out = {"created": str(envs.create_venv(args.target, args.python, inherit=not args.no_inherit))}
    elif a == "clone":
        out = envs.clone(
            args.source,
            args.name,
            args.target,
            args.envs_root,
            args.method,
            args.overwrite,
            args.ignore_editable_packages,
            _imports(args.verify),
            clean_partial=args.clean_partial,
        )
    elif a == "pack":
        out = envs.pack(
            args.source,
            args.output,
            args.format,
            args.level,
            args.threads,
            args.envs_root,
            args.ignore_editable_packages,
            args.overwrite,
            clean_partial=args.clean_partial,
        )
    elif a == "unpack":
        out = envs.unpack(
            args.archive, args.target, args.overwrite, _imports(args.verify), clean_partial=args.clean_partial
        )
    elif a == "remove":
        out = envs.remove(args.target, args.envs_root)
    elif a == "kernel":
        scripts = "auto" if args.set_env is None else [x for x in args.set_env if x != "none"]
        out = envs.register_kernel(args.prefix, args.name, args.display_name, scripts, args.envs_root)
    elif a == "check-kernel":
        out = envs.check_kernel(args.name, code=args.code)
    elif a == "restore":
        out = envs.restore(args.envs_root, args.condarc)
    else:
        out = envs.register_envs_root(args.envs_root, args.condarc)
    print(json.dumps(out, indent=1, default=str))
    if isinstance(out, dict) and "partial_leftovers" in out:
        note = describe({"found": out["partial_leftovers"], "removed": out["partial_removed"]})
        if note:
            print(f"note: {note}", file=sys.stderr)
    return 0
