"""Virtualenv backend: create, pack into a kit archive, finish an unpacked one, and a demo env to practise on."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Optional, Union

from kit.envs.archive import ArchiveWriter
from kit.envs.config import get_layout
from kit.envs.prefix import (
    EnvArchiveError,
    EnvError,
    inside,
    kind_of,
    rewrite_prefix_files,
    scan_tree,
)
from kit.storage.atomic import atomic_dir

INHERIT_PTH = "_kit_inherit.pth"
_SITE = "import site, sys; print(sys.prefix != sys.base_prefix); print('\\n'.join(site.getsitepackages()))"


def create_venv(target: os.PathLike | str, python: Optional[str] = None, inherit: bool = True) -> Path:
    """Make a virtualenv at the (absent) `target` with `python` (default: this one), without pip; inherit=True
    sees that interpreter's packages (an image's torch / torch_npu), even when it is a virtualenv itself."""
    target = Path(target).absolute()
    python = python or sys.executable
    cmd = [python, "-m", "venv", "--without-pip", str(target)]
    if inherit:
        cmd.insert(-1, "--system-site-packages")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-600:]}")
    if inherit:
        lines = subprocess.run([python, "-c", _SITE], capture_output=True, text=True).stdout.split("\n")
        if lines and lines[0] == "True":  # venv of a venv: --system-site-packages alone skips the middle one
            site_dir = next(target.glob("lib/python3*/site-packages"))
            (site_dir / INHERIT_PTH).write_text("\n".join(x for x in lines[1:] if x) + "\n", encoding="utf-8")
    return target


_INTERPRETER = re.compile(r"^python[0-9.]*$")


def _outside_link_ok(rel: str, dest: str) -> bool:
    """Absolute links that leave the env are allowed only where a virtualenv has them: bin/python* pointing at
    the base interpreter (a file named python*)."""
    folder, _, name = rel.rpartition("/")
    return folder == "bin" and all(_INTERPRETER.match(n) for n in (name, os.path.basename(dest)))


def pack_tree(prefix: str, writer: ArchiveWriter, entries: list, progress=None) -> dict:
    """Write the scan_tree() `entries` of the absolute `prefix` into the kit archive `writer`; progress(1) per file
    or link. Absolute links (bin/python3.X -> the base interpreter) go to the member list's `abs_links`, not the
    tar, so that extraction never creates a link that leaves the target."""
    abs_links, outside = {}, []
    for rel, path, st in entries:
        if stat.S_ISLNK(st.st_mode) and os.path.isabs(os.readlink(path)):
            dest = os.readlink(path)
            abs_links[rel] = dest
            if not inside(prefix, dest) and not _outside_link_ok(rel, dest):
                outside.append(f"{rel} -> {dest}")
    if outside:
        raise EnvError(
            f"cannot pack {prefix}: {len(outside)} link(s) point outside the env ({', '.join(outside[:5])}); an "
            f"unpacked env could not have them. Replace them with copies or relative links, then pack again."
        )
    writer.add_entries(entries, skip=abs_links, progress=progress)
    writer.finish({"abs_links": abs_links})
    files = sum(1 for m in writer.members if m[1] == "f")
    return {"files": files, "bytes": writer.bytes, "prefix_files": len(writer.prefix_files)}


def _refused(why: str) -> EnvArchiveError:
    return EnvArchiveError(f"archive manifest {why}; refusing the archive.")


def finish_unpack(target: os.PathLike | str, manifest: dict) -> dict:
    """After extraction: rewrite the recorded prefix in text files, then recreate the absolute links. The
    manifest comes from the archive, so it is checked like the members were (only bin/python* may leave the env)."""
    target = os.path.abspath(target)
    root = os.path.realpath(target)
    old = manifest.get("prefix")
    if not isinstance(old, str) or not os.path.isabs(old):
        raise EnvArchiveError(f"archive manifest has no absolute 'prefix' ({old!r}); the archive is damaged.")
    files = manifest.get("prefix_files", [])
    for rel in files:
        if not inside(root, os.path.realpath(os.path.join(target, rel))):
            raise _refused(f"lists {rel!r}, which is outside the target")
    links, missing = [], []
    for rel, dest in (manifest.get("abs_links") or {}).items():
        link = os.path.join(target, rel)  # a JSON key: always text; `..` or an absolute name lands outside
        if not isinstance(dest, str) or not inside(root, os.path.realpath(os.path.dirname(link))):
            raise _refused(f"has a link {rel!r} ({dest!r}) outside the target or to no path")
        if inside(old, dest):
            dest = os.path.normpath(target + dest[len(old) :])
            if not inside(target, dest):
                raise _refused(f"has a link {rel!r} that leaves the env")
        elif not _outside_link_ok(rel, dest):
            raise _refused(f"has a link {rel!r} -> {dest!r} outside the env (only bin/python* may leave it)")
        elif not os.path.isfile(dest):
            missing.append(dest)
        if os.path.lexists(link):
            raise _refused(f"has a link {rel!r} where the archive has a file")
        links.append((dest, link))
    if missing:
        raise EnvError(
            f"this virtualenv needs its base interpreter at {', '.join(sorted(set(missing)))}, which does not "
            f"exist here: virtualenvs are tied to the Python they were made with (same image, same path). "
            f"Unpack it on a machine with that Python, or recreate it with kit.envs.create_venv."
        )
    changed = rewrite_prefix_files(target, files, old, target)[0]
    for dest, link in links:
        os.symlink(dest, link)
    return {"rewritten": changed, "links": len(links)}


def demo_source(envs_root: Optional[Union[str, Path]] = None) -> Path:
    """A small virtualenv to practise on (<envs_root>/venvs/demo-source), on top of this python's packages;
    made once, reused after."""
    folder = get_layout(envs_root).venvs / "demo-source"
    if kind_of(folder) != "venv":
        with atomic_dir(folder, overwrite=True, what="demo env", lock=False) as tmp:  # made once, reused
            os.rmdir(tmp)
            create_venv(tmp)
            # venv wrote the temporary path into its scripts (it makes no binaries); they must name the final one
            files = [rel for rel, _path, st in scan_tree(tmp) if stat.S_ISREG(st.st_mode)]
            rewrite_prefix_files(tmp, files, str(tmp), str(folder))
    return folder
