"""Safe extraction: no member, link or link chain may land outside the target; special files refused."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

import kit.envs as envs
from kit.envs.archive import compressed_writer, format_of, n_threads


def _tar(path: Path, members: list) -> Path:
    """Write a tar from (name, kind, payload) rows: kind file|dir|sym|hard|fifo|chr."""
    with tarfile.open(path, "w") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                data = payload.encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {
                "dir": tarfile.DIRTYPE,
                "sym": tarfile.SYMTYPE,
                "hard": tarfile.LNKTYPE,
                "fifo": tarfile.FIFOTYPE,
                "chr": tarfile.CHRTYPE,
            }[kind]
            if kind == "dir":
                info.mode = 0o755
            if kind in ("sym", "hard"):
                info.linkname = payload
            tar.addfile(info)
    return path


@pytest.fixture
def box(tmp_path):
    """A target folder inside a parent whose other contents must never change."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep.txt").write_text("original")
    target = tmp_path / "box" / "target"
    target.mkdir(parents=True)
    return tmp_path, target


def _outside_unchanged(root: Path) -> None:
    assert sorted(p.name for p in root.iterdir()) == ["box", "bad.tar", "outside"] or sorted(
        p.name for p in root.iterdir()
    ) == ["bad.tar", "box", "outside"]
    assert [p.name for p in (root / "outside").iterdir()] == ["keep.txt"]
    assert (root / "outside" / "keep.txt").read_text() == "original"
    assert [p.name for p in (root / "box").iterdir()] == ["target"]


BAD = {
    "dotdot": [("../../outside/evil.txt", "file", "x")],
    "dotdot-inner": [("a/../../evil.txt", "file", "x")],
    "absolute": [("/tmp/kit-evil-absolute.txt", "file", "x")],
    "abs-link": [("lib/link", "sym", "/etc")],
    "up-link": [("link", "sym", "../../outside")],
    "link-chain": [("d", "dir", None), ("a", "sym", "."), ("d/b", "sym", "../a/..")],
    "through-link": [("sub", "dir", None), ("lnk", "sym", "sub"), ("lnk/file.txt", "file", "x")],
    "hard-outside": [("h", "hard", "../../outside/keep.txt")],
    "hard-unknown": [("h", "hard", "never-extracted")],
    "fifo": [("pipe", "fifo", None)],
    "device": [("dev", "chr", None)],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsafe_members_are_refused(box, case):
    root, target = box
    bad = _tar(root / "bad.tar", [("ok.txt", "file", "fine")] + BAD[case])
    with pytest.raises(envs.EnvArchiveError, match="refusing|outside"):
        envs.safe_extract(bad, target)
    _outside_unchanged(root)
    assert not Path("/tmp/kit-evil-absolute.txt").exists()


def test_unpack_of_an_unsafe_archive_leaves_no_env(box):
    root, target = box
    bad = _tar(root / "bad.tar", [("pyvenv.cfg", "file", "home = /usr/bin\n"), ("x", "sym", "/etc/passwd")])
    with pytest.raises(envs.EnvArchiveError, match="absolute path"):
        envs.unpack(bad, root / "box" / "fresh", verify_imports=None)
    assert not (root / "box" / "fresh").exists()
    _outside_unchanged(root)


def test_safe_links_and_modes_are_kept(box):
    root, target = box
    path = _tar(
        root / "good.tar",
        [
            ("lib", "dir", None),
            ("lib/libz.so.1.3", "file", "ELF"),
            ("lib/libz.so", "sym", "libz.so.1.3"),
            ("lib/dup.so", "hard", "lib/libz.so.1.3"),
            ("./bin/", "dir", None),
            ("bin/up", "sym", "../lib"),
        ],
    )
    counts = envs.safe_extract(path, target)
    assert counts == {"files": 1, "dirs": 2, "symlinks": 2, "hardlinks": 1, "bytes": 3}
    assert (target / "lib" / "libz.so").read_text() == "ELF" and os.readlink(
        target / "lib" / "libz.so"
    ) == "libz.so.1.3"
    assert os.stat(target / "lib" / "dup.so").st_ino == os.stat(target / "lib" / "libz.so.1.3").st_ino
    assert (target / "bin" / "up" / "libz.so.1.3").read_text() == "ELF"


def test_setuid_bits_are_dropped(box):
    root, target = box
    info = tarfile.TarInfo("suid")
    info.mode, info.size = 0o4755, 1
    with tarfile.open(root / "s.tar", "w") as tar:
        tar.addfile(info, io.BytesIO(b"x"))
    envs.safe_extract(root / "s.tar", target)
    assert (target / "suid").stat().st_mode & 0o7777 == 0o755


def test_formats_and_threads():
    assert (
        format_of("a/env.tar.zst") == "tar.zst"
        and format_of("x.tgz") == "tar.gz"
        and format_of("y.tar") == "tar"
    )
    assert n_threads(0) == (os.cpu_count() or 1) and n_threads(3) == 3
    with pytest.raises(envs.EnvArchiveError):
        compressed_writer(io.BytesIO(), "tar.bz2")
