"""Conda backend through the conda-pack library: clone with relocated prefixes, pack, finish an unpacked env.

conda-pack takes each conda-managed file from the package cache (where it still holds the build-time
placeholder) and rewrites the placeholder, so a clone or an unpacked archive works at its new path without
the network; files installed by pip are copied with the old prefix rewritten in text files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, Optional

from kit.envs.archive import ArchiveWriter, archive_writer
from kit.envs.prefix import EnvError


def _load(prefix: str, ignore_editable: bool):
    import conda_pack

    try:
        return conda_pack.CondaEnv.from_prefix(prefix, ignore_editable_packages=ignore_editable)
    except conda_pack.CondaPackException as exc:
        text = str(exc)
        if "editable" in text:
            text += (
                "\nEditable installs point at a source tree outside the env that is not shipped; pass "
                "ignore_editable=True (--ignore-editable-packages) to pack without them and reinstall them "
                "after unpacking, or `pip install` them normally first."
            )
        raise EnvError(f"conda-pack cannot read the env {prefix!r}: {text}") from exc


def _set_total(bar, total: int) -> None:
    """The bar counts conda-pack's records (files, links, conda-meta), not what a walk of the folder sees."""
    if bar is not None:
        bar.total = total
        bar.refresh()


def _mtime(prefix: str) -> Optional[float]:
    history = Path(prefix, "conda-meta", "history")
    return history.lstat().st_mtime if history.exists() else None


class _KitTarArchive:
    """conda-pack archive target that writes through the kit's ArchiveWriter (member list with sizes and hashes)."""

    def __init__(self, writer: ArchiveWriter):
        self.writer = writer

    def add(self, source: str, target: str) -> None:
        self.writer.add_path(source, target)

    def add_bytes(self, source: str, data: bytes, target: str) -> None:
        st = os.lstat(source)
        self.writer.add_bytes(target, data, mode=st.st_mode & 0o777, st=st)


def pack_conda(
    prefix: os.PathLike | str,
    raw: IO[bytes],
    fmt: str,
    level: int,
    threads: int,
    ignore_editable: bool = False,
    manifest: Optional[dict] = None,
    bar=None,
) -> dict:
    """Pack a conda env with conda-pack's file list and prefix records, into our compressor.

    The archive holds what `conda pack` writes (bin/conda-unpack, activate scripts) between the kit manifest
    (first) and the member list (last); our compressor gives tar.zst a level and threads, which conda-pack's
    own tar.zst ignores.
    """
    # conda-pack's Packer is its internal writer class (conda-pack 0.8-0.9); it calls archive.add(source,
    # target) and archive.add_bytes(source, data, target), which _KitTarArchive provides.
    from conda_pack.core import Packer

    prefix = os.path.abspath(prefix)
    env = _load(prefix, ignore_editable)
    _set_total(bar, len(env.files))
    head = dict(manifest or {}, kind="conda", prefix=prefix)
    with archive_writer(raw, fmt, level, threads, head, mtime=_mtime(prefix)) as writer:
        packer = Packer(prefix, _KitTarArchive(writer))
        for f in env.files:
            packer.add(f)
            if bar is not None:
                bar.update(1)
        packer.finish()
        writer.finish({})
    return {"files": len(env.files), "prefix_records": len(packer.prefixes)}


class _CopyArchive:
    """conda-pack archive target that copies into a folder (its no-archive mode hard-links on one disk,
    which would make a clone share inodes with its source)."""

    def __init__(self, output: str):
        self.output = output

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

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


def clone_conda(
    source: os.PathLike | str,
    tmp_dir: os.PathLike | str,
    final_prefix: os.PathLike | str,
    ignore_editable: bool = False,
    bar=None,
) -> dict:
    """Copy a conda env into `tmp_dir` with every prefix already rewritten to `final_prefix` (no conda-unpack)."""
    from conda_pack.core import Packer

    source = os.path.abspath(source)
    env = _load(source, ignore_editable)
    _set_total(bar, len(env.files))
    with _CopyArchive(str(tmp_dir)) as arc:
        packer = Packer(source, arc, dest_prefix=str(final_prefix))
        for f in env.files:
            try:
                packer.add(f)
            except ValueError as exc:
                if "padding" not in str(exc):
                    raise
                raise EnvError(
                    f"{f.target} is a binary file whose build-time prefix ({len(f.prefix_placeholder or '')} "
                    f"characters) is shorter than the target path {final_prefix} ({len(str(final_prefix))}); "
                    f"binary prefixes can only shrink. Choose a shorter target folder, or method='conda-clone'."
                ) from exc
            if bar is not None:
                bar.update(1)
        packer.finish()
    return {"files": len(env.files)}


def finish_unpack(target: os.PathLike | str) -> dict:
    """Run the archive's own bin/conda-unpack (by absolute path, with this python) to fix the prefixes."""
    script = Path(target).absolute() / "bin" / "conda-unpack"
    if not script.exists():
        return {"conda_unpack": False}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvError(f"{script} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return {"conda_unpack": True}
