"""Conda envs: the conda-pack library (clone with prefixes relocated offline, pack, finish an unpacked env), the few
conda commands the kit runs, and `envs_dirs` in the user's .condarc. conda is not on PyPI: its output parser is tested
on recorded real output (tests/fixtures/envs/); the commands run only where conda exists."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Union

from kit.envs.archive import ArchiveWriter
from kit.envs.config import get_layout
from kit.envs.prefix import EDITABLE_HINT, EnvError
from kit.storage.atomic import atomic_write_text


def _run_packer(prefix: str, archive, ignore_editable: bool, bar, dest_prefix: Optional[str] = None):
    """(files, packer): conda-pack's Packer (internal in conda-pack 0.8-0.9) over the env's files into `archive`
    (add(source, target), add_bytes(source, data, target)); the bar counts conda-pack's records."""
    import conda_pack
    from conda_pack.core import Packer

    try:
        env = conda_pack.CondaEnv.from_prefix(prefix, ignore_editable_packages=ignore_editable)
    except conda_pack.CondaPackException as exc:
        hint = f"; {EDITABLE_HINT}" if "editable" in str(exc) else ""
        raise EnvError(f"conda-pack cannot read the env {prefix!r}: {exc}{hint}") from exc
    bar.total = len(env.files)
    bar.refresh()
    packer = Packer(prefix, archive, dest_prefix=dest_prefix)
    for f in env.files:
        try:
            packer.add(f)
        except ValueError as exc:
            if "padding" not in str(exc):
                raise
            raise EnvError(
                f"{f.target} is a binary file whose build-time prefix ({len(f.prefix_placeholder or '')} "
                f"characters) is shorter than the target path {dest_prefix} ({len(str(dest_prefix))}); "
                f"binary prefixes can only shrink. Choose a shorter target folder, or method='conda-clone'."
            ) from exc
        bar.update(1)
    packer.finish()
    return len(env.files), packer


def pack_conda(prefix: str, writer: ArchiveWriter, ignore_editable: bool, bar) -> dict:
    """What `conda pack` writes for the env at the absolute `prefix` (conda-pack's files and bin/conda-unpack) into
    the kit archive `writer`, whose compressor gives tar.zst the level and threads conda-pack's own ignores."""
    files, packer = _run_packer(prefix, writer, ignore_editable, bar)
    writer.finish({})
    return {"files": files, "prefix_records": len(packer.prefixes)}


class _CopyArchive:
    """conda-pack archive target that copies into a folder (its no-archive mode hard-links on one disk,
    which would make a clone share inodes with its source)."""

    def __init__(self, output: str):
        self.output = output

    def _dest(self, target: str) -> str:
        dest = os.path.normpath(os.path.join(self.output, target))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        return dest

    def add(self, source: str, target: str) -> None:
        dest = self._dest(target)
        if os.path.islink(source) or os.path.isfile(source):
            shutil.copy2(source, dest, follow_symlinks=False)
        else:
            os.makedirs(dest, exist_ok=True)

    def add_bytes(self, source: str, data: bytes, target: str) -> None:
        dest = self._dest(target)
        with open(dest, "wb") as fh:
            fh.write(data)
        shutil.copymode(source, dest)


def clone_conda(source: Path, tmp_dir: Path, final_prefix: Path, ignore_editable: bool, bar) -> dict:
    """Copy a conda env into `tmp_dir` with every prefix already rewritten to `final_prefix` (no conda-unpack)."""
    archive = _CopyArchive(str(tmp_dir))
    return {
        "files": _run_packer(os.path.abspath(source), archive, ignore_editable, bar, str(final_prefix))[0]
    }


def finish_unpack(target: os.PathLike | str) -> dict:
    """Run the archive's own bin/conda-unpack (by absolute path, with this python) to fix the prefixes."""
    script = Path(target).absolute() / "bin" / "conda-unpack"
    if not script.exists():
        return {"conda_unpack": False}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvError(f"{script} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return {"conda_unpack": True}


# ---- the conda command line

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


def parse_env_list_json(text: str) -> dict:
    """{name: prefix} from `conda env list --json`: names from envs_details, else the folder's ('base' for a
    conda installation's root)."""
    start = text.find("{")  # older condas print notices around the JSON
    if start < 0:
        raise EnvError(f"conda printed no JSON: {text.strip()[:300]!r}")
    data = json.JSONDecoder().raw_decode(text, start)[0]
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


def run_conda(args: list, timeout: float = 3600) -> subprocess.CompletedProcess:
    """Run conda with `args`; EnvError naming the command and its error if it fails or is missing."""
    conda = conda_executable()
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


def conda_envs() -> dict:
    """{name: prefix} of the envs conda knows; {} when conda is absent."""
    if conda_executable() is None:
        return {}
    return parse_env_list_json(run_conda(["env", "list", "--json"]).stdout)


def clone_command(source: str, target: str) -> list:
    """Arguments of `conda create --clone` into a prefix (what the ModelArts manual runs): re-links packages from
    the cache (copies across disks), offline."""
    return ["create", "--prefix", str(target), "--clone", str(source), "--yes", "--quiet", "--offline"]


# ---- .condarc


def _load_condarc(text: str, path: Path) -> dict:
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
    """Append `folder` to envs_dirs in .condarc (default $CONDARC, else ~/.condarc, as `conda config --append
    envs_dirs` does) unless present. Edited as text, so other lines and comments stay: the envs_dirs entry is
    written again at the end, and the file re-read to check that nothing else changed."""
    path = Path(condarc or os.environ.get("CONDARC") or Path.home() / ".condarc").expanduser()
    folder = str(Path(folder).expanduser().absolute())
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    before = _load_condarc(text, path)
    current = before.get("envs_dirs") or []
    current = [current] if isinstance(current, str) else list(current)
    if folder in [str(Path(p).expanduser()) for p in current]:
        return {"condarc": str(path), "added": False, "envs_dirs": current}
    kept, in_entry = [], False
    for line in text.splitlines():  # the entry: its key line and the indented or `- ` lines after it
        in_entry = line.split(":", 1)[0] == "envs_dirs" or (in_entry and line[:1] in ("", " ", "\t", "-"))
        if not in_entry:
            kept.append(line)
    new_text = "\n".join([*kept, "envs_dirs:", *(f"  - {p}" for p in [*current, folder])]) + "\n"
    after = _load_condarc(new_text, path)
    if after != dict(before, envs_dirs=[*current, folder]):
        raise EnvError(
            f"could not add {folder} to envs_dirs in {path} without changing other settings; "
            f"run `conda config --append envs_dirs {folder}` instead."
        )
    atomic_write_text(path, new_text)
    return {"condarc": str(path), "added": True, "envs_dirs": after["envs_dirs"]}


def register_envs_root(
    envs_root: Optional[Union[str, Path]] = None, condarc: Optional[Union[str, Path]] = None
) -> dict:
    """Make conda envs under <envs_root>/user_conda usable by name (`conda activate <name>`), now and after
    every restore(): the registration is recorded on persistent storage and re-applied there."""
    from kit.envs.kernels import read_json_object

    layout = get_layout(envs_root)
    state = read_json_object(layout.state) if layout.state.exists() else {}
    dirs = state.setdefault("envs_dirs", [])
    if str(layout.conda) not in dirs:
        dirs.append(str(layout.conda))
        atomic_write_text(layout.state, json.dumps(state, indent=1) + "\n")
    return register_envs_dir(layout.conda, condarc)
