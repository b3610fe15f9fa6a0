"""The env stage's config (notebook 01 and `python -m kit env`), its folders on persistent storage (ModelArts:
/home/ma-user/work/envs), and the ways to activate an env."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from kit.core.workspace import on_modelarts, repo_root
from kit.envs.archive import FORMATS, check_level
from kit.envs.prefix import DEFAULT_IMPORTS, check_choice, check_name, env_info, kind_of

MODELARTS_ENVS = Path("/home/ma-user/work/envs")  # only /home/ma-user/work survives a restart


def default_envs_root(workspace_root: Optional[Union[str, Path]] = None) -> Path:
    """KIT_ENVS_ROOT if set, /home/ma-user/work/envs on ModelArts, else <workspace_root>/envs (or runs/envs)."""
    env = os.environ.get("KIT_ENVS_ROOT")
    if env:
        return Path(env).expanduser()
    if on_modelarts():
        return MODELARTS_ENVS
    return Path(workspace_root) / "envs" if workspace_root else repo_root() / "runs" / "envs"


class EnvsLayout:
    """Folders under one persistent envs root (the manual's /home/ma-user/work/envs/user_conda/<name>): conda envs,
    virtualenvs, archives, kernelspecs and the state (envs_dirs registrations) that restore() re-applies."""

    def __init__(self, root: Path):
        self.root, self.conda, self.venvs = root, root / "user_conda", root / "venvs"
        self.packs, self.kernels, self.state = root / "packs", root / "kernels", root / "kit-envs.json"

    def folder_for(self, kind: str) -> Path:
        return self.conda if kind == "conda" else self.venvs


def get_layout(root: Optional[Union[str, Path]] = None) -> EnvsLayout:
    """The layout under `root` (default: default_envs_root()), absolute."""
    return EnvsLayout(Path(root or default_envs_root()).expanduser().absolute())


@dataclass
class EnvsConfig:
    """What notebook 01 does: clone SOURCE to NAME under ENVS_ROOT, pack/unpack it, register a kernel."""

    envs_root: Optional[str] = None
    """Persistent folder for envs, archives, kernelspecs (None: /home/ma-user/work/envs on ModelArts)."""
    source: Optional[str] = None
    """Env to clone: folder or name (None: a small demo virtualenv on top of this kernel's packages)."""
    name: str = "demo-env"
    """Name of the clone (a folder name under envs_root/venvs or envs_root/user_conda)."""
    method: str = "auto"
    """Clone method: auto, copy, conda-pack, conda-clone."""
    pack_format: str = "tar.zst"
    """Archive format: tar.zst, tar.gz or tar."""
    level: int = 3
    """Compression level (zstd 1-19, gzip 1-9)."""
    threads: int = 0
    """Compression threads (0: every core)."""
    verify_imports: list = field(default_factory=lambda: list(DEFAULT_IMPORTS))
    """Packages the clone's python must import when present (absent ones are reported, not errors)."""
    set_env_scripts: Union[str, list] = "auto"
    """CANN set_env.sh files for the kernel's env: 'auto' (detect), a list of paths, or [] for none."""
    kernel_name: Optional[str] = None
    """Jupyter kernel name (None: the env name)."""
    display_name: Optional[str] = None
    """Name shown in the Jupyter launcher (None: 'Python (<name>)')."""
    register_condarc: bool = True
    """Add envs_root/user_conda to envs_dirs in .condarc so conda envs activate by name."""
    overwrite: bool = False
    """Replace an existing clone / archive / unpacked env of the same name."""

    def problems(self) -> list:
        """Every problem at once, from the checks clone / pack / register_kernel run themselves."""
        from kit.envs.kernels import check_scripts
        from kit.envs.manage import CLONE_METHODS

        source = Path(self.source).expanduser() if self.source and os.sep in self.source else None
        checks = {
            "NAME": lambda: check_name(self.name, "NAME"),
            "KERNEL_NAME": lambda: check_name(self.kernel_name or self.name, "KERNEL_NAME"),
            "METHOD": lambda: check_choice(self.method, CLONE_METHODS, "clone method"),
            "PACK_FORMAT": lambda: check_choice(self.pack_format, FORMATS, "archive format"),
            "LEVEL": lambda: self.pack_format in FORMATS and check_level(self.pack_format, self.level),
            "SOURCE_ENV": lambda: source is not None and env_info(source),
            "SET_ENV_SCRIPTS": lambda: self.set_env_scripts == "auto" or check_scripts(self.set_env_scripts),
        }
        out = []
        for label, check in checks.items():
            try:
                check()
            except ValueError as exc:
                out.append(str(exc) if str(exc).startswith(label) else f"{label}: {exc}")
        if int(self.threads) < -1:
            out.append(f"THREADS {self.threads} must be 0 (every core), -1 (same) or a positive count.")
        if not isinstance(self.verify_imports, (list, tuple)):
            out.append("VERIFY_IMPORTS must be a list of module names (e.g. ['torch', 'torch_npu']).")
        return out


def activation_commands(prefix: Union[str, Path], conda_envs_dir: Optional[Union[str, Path]] = None) -> dict:
    """The ways to use an env after a restart (the manual's three, for conda; two for a venv)."""
    prefix = Path(prefix).absolute()
    py = prefix / "bin" / "python"
    if kind_of(prefix) == "conda":
        folder = conda_envs_dir or prefix.parent
        return {
            "full path": f"conda activate {prefix}",
            "by name": f"conda config --append envs_dirs {folder} && conda activate {prefix.name}",
            "own python": f"{py} -V && {prefix / 'bin' / 'pip'} list",
        }
    return {
        "activate script": f"source {prefix / 'bin' / 'activate'}",
        "own python": f"{py} -V && {py} -m pip list",
    }
