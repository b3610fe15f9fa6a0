"""Bounded waits: how long a network call may wait, read once from its environment variable."""

from __future__ import annotations

from typing import Mapping

from kit.errors import InputError


def seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """The number of seconds `name` sets (> 0), else `default`; one line naming the variable when it is not one."""
    raw = environ.get(name)
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InputError(f"{name}={raw!r} is not a number of seconds > 0.")
    return value
