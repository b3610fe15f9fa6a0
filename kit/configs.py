"""Stage configs: dataclasses validated in one place, every problem listed in one error, saved as JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable

from kit.errors import KitError


class ConfigError(KitError, ValueError):
    """Raised with every problem found in a config, one per line, each saying what to change."""

    def __init__(self, problems: Iterable[str], where: str = "config"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in {where}:\n{lines}")


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
    from kit.atomic import atomic_write_text

    path = Path(folder) / name
    atomic_write_text(path, json.dumps(to_jsonable(config), indent=2, ensure_ascii=False) + "\n")
    return path
