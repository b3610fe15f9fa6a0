"""The few calls the kit makes to the conda command line, behind one adapter (conda is not on PyPI).

Parsers are tested against recorded real output (tests/fixtures/envs/); the commands themselves run only
where conda exists (ModelArts images: /home/ma-user/anaconda3 or /home/ma-user/miniconda3).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from kit.envs.prefix import EnvError

KNOWN_CONDAS = (
    "/home/ma-user/anaconda3/bin/conda",
    "/home/ma-user/miniconda3/bin/conda",
    "/home/work/anaconda/bin/conda",
    "/opt/conda/bin/conda",
)


def conda_executable() -> Optional[str]:
    """CONDA_EXE, else `conda` on PATH, else a ModelArts image location; None when there is no conda."""
    for candidate in (os.environ.get("CONDA_EXE"), shutil.which("conda"), *KNOWN_CONDAS):
        if candidate and os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


def _first_json(text: str) -> dict:
    """The JSON object in conda's stdout (older condas print notices around it)."""
    start = text.find("{")
    if start < 0:
        raise EnvError(f"conda printed no JSON: {text.strip()[:300]!r}")
    obj, _ = json.JSONDecoder().raw_decode(text, start)
    return obj


def parse_env_list_json(text: str) -> dict:
    """{name: prefix} from `conda env list --json` (names from envs_details when present, else folder names).

    Envs under an envs/ folder are named by their folder; a conda installation's root env is 'base'.
    """
    data = _first_json(text)
    details = data.get("envs_details") or {}
    out = {}
    for prefix in data.get("envs", []):
        name = (details.get(prefix) or {}).get("name")
        if not name:
            root = Path(prefix).parent.name != "envs" and (
                Path(prefix, "condabin").is_dir() or Path(prefix).name.endswith("conda3")
            )
            name = "base" if root else Path(prefix).name
        out.setdefault(name, prefix)
    return out


_TEXT_ROW = re.compile(r"^(\S+)?\s+(\*\s+)?(/\S.*)$")


def parse_env_list_text(text: str) -> dict:
    """{name: prefix} from plain `conda env list` output (rows 'name [*] prefix'; unnamed rows by folder)."""
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _TEXT_ROW.match(line.rstrip())
        if m:
            prefix = m.group(3).strip()
            out.setdefault(m.group(1) or Path(prefix).name, prefix)
    return out


def run_conda(args: list, conda: Optional[str] = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    """Run conda with `args`; EnvError naming the command and its error if it fails or is missing."""
    conda = conda or conda_executable()
    if conda is None:
        raise EnvError(
            "conda is not installed here (no CONDA_EXE, no `conda` on PATH, none under /home/ma-user); "
            "use a virtualenv (backend 'venv') or the conda-pack path, which needs no conda."
        )
    proc = subprocess.run([conda, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise EnvError(
            f"`conda {' '.join(args)}` failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-800:]}"
        )
    return proc


def conda_envs(conda: Optional[str] = None) -> dict:
    """{name: prefix} of the envs conda knows; {} when conda is absent."""
    if (conda or conda_executable()) is None:
        return {}
    return parse_env_list_json(run_conda(["env", "list", "--json"], conda).stdout)


def clone_command(source: str, target: str, offline: bool = True) -> list:
    """Arguments of `conda create --clone` into a prefix (what the ModelArts manual runs)."""
    args = ["create", "--prefix", str(target), "--clone", str(source), "--yes", "--quiet"]
    return args + (["--offline"] if offline else [])


def conda_clone(source: str, target: str, offline: bool = True, conda: Optional[str] = None) -> None:
    """`conda create --prefix target --clone source`: re-links packages from the cache (copies across disks)."""
    run_conda(clone_command(source, target, offline), conda)
