"""Where envs, archives and kernelspecs live on persistent storage (ModelArts: /home/ma-user/work/envs)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from kit.workspace import on_modelarts, repo_root

MODELARTS_ENVS = Path("/home/ma-user/work/envs")  # only /home/ma-user/work survives a restart


def default_envs_root(workspace_root: Optional[Union[str, Path]] = None) -> Path:
    """KIT_ENVS_ROOT if set, /home/ma-user/work/envs on ModelArts, else <workspace_root>/envs (or runs/envs)."""
    env = os.environ.get("KIT_ENVS_ROOT")
    if env:
        return Path(env).expanduser()
    if on_modelarts():
        return MODELARTS_ENVS
    return Path(workspace_root) / "envs" if workspace_root else repo_root() / "runs" / "envs"


@dataclass(frozen=True)
class EnvsLayout:
    """Folders under one persistent envs root (the manual's /home/ma-user/work/envs/user_conda/<name>)."""

    root: Path

    @property
    def conda(self) -> Path:
        return self.root / "user_conda"

    @property
    def venvs(self) -> Path:
        return self.root / "venvs"

    @property
    def packs(self) -> Path:
        return self.root / "packs"

    @property
    def kernels(self) -> Path:
        """Kernelspecs kept here survive restarts; restore() installs them where Jupyter looks."""
        return self.root / "kernels"

    @property
    def state(self) -> Path:
        """What restore() re-applies: envs_dirs registrations (JSON)."""
        return self.root / "kit-envs.json"

    def folder_for(self, kind: str) -> Path:
        return self.conda if kind == "conda" else self.venvs


def get_layout(root: Optional[Union[str, Path]] = None) -> EnvsLayout:
    """The layout under `root` (default: default_envs_root()), absolute."""
    return EnvsLayout(Path(root or default_envs_root()).expanduser().absolute())
