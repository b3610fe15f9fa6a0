"""Register a folder of envs in the user's .condarc (`envs_dirs`), idempotently, keeping every other line."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

from kit.atomic import atomic_write_text
from kit.envs.folders import get_layout
from kit.envs.prefix import EnvError


def condarc_path() -> Path:
    """$CONDARC if set, else ~/.condarc (the file `conda config` writes by default)."""
    return Path(os.environ.get("CONDARC") or Path.home() / ".condarc").expanduser()


def _load(text: str, path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise EnvError(f"{path} is not valid YAML ({exc}); fix or move it, then register again.") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EnvError(f"{path} does not hold a mapping of settings; fix or move it, then register again.")
    return data


def register_envs_dir(folder: os.PathLike | str, condarc: Optional[os.PathLike | str] = None) -> dict:
    """Append `folder` to envs_dirs in .condarc (like `conda config --append envs_dirs`); no-op if present.

    Comments and other settings are kept: the file is edited as text and checked by re-reading it.
    Returns {"condarc": path, "added": bool, "envs_dirs": [...]}.
    """
    path = Path(condarc) if condarc else condarc_path()
    folder = str(Path(folder).expanduser().absolute())
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    before = _load(text, path)
    current = before.get("envs_dirs") or []
    if isinstance(current, str):
        current = [current]
    if folder in [str(Path(p).expanduser()) for p in current]:
        return {"condarc": str(path), "added": False, "envs_dirs": list(current)}
    lines = text.splitlines()
    key = [i for i, line in enumerate(lines) if line.split(":", 1)[0] == "envs_dirs"]
    if key and lines[key[0]].split(":", 1)[1].strip() == "":
        i = key[0] + 1
        while i < len(lines) and (lines[i].startswith((" ", "\t", "- ")) or not lines[i].strip()):
            i += 1
        while i > key[0] + 1 and not lines[i - 1].strip():
            i -= 1
        item = lines[key[0] + 1] if key[0] + 1 < len(lines) else ""
        indent = item[: len(item) - len(item.lstrip())] if item.lstrip().startswith("-") else "  "
        lines.insert(i, f"{indent}- {folder}")
    elif key:  # flow style `envs_dirs: [a, b]` or a scalar: rewrite that one line in block style
        lines[key[0] : key[0] + 1] = ["envs_dirs:"] + [f"  - {p}" for p in [*current, folder]]
    else:
        lines += ["envs_dirs:", f"  - {folder}"]
    new_text = "\n".join(lines) + "\n"
    after = _load(new_text, path)
    expected = dict(before, envs_dirs=[*current, folder])
    if after != expected:
        raise EnvError(
            f"could not add {folder} to envs_dirs in {path} without changing other settings; "
            f"run `conda config --append envs_dirs {folder}` instead."
        )
    atomic_write_text(path, new_text)
    return {"condarc": str(path), "added": True, "envs_dirs": after["envs_dirs"]}


def remember_envs_dir(folder: Union[str, Path], envs_root: Optional[Union[str, Path]] = None) -> None:
    """Record an envs_dirs registration on persistent storage so that restore() re-applies it."""
    state_path = get_layout(envs_root).state
    state = json.loads(state_path.read_text(encoding="utf-8")) if state_path.exists() else {}
    dirs = state.setdefault("envs_dirs", [])
    if str(folder) not in dirs:
        dirs.append(str(folder))
        atomic_write_text(state_path, json.dumps(state, indent=1) + "\n")


def register_envs_root(
    envs_root: Optional[Union[str, Path]] = None, condarc: Optional[Union[str, Path]] = None
) -> dict:
    """Make conda envs under <envs_root>/user_conda usable by name (`conda activate <name>`), now and after
    every restore(): the registration is recorded on persistent storage and re-applied there."""
    folder = get_layout(envs_root).conda
    remember_envs_dir(folder, envs_root)
    return register_envs_dir(folder, condarc)
