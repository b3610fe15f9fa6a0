"""Virtualenv backend: create, clone (copy + prefix rewrite), pack to an archive, finish an unpacked one."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import IO, Optional, Union

from kit.atomic import atomic_dir
from kit.envs.archive import MANIFEST, add_bytes, compressed_writer, manifest_bytes
from kit.envs.layout import get_layout
from kit.envs.prefix import SCAN_LIMIT, EnvError, kind_of, rewrite_prefix_files, scan_prefix

INHERIT_PTH = "_kit_inherit.pth"


def create_venv(target: os.PathLike | str, python: Optional[str] = None, inherit: bool = True) -> Path:
    """Make a virtualenv at the (absent) `target` with `python` (default: this one), without pip.

    inherit=True sees the packages of the interpreter it was made from, even when that one is itself a
    virtualenv (a .pth file lists its site-packages): a light env on persistent storage on top of an image's
    torch / torch_npu, to which the user adds packages.
    """
    target = Path(target).absolute()
    python = python or sys.executable
    cmd = [python, "-m", "venv", "--without-pip", str(target)]
    if inherit:
        cmd.insert(-1, "--system-site-packages")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-600:]}")
    if inherit:
        parent = subprocess.run(
            [
                python,
                "-c",
                "import site,sys; print(sys.prefix != sys.base_prefix); "
                "print('\\n'.join(site.getsitepackages()))",
            ],
            capture_output=True,
            text=True,
        )
        lines = parent.stdout.split("\n")
        if lines and lines[0] == "True":  # venv of a venv: --system-site-packages alone skips the middle one
            site_dir = next(target.glob("lib/python3*/site-packages"))
            (site_dir / INHERIT_PTH).write_text("\n".join(x for x in lines[1:] if x) + "\n", encoding="utf-8")
    return target


def _members(prefix: str):
    """(relative path, absolute path) of every entry under `prefix`, directories first, links not followed."""
    for dirpath, dirnames, filenames in os.walk(prefix):
        linked = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = sorted(d for d in dirnames if d not in linked)
        rel_dir = os.path.relpath(dirpath, prefix)
        if rel_dir != ".":
            yield rel_dir, dirpath
        for name in sorted(filenames + linked):
            yield os.path.normpath(os.path.join(rel_dir, name)), os.path.join(dirpath, name)


def pack_tree(
    prefix: os.PathLike | str,
    raw: IO[bytes],
    fmt: str,
    level: int,
    threads: int,
    manifest: dict,
    progress=None,
) -> dict:
    """Write `prefix` as a tar archive into the open file `raw`, recording text files that mention the prefix.

    Absolute symbolic links (a venv's bin/python3.X -> the base interpreter) go to the manifest, not the tar,
    so that extraction never has to create a link that leaves the target. The manifest is the last member.
    """
    prefix = os.path.abspath(prefix)
    old = prefix.encode()
    prefix_files, abs_links = [], {}
    counts = {"files": 0, "bytes": 0}
    comp = compressed_writer(raw, fmt, level, threads)
    try:
        with tarfile.open(fileobj=comp, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel, path in _members(prefix):
                if progress and (os.path.islink(path) or not os.path.isdir(path)):
                    progress(1)  # one tick per file or link, what walk_tree() counts
                if os.path.islink(path) and os.path.isabs(os.readlink(path)):
                    abs_links[rel] = os.readlink(path)
                    continue
                info = tar.gettarinfo(path, rel)
                if info.isreg():
                    with open(path, "rb") as fh:
                        if info.size <= SCAN_LIMIT:
                            data = fh.read()
                            if scan_prefix(data, old):
                                prefix_files.append(rel)
                            info.size = len(data)
                            tar.addfile(info, io.BytesIO(data))
                        else:
                            tar.addfile(info, fh)
                    counts["files"] += 1
                    counts["bytes"] += info.size
                else:
                    tar.addfile(info)
            manifest = dict(manifest, prefix=prefix, prefix_files=prefix_files, abs_links=abs_links)
            add_bytes(tar, MANIFEST, manifest_bytes(manifest))
    finally:
        comp.close()
    counts["prefix_files"] = len(prefix_files)
    return counts


def finish_unpack(target: os.PathLike | str, manifest: dict) -> dict:
    """After extraction: rewrite the recorded prefix in text files, then recreate the absolute links."""
    target = os.path.abspath(target)
    root = os.path.realpath(target)
    old = manifest["prefix"]
    files = []
    for rel in manifest.get("prefix_files", []):
        path = os.path.realpath(os.path.join(target, rel))
        if not path.startswith(root + os.sep):
            raise EnvError(
                f"archive manifest lists {rel!r}, which is outside the target; refusing the archive."
            )
        files.append(rel)
    changed = rewrite_prefix_files(target, files, old, target)
    missing = []
    for rel, dest in manifest.get("abs_links", {}).items():
        if ".." in Path(rel).parts or os.path.isabs(rel):
            raise EnvError(f"archive manifest has a link named {rel!r}; refusing the archive.")
        if dest == old or dest.startswith(old + os.sep):
            dest = target + dest[len(old) :]
        elif not os.path.exists(dest):
            missing.append(dest)
        link = os.path.join(target, rel)
        if os.path.lexists(link):
            raise EnvError(f"archive has both a file and a link at {rel!r}; refusing the archive.")
        os.symlink(dest, link)
    if missing:
        raise EnvError(
            f"this virtualenv needs its base interpreter at {', '.join(sorted(set(missing)))}, which does not "
            f"exist here: virtualenvs are tied to the Python they were made with (same image, same path). "
            f"Unpack it on a machine with that Python, or recreate it with kit.envs.create_venv."
        )
    return {"rewritten": changed, "links": len(manifest.get("abs_links", {}))}


def site_packages(prefix: os.PathLike | str) -> Optional[Path]:
    """The env's lib/pythonX.Y/site-packages, if any."""
    found = sorted(Path(prefix).glob("lib/python3*/site-packages"))
    return found[0] if found else None


def _text_files_with(root: Union[str, Path], needle: str) -> list[str]:
    """Relative paths of the text files under `root` that contain `needle`."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p) and os.path.getsize(p) <= SCAN_LIMIT:
                with open(p, "rb") as fh:
                    if scan_prefix(fh.read(), needle.encode()):
                        out.append(os.path.relpath(p, root))
    return out


def demo_source(envs_root: Optional[Union[str, Path]] = None) -> Path:
    """A small virtualenv to practise on (<envs_root>/venvs/demo-source), on top of this python's packages;
    made once, reused after."""
    folder = get_layout(envs_root).venvs / "demo-source"
    if kind_of(folder) != "venv":
        with atomic_dir(folder, overwrite=True, what="demo env") as tmp:
            os.rmdir(tmp)
            create_venv(tmp)
            # venv wrote the temporary path into its scripts; they must name the final one
            rewrite_prefix_files(tmp, _text_files_with(tmp, str(tmp)), str(tmp), str(folder))
    return folder
