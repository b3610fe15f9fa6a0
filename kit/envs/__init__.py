"""Environments on persistent storage (on ModelArts only /home/ma-user/work survives a restart): clone, pack and
unpack conda envs (through the conda-pack library) and virtualenvs, register them as Jupyter kernels that carry
CANN's set_env.sh variables, restore all of it after a restart."""

from kit.envs.conda import conda_executable, register_envs_dir, register_envs_root
from kit.envs.config import EnvsConfig, activation_commands, default_envs_root, get_layout
from kit.envs.extraction import extract, read_archive_manifest
from kit.envs.kernels import (
    capture_cann,
    check_kernel,
    find_set_env_scripts,
    register_kernel,
    restore,
    unregister_kernel,
)
from kit.envs.manage import clone, list_envs, pack, remove, resolve_env, unpack
from kit.envs.prefix import ArchiveDamagedError, EnvArchiveError, EnvError, verify
from kit.envs.result import EnvStageResult, plot_steps, steps_table
from kit.envs.venv import create_venv, demo_source

__all__ = [
    "EnvStageResult",
    "ArchiveDamagedError",
    "EnvArchiveError",
    "EnvError",
    "EnvsConfig",
    "activation_commands",
    "capture_cann",
    "check_kernel",
    "clone",
    "conda_executable",
    "create_venv",
    "default_envs_root",
    "demo_source",
    "extract",
    "find_set_env_scripts",
    "get_layout",
    "list_envs",
    "pack",
    "read_archive_manifest",
    "plot_steps",
    "register_envs_dir",
    "register_envs_root",
    "register_kernel",
    "remove",
    "resolve_env",
    "restore",
    "steps_table",
    "unpack",
    "unregister_kernel",
    "verify",
]
