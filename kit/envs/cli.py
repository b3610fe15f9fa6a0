"""`python -m kit env ...`: list, create-venv, clone, pack, unpack, remove, kernel, check-kernel, restore, condarc."""

from __future__ import annotations

import argparse
import json

# Which EnvsConfig fields each sub-command takes; the options (`--name`, `--method`, `--level`, ...) and their help
# come from the dataclass (kit.core.configs.add_config_arguments), so defaults and docs are declared once, there.
_FIELDS = {
    "list": ("envs_root",),
    "clone": ("source", "name", "method", "verify_imports", "overwrite", "envs_root"),
    "pack": ("source", "pack_format", "level", "threads", "overwrite", "envs_root"),
    "unpack": ("verify_imports", "overwrite"),
    "remove": ("envs_root",),
    "kernel": ("kernel_name", "display_name", "set_env_scripts", "envs_root"),
    "restore": ("envs_root",),
    "condarc": ("envs_root",),
}


def _command(
    s: argparse._SubParsersAction, name: str, help: str, *positional: str
) -> argparse.ArgumentParser:
    """A sub-command with its positional arguments, its EnvsConfig options (_FIELDS) and the options some
    sub-commands share (--clean-partial where it writes an output, --ignore-editable-packages, --condarc)."""
    from kit.core.configs import add_config_arguments
    from kit.envs.config import EnvsConfig

    c = s.add_parser(name, help=help)
    for arg in positional:
        c.add_argument(arg)
    wanted = _FIELDS.get(name, ())
    skip = [f for f in EnvsConfig.__dataclass_fields__ if f not in wanted]
    add_config_arguments(c, EnvsConfig, skip=skip, positional=["source"] if "source" in wanted else [])
    if name in ("clone", "pack", "unpack"):
        c.add_argument(
            "--clean-partial",
            action="store_true",
            help="remove leftovers of interrupted runs (.NAME.partial-*) beside the output; they are always reported",
        )
    if name in ("clone", "pack"):
        editable = "go on although `pip install -e` packages are present (their sources are not shipped)"
        c.add_argument("--ignore-editable-packages", action="store_true", help=editable)
    if name in ("restore", "condarc"):
        c.add_argument(
            "--condarc", default=None, help="the .condarc to edit (default: $CONDARC, else ~/.condarc)"
        )
    return c


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "env", help="clone / pack / unpack envs on persistent storage, register Jupyter kernels"
    )
    s = p.add_subparsers(dest="action", required=True)
    _command(s, "list", "envs under the envs root and those conda knows")
    c = _command(s, "create-venv", "make a virtualenv (inheriting this python's packages)", "target")
    c.add_argument("--python", default=None)
    c.add_argument("--no-inherit", action="store_true", help="do not see the base interpreter's packages")
    c = _command(s, "clone", "clone an env to <envs-root>/{venvs,user_conda}/<name> or --target")
    c.add_argument("--target", default=None, help="clone to this folder instead of <envs-root>/.../<name>")
    c = _command(s, "pack", "pack an env to one archive (tar.zst multithreaded by default)")
    c.add_argument("-o", "--output", default=None, help="archive path (its suffix sets the format)")
    _command(s, "unpack", "safely extract an archive into TARGET and fix its prefixes", "archive", "target")
    _command(s, "remove", "delete an env folder and its kernels", "target")
    _command(s, "kernel", "register an env as a Jupyter kernel with the CANN environment", "prefix")
    c = _command(
        s, "check-kernel", "start a kernel, run code in it, print its sys.prefix and variables", "name"
    )
    c.add_argument("--code", default="")
    _command(s, "restore", "after a restart: reinstall stored kernels, re-register envs_dirs")
    _command(s, "condarc", "add <envs-root>/user_conda to envs_dirs in .condarc (idempotent)")
    p.set_defaults(func=run)


def _values(args: argparse.Namespace) -> dict:
    """The EnvsConfig fields of this sub-command: what the user typed, the dataclass default otherwise."""
    import dataclasses

    from kit.core.configs import explicit_values
    from kit.envs.config import EnvsConfig

    given = explicit_values(args, EnvsConfig)
    defaults = dataclasses.asdict(EnvsConfig())
    out = {k: given.get(k, defaults[k]) for k in _FIELDS.get(args.action, ())}
    if args.action == "clone":
        out["name"] = given.get("name")  # not given: the source's name
    if args.action == "pack":
        out["pack_format"] = given.get("pack_format")  # not given: from --output, else tar.zst
    if args.action == "kernel":
        if not given.get("kernel_name"):  # the field's documented default: the env's name
            from pathlib import Path

            out["kernel_name"] = Path(args.prefix).expanduser().absolute().name
        scripts = given.get("set_env_scripts", "auto")  # typed text: a JSON list, a comma list or 'auto'
        if scripts.strip().startswith("["):
            scripts = json.loads(scripts)
        elif scripts != "auto":
            scripts = [x for x in scripts.split(",") if x and x != "none"]
        out["set_env_scripts"] = scripts
    return out


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import sys

    import kit.envs as envs
    from kit.storage.partial import describe, sigterm_as_interrupt

    a, v = args.action, _values(args)
    with sigterm_as_interrupt():  # a killed run removes its temporary output like Ctrl-C does
        if a == "list":
            out = [dataclasses.asdict(e) for e in envs.list_envs(v["envs_root"])]
        elif a == "create-venv":
            out = {"created": str(envs.create_venv(args.target, args.python, inherit=not args.no_inherit))}
        elif a in ("clone", "pack"):
            kw = dict(ignore_editable=args.ignore_editable_packages, clean_partial=args.clean_partial)
            if a == "clone":
                out = envs.clone(target=args.target, **v, **kw)
            else:
                out = envs.pack(output=args.output, fmt=v.pop("pack_format"), **v, **kw)
        elif a == "unpack":
            out = envs.unpack(args.archive, args.target, **v, clean_partial=args.clean_partial)
        elif a == "remove":
            out = envs.remove(args.target, v["envs_root"])
        elif a == "kernel":
            out = envs.register_kernel(
                args.prefix, v["kernel_name"], v["display_name"], v["set_env_scripts"], v["envs_root"]
            )
        elif a == "check-kernel":
            out = envs.check_kernel(args.name, code=args.code)
        elif a == "restore":
            out = envs.restore(v["envs_root"], args.condarc)
        else:
            out = envs.register_envs_root(v["envs_root"], args.condarc)
    print(json.dumps(out, indent=1, default=str))
    if isinstance(out, dict) and "partial_leftovers" in out:
        note = describe({"found": out["partial_leftovers"], "removed": out["partial_removed"]})
        if note:
            print(f"note: {note}", file=sys.stderr)
    return 0
