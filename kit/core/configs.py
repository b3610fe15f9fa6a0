"""Stage configs: dataclasses validated in one place, every problem listed in one error, saved as JSON."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Iterable

from kit.core.i18n import t
from kit.errors import InputError


class ConfigError(InputError):
    """Raised with every problem found in a config, one per line, each saying what to change."""

    def __init__(self, problems: Iterable[str], where: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{t('config.problems', count=len(self.problems), where=where)}\n{lines}")


def check(config: Any, where: str | None = None) -> Any:
    """Call `config.problems()` (a list of strings) and raise ConfigError listing them all; return config."""
    problems = list(config.problems())
    if problems:
        raise ConfigError(problems, where or type(config).__name__)
    return config


def to_jsonable(value: Any) -> Any:
    """Dataclasses, paths and containers as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def save_config(config: Any, folder: str | Path, name: str = "config.json") -> Path:
    """Write the config that produced an output folder beside it (atomically)."""
    from kit.storage.atomic import atomic_write_text

    path = Path(folder) / name
    atomic_write_text(path, json.dumps(to_jsonable(config), indent=2, ensure_ascii=False) + "\n")
    return path


# ---- one declaration per setting: help texts, command-line options and notebook parameters from the dataclass --


def field_docs(cls: type) -> dict:
    """Each field's documentation: the string literal right under it (an attribute docstring)."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls: type) -> dict:
    import ast
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        value = getattr(nxt, "value", None) if isinstance(nxt, ast.Expr) else None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs[node.target.id] = " ".join(value.value.split())
    return docs


def _field_kind(tp: Any) -> tuple:
    """(base type, is_list, element type) of a config field's annotation."""
    import typing

    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _field_kind(args[0]) if len(args) == 1 else (str, False, None)
    if origin in (list, tuple) or tp in (list, tuple):
        args = typing.get_args(tp)
        return (list, True, args[0] if args else str)
    if origin is dict or tp is dict:
        return (dict, False, None)
    return (tp if tp in (int, float, bool, str) else str, False, None)


def _parse_value(text: str, kind: tuple) -> Any:
    base, is_list, elem = kind
    if base is dict:
        return json.loads(text)
    if is_list:
        text = text.strip()
        if text.startswith("["):
            return json.loads(text)
        return [elem(x) if elem in (int, float) else x for x in text.split(",") if x != ""]
    return base(text)


def add_config_arguments(
    parser: Any, cls: type, skip: Iterable[str] = (), positional: Iterable[str] = ()
) -> None:
    """Add one option per field of `cls` (`--max-length`), help from its docs; unset options stay absent.

    Options that are not given do not appear in the parsed namespace, so `config_from_args` can tell a value the
    user typed from the dataclass default (and a stage can inherit the rest from the previous stage's manifest).
    """
    import argparse
    import typing

    hints = typing.get_type_hints(cls)
    skip, positional = set(skip), list(positional)
    # The docs are read from the source (inspect + ast, a few ms) only when help is printed, not on every run.
    parser.formatter_class = _with_field_docs(parser.formatter_class)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = _field_kind(hints.get(f.name, str))
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        if f.name in positional:
            nargs = "*" if kind[1] else None
            action = parser.add_argument(f.name, nargs=nargs, default=argparse.SUPPRESS, help=f.name)
            action.field_doc = (cls, f.name, "{doc}")
            continue
        flag = "--" + f.name.replace("_", "-")
        if kind[0] is bool:
            action = parser.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=f"default: {default!r}",
            )
        else:
            action = parser.add_argument(
                flag,
                type=lambda s, k=kind, n=flag: _typed(s, k, n),
                default=argparse.SUPPRESS,
                metavar=f.name.upper(),
                help=f"default: {default!r}",
            )
        action.field_doc = (
            cls,
            f.name,
            "{doc} (default: " + repr(default).replace("{", "{{").replace("}", "}}") + ")",
        )


def _with_field_docs(base: type) -> type:
    """`base` (an argparse formatter class) that shows each config option's field docs as its help."""
    if getattr(base, "shows_field_docs", False):
        return base

    class FieldDocs(base):
        shows_field_docs = True

        def _get_help_string(self, action) -> str:
            ref = getattr(action, "field_doc", None)
            doc = _field_docs(ref[0]).get(ref[1], "") if ref else ""
            # argparse %-formats help strings: a "%" in a field's documentation is text
            return ref[2].format(doc=doc.replace("%", "%%")) if doc else super()._get_help_string(action)

    return FieldDocs


def _typed(text: str, kind: tuple, flag: str) -> Any:
    import argparse

    try:
        return _parse_value(text, kind)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: {exc}") from None


def explicit_values(args: Any, cls: type) -> dict:
    """The fields of `cls` that were given on the command line (absent ones are not in the namespace)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def bind(cls: type, namespace: dict, **overrides: Any) -> Any:
    """Build `cls` from a notebook's parameters: every UPPER_SNAKE name in `namespace` that is a field of it.

    `cfg = bind(DataConfig, globals())` replaces a hand-written `DataConfig(kind=KIND, name=NAME, ...)`; values
    set to None stay None (the stage then inherits or defaults them). Keyword arguments win over the namespace.
    """
    values = {}
    for f in dataclasses.fields(cls):
        key = f.name.upper()
        if key in namespace:
            values[f.name] = namespace[key]
    values.update(overrides)
    return cls(**values)
