"""Where CANN is installed: the one search for its set_env.sh scripts and its version on disk.

Used by the doctor (is CANN here, which scripts to source) and by kit.envs (which scripts a Jupyter kernel's
environment is captured from), so both name the same files. CANN installs in two layouts (see the CANN
installation guide, "Installing the CANN Software" / "Configuring Environment Variables"):
- classic: <root>/ascend-toolkit/set_env.sh, toolkit under ascend-toolkit/latest;
- newer (CANN 8.x community packages): <root>/cann/set_env.sh (or cann-X.Y.Z/set_env.sh), plus the
  NNAL/ATB library's own <root>/nnal/atb/set_env.sh, which must be sourced after the toolkit's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional, Union

# the root install prefix, a non-root install in $HOME, and the ModelArts image prefix
ASCEND_ROOTS = ("/usr/local/Ascend", "~/Ascend", "/home/ma-user/Ascend")


def _roots(roots: Optional[Iterable[Union[str, Path]]], env: Mapping[str, str]) -> list[Path]:
    out = []
    home = env.get("ASCEND_HOME_PATH")
    if home:  # .../ascend-toolkit/latest or .../cann-8.5.0: the install root is one of its parents
        out += list(Path(home).parents)[:3]
    out += [Path(r).expanduser() for r in (ASCEND_ROOTS if roots is None else roots)]
    return out


def _toolkit_scripts(root: Path) -> list[Path]:
    """The toolkit set_env.sh candidates under one install root, preferred first."""
    return [
        root / "cann" / "set_env.sh",
        root / "ascend-toolkit" / "set_env.sh",
        *sorted(root.glob("cann-*/set_env.sh"), reverse=True),
    ]


def find_set_env_scripts(
    roots: Optional[Iterable[Union[str, Path]]] = None, env: Optional[Mapping[str, str]] = None
) -> list[Path]:
    """The CANN set_env.sh scripts to source, in order: the toolkit's, then nnal/atb's if installed; [] if none.

    Looks under ASCEND_HOME_PATH's install root first (from `env`, default os.environ), then `roots`
    (default ASCEND_ROOTS: /usr/local/Ascend, ~/Ascend, /home/ma-user/Ascend); the first root with a toolkit wins.
    """
    env = os.environ if env is None else env
    for root in _roots(roots, env):
        found = next((p for p in _toolkit_scripts(root) if p.is_file()), None)
        if found:
            atb = root / "nnal" / "atb" / "set_env.sh"
            return [found] + ([atb] if atb.is_file() else [])
    return []


_VERSION = re.compile(r"^\s*(?:version|Version)\s*=\s*([\w.]+)", re.M)


def cann_version_from_disk(
    env: Mapping[str, str], roots: Optional[Iterable[Union[str, Path]]] = None
) -> Optional[str]:
    """CANN version from `*install.info` / `version.cfg` under ASCEND_HOME_PATH or the toolkit found on disk."""
    candidates = [Path(env["ASCEND_HOME_PATH"])] if env.get("ASCEND_HOME_PATH") else []
    for script in find_set_env_scripts(roots, env)[
        :1
    ]:  # the toolkit's folder: its latest/ holds the info files
        candidates += [script.parent / "latest", script.parent]
    for base in candidates:
        for pattern in ("*install.info", "*/*install.info", "version.cfg"):
            for f in sorted(base.glob(pattern)) if base.is_dir() else []:
                m = _VERSION.search(f.read_text(errors="replace"))
                if m:
                    return m.group(1)
    return None
