"""Safe extraction: no member, link or link chain may land outside the target; special files refused."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path
from typing import Optional

import pytest

import kit.envs as envs
from kit.envs.archive import compressed_writer, format_of, n_threads
from kit.envs.prefix import gnu_program


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
    "file-then-folder": [("x", "file", "a"), ("x/y", "file", "b")],
    "folder-then-file": [("x", "dir", None), ("x", "file", "a")],
    "hard-link-as-folder": [("h", "hard", "ok.txt"), ("h/z", "file", "x")],
    "folder-then-hard-link": [("x", "dir", None), ("x", "hard", "ok.txt")],
    "fifo": [("pipe", "fifo", None)],
    "device": [("dev", "chr", None)],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsafe_members_are_refused(box, case):
    root, target = box
    bad = _tar(root / "bad.tar", [("ok.txt", "file", "fine")] + BAD[case])
    with pytest.raises(envs.EnvArchiveError, match="refusing|outside"):
        envs.extract(bad, target)
    _outside_unchanged(root)
    assert not Path("/tmp/kit-evil-absolute.txt").exists()


KIT_HEAD = {"kind": "venv", "name": "x", "prefix": "/x", "kit_archive": 2, "hash": "xxh3_64"}


def _kit_tar(path: Path, members: list) -> Path:
    """_tar with a kit manifest first and a member list last that names every member (as a bad archive could)."""
    import xxhash

    listed = []
    for name, kind, payload in members:
        if kind == "file":
            listed.append([name, "f", len(payload), xxhash.xxh3_64(payload.encode()).hexdigest()])
        else:
            listed.append([name, {"dir": "d", "sym": "l", "hard": "h"}.get(kind, "f"), 0, payload or ""])
    trailer = {"members": listed, "hash": "xxh3_64", "prefix_files": [], "abs_links": {}}
    rows = [(".kit-env.json", "file", json.dumps(KIT_HEAD))] + members
    return _tar(path, rows + [(".kit-env-members.json", "file", json.dumps(trailer))])


@pytest.mark.skipif(gnu_program("tar") is None, reason="GNU tar writes kit archives where it is installed")
@pytest.mark.parametrize("case", sorted(BAD))
def test_unsafe_members_of_a_kit_archive_never_land_outside(box, case):
    """The same members in a kit archive, which GNU tar extracts: refused, and nothing is written outside."""
    root, target = box
    bad = _kit_tar(root / "bad.tar", [("ok.txt", "file", "fine")] + BAD[case])
    with pytest.raises(envs.EnvArchiveError):
        envs.unpack(bad, root / "box" / "fresh", verify_imports=None)
    _outside_unchanged(root)
    assert not Path("/tmp/kit-evil-absolute.txt").exists()


def test_a_member_list_that_is_no_file_is_missing_not_waited_for(box):
    """A FIFO where the member list should be: reading it would wait forever for a writer."""
    root, _ = box
    rows = [(".kit-env.json", "file", json.dumps(KIT_HEAD)), ("ok.txt", "file", "fine")]
    bad = _tar(root / "bad.tar", rows + [(".kit-env-members.json", "fifo", None)])
    with pytest.raises(envs.EnvArchiveError, match="incomplete|FIFO"):
        envs.unpack(bad, root / "box" / "fresh", verify_imports=None)
    _outside_unchanged(root)


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
    counts, manifest = envs.extract(path, target)
    assert counts == {"files": 1, "dirs": 2, "symlinks": 2, "hardlinks": 1, "bytes": 3} and manifest is None
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
    envs.extract(root / "s.tar", target)
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


# ---- archives the kit writes: manifest first, member list with sizes and hashes last, checked on unpack ----


@pytest.fixture(scope="module")
def small_env(tmp_path_factory) -> Path:
    """A venv with text files of many sizes, one file above the whole-read limit, links and a hard link."""
    prefix = envs.create_venv(tmp_path_factory.mktemp("arch") / "env")
    site = next(prefix.glob("lib/python3*/site-packages"))
    for i in range(12):
        (site / f"mod{i}.py").write_text(f"VALUE = {i}\n" * (i * 40))
    (site / "big.bin").write_bytes(bytes(range(256)) * (3 << 12))  # 3 MiB: read in chunks, not whole
    (site / "mod0_link.py").symlink_to("mod0.py")
    os.link(site / "mod1.py", site / "mod1_hard.py")
    return prefix


def _boundaries(plain_tar: Path) -> list:
    with tarfile.open(plain_tar) as tar:
        return [m.offset for m in tar.getmembers()][1:]


def _recompress(data: bytes, fmt: str) -> bytes:
    """A complete, valid compressed stream of `data` (what a cut-short tar looks like after recompression)."""
    if fmt == "tar.zst":
        import zstandard

        return zstandard.ZstdCompressor(level=1, write_checksum=True).compress(data)
    if fmt == "tar.gz":
        import gzip

        return gzip.compress(data, 1)
    return data


def _refused(archive: Path, target: Path) -> str:
    with pytest.raises(envs.EnvArchiveError) as info:
        envs.unpack(archive, target, verify_imports=None)
    assert not target.exists() and [p.name for p in target.parent.iterdir()] == []
    return str(info.value)


@pytest.mark.parametrize("fmt", ["tar", "tar.gz", "tar.zst"])
def test_archives_cut_anywhere_never_unpack(small_env, tmp_path, fmt):
    plain = tmp_path / "env.tar"
    envs.pack(small_env, plain)
    tar_bytes = plain.read_bytes()
    whole = tmp_path / f"whole.{fmt}"
    envs.pack(small_env, whole)
    data = whole.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    cut = tmp_path / f"cut.{fmt}"
    # exactly at member boundaries (a tar reader sees a clean end there), recompressed as complete streams
    boundaries = _boundaries(plain)
    assert len(boundaries) > 25
    for offset in boundaries:
        cut.write_bytes(_recompress(tar_bytes[:offset], fmt))
        assert "incomplete" in _refused(cut, out / "env")
    # evenly spaced cuts of the archive file itself, up to the end of its member list
    with tarfile.open(plain) as tar:
        last = tar.getmembers()[-1]  # the member list; a .tar cut after it holds every member
    end_of_list = len(data) if fmt != "tar" else last.offset_data + last.size
    for k in range(1, 41):
        cut.write_bytes(data[: end_of_list * k // 41])
        _refused(cut, out / "env")
    assert envs.unpack(whole, out / "env", verify_imports=None)["members_verified"] is True


def test_read_archive_manifest_reads_the_first_member(small_env, tmp_path):
    for fmt in ("tar.zst", "tar.gz", "tar"):
        manifest = envs.read_archive_manifest(envs.pack(small_env, tmp_path / f"e.{fmt}")["archive"])
        assert manifest["kind"] == "venv" and manifest["name"] == "env" and manifest["kit_archive"] == 2
        assert manifest["prefix"] == str(small_env) and manifest["hash"] == "xxh3_64"


def _replace_member(archive: Path, out: Path, name: str, change) -> Path:
    with tarfile.open(archive) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isreg() else None
            if m.name == name:
                data = change(data)
                m.size = len(data)
            dst.addfile(m, None if data is None else io.BytesIO(data))
    return out


def test_damaged_member_is_named(small_env, tmp_path):
    plain = Path(envs.pack(small_env, tmp_path / "env.tar")["archive"])
    data = bytearray(plain.read_bytes())
    at = data.index(b"VALUE = 7\n" * 3)
    data[at] ^= 0x20  # one flipped bit inside mod7.py, same size: only the hash can tell
    (tmp_path / "flip.tar").write_bytes(bytes(data))
    (tmp_path / "out").mkdir()
    message = _refused(tmp_path / "flip.tar", tmp_path / "out" / "env")
    assert "mod7.py" in message and "hash" in message
    extra = _replace_member(
        plain,
        tmp_path / "grown.tar",
        next(m.name for m in tarfile.open(plain).getmembers() if m.name.endswith("mod3.py")),
        lambda d: d + b"# more\n",
    )
    assert "bytes where the member list has" in _refused(extra, tmp_path / "out" / "env")


def test_bad_json_in_an_archive_manifest_is_a_clear_error(small_env, tmp_path):
    plain = Path(envs.pack(small_env, tmp_path / "env.tar")["archive"])
    bad = _replace_member(plain, tmp_path / "bad.tar", ".kit-env.json", lambda d: b"{not json" + d[9:])
    (tmp_path / "out").mkdir()
    assert "not valid JSON" in _refused(bad, tmp_path / "out" / "env")
    with pytest.raises(envs.EnvArchiveError, match="not valid JSON"):
        envs.read_archive_manifest(bad)


@pytest.mark.parametrize(
    "links",
    [
        {"etc_link": "/etc"},
        {"bin/python3": "/etc"},  # an interpreter name, but not pointing at one
        {"lib/escape": "{old}/../../etc"},  # into the old prefix on paper, out of the target in fact
    ],
)
def test_archive_manifest_cannot_plant_links_outside(small_env, tmp_path, links):
    plain = Path(envs.pack(small_env, tmp_path / "env.tar")["archive"])

    def plant(data):
        trailer = json.loads(data)
        trailer["abs_links"].update({k: v.format(old=small_env) for k, v in links.items()})
        return json.dumps(trailer).encode()

    bad = _replace_member(plain, tmp_path / "bad.tar", ".kit-env-members.json", plant)
    (tmp_path / "out").mkdir()
    assert "refusing the archive" in _refused(bad, tmp_path / "out" / "env")


def test_unsafe_absolute_links_are_refused_at_pack_time(tmp_path):
    env = envs.create_venv(tmp_path / "env", inherit=False)
    (env / "etc_link").symlink_to("/etc")
    with pytest.raises(envs.EnvError, match="point outside the env.*etc_link -> /etc"):
        envs.pack(env, tmp_path / "env.tar.zst")
    assert list(tmp_path.glob("env.tar*")) == []


def test_format_and_extension_must_agree_and_levels_are_checked(small_env, tmp_path):
    with pytest.raises(envs.EnvArchiveError, match="must agree"):
        envs.pack(small_env, tmp_path / "env.tar.zst", fmt="tar.gz")
    with pytest.raises(envs.EnvArchiveError, match="must agree"):
        envs.pack(small_env, tmp_path / "env.rar", fmt="tar")
    for fmt, level in (("tar.zst", 99), ("tar.zst", 0), ("tar.gz", 10)):
        with pytest.raises(envs.EnvError, match=f"level {level} is outside"):
            envs.pack(small_env, tmp_path / f"env.{fmt}", level=level)
    assert [p.name for p in tmp_path.iterdir()] == []
    gz = envs.pack(small_env, tmp_path / "env.tgz", fmt="tar.gz")
    assert Path(gz["archive"]).read_bytes()[:2] == b"\x1f\x8b"


def test_disk_full_while_packing_is_an_os_error_the_cli_prints_in_one_line(small_env, tmp_path, monkeypatch):
    import errno

    from kit.errors import user_message

    class Full:
        """A compressor whose output volume fills up after the first write."""

        def __init__(self, *args, **kwargs):
            self.calls = 0

        def write(self, data):
            self.calls += 1
            if self.calls > 1:
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "env.tar.zst"))
            return len(data)

        def tell(self):
            return 0

        def close(self):
            pass

    monkeypatch.setattr("kit.envs.archive.compressed_writer", Full)  # the tar reaches it in 1 MiB writes
    with pytest.raises(OSError) as info:
        envs.pack(small_env, tmp_path / "env.tar.zst")
    assert info.value.errno == errno.ENOSPC  # not swallowed or re-wrapped on its way through the threads
    assert user_message(info.value).startswith(
        f"cannot write {str(tmp_path / 'env.tar.zst')!r}: the disk is full"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no archive, no temporary file left


@pytest.fixture(params=["zstd program", "python-zstandard"])
def zstd_reader(request, monkeypatch):
    """GNU tar runs `zstd -d` where it is installed; without it the kit decompresses into tar's pipe."""
    if request.param == "python-zstandard":
        real = shutil.which
        monkeypatch.setattr("kit.envs.extraction.shutil.which", lambda n: None if n == "zstd" else real(n))
    return request.param


def test_zstd_archives_carry_a_checked_frame(small_env, tmp_path, zstd_reader):
    archive = Path(envs.pack(small_env, tmp_path / "env.tar.zst", level=5, threads=2)["archive"])
    data = archive.read_bytes()
    assert data[:4] == b"\x28\xb5\x2f\xfd" and data[4] & 0x04  # a zstd frame whose header says: checksum
    result = envs.unpack(archive, tmp_path / "out" / "env", verify_imports=None)
    assert result["members_verified"] is True and result["files"] > 15
    (tmp_path / "cut.tar.zst").write_bytes(data[:-3])  # the frame's checksum cut short
    with pytest.raises(envs.EnvArchiveError, match="truncated|corrupt"):
        envs.unpack(tmp_path / "cut.tar.zst", tmp_path / "out" / "cut", verify_imports=None)


@pytest.mark.skipif(
    not os.path.exists("/proc/self/io"), reason="tar's progress comes from Linux's /proc/PID/io"
)
def test_unpack_progress_follows_the_bytes_tar_writes(tmp_path):
    """While tar runs, progress() gets the bytes it has written so far, before it ends (a child that writes
    3 MiB, then waits until progress has seen them, or a minute)."""
    import subprocess
    import sys

    from kit.envs.extraction import _follow

    code = "import select, sys; open(sys.argv[1], 'wb').write(bytes(3 << 20)); select.select([0], [], [], 60)"
    child = subprocess.Popen(
        [sys.executable, "-I", "-B", "-c", code, str(tmp_path / "f")], stdin=subprocess.PIPE
    )
    seen: list = []

    def progress(n: int) -> None:
        seen.append(n)
        if sum(seen) >= 3 << 20:
            child.stdin.close()

    assert _follow(child, progress) == sum(seen)
    assert 3 << 20 <= sum(seen) < (3 << 20) + 65536 and child.returncode == 0


def test_awkward_names_sizes_and_modes_round_trip(tmp_path):
    """Names over 100 bytes, non-ASCII, non-UTF-8 and option-like names, a newline and a backslash in a name (tar
    reads the names from a list), empty files, a file of whole blocks, one above the prefix-scan limit, a link, an
    odd mode and mtime 0: written by the kit, read back by tarfile and unpacked unchanged."""
    from kit.envs.archive import archive_writer
    from kit.envs.extraction import extract
    from kit.envs.prefix import SCAN_LIMIT, scan_tree

    root = tmp_path / "tree"
    deep = root / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (deep / "short.py").write_text("x = 1\n")
    (deep / ("f" * 99)).write_text("y = 2\n")
    (root / "empty.txt").write_bytes(b"")
    (root / "exact.bin").write_bytes(b"\1" * 1024)
    (root / "naïve.py").write_text("z = 3\n")
    for odd in ("-C", "--remove-files", "new\nline.py", "back\\slash.py", os.fsdecode(b"latin\xe9.py")):
        (root / odd).write_text("w = 4\n")
    (root / "big.bin").write_bytes(b"\2" * (SCAN_LIMIT + 5))
    (root / "link").symlink_to("empty.txt")
    os.chmod(root / "exact.bin", 0o751)
    os.utime(root / "empty.txt", (0, 0))
    archive = tmp_path / "t.tar"
    with open(archive, "wb") as fh, archive_writer(fh, "tar", 3, 1, {"kind": "test"}, str(root)) as writer:
        writer.add_entries(scan_tree(root))
        writer.finish({})
    with tarfile.open(archive) as tar:  # checksums are checked as tarfile reads
        names = {m.name: m for m in tar.getmembers()}
    long_name = f"{'d' * 60}/{'e' * 60}/{'f' * 99}"
    assert names[long_name].size == 6 and names["exact.bin"].mode == 0o751
    assert names["empty.txt"].mtime == 0 and names["naïve.py"].size == 6
    assert names["big.bin"].size == SCAN_LIMIT + 5 and names["link"].linkname == "empty.txt"
    out = tmp_path / "out"
    out.mkdir()
    counts, manifest = extract(archive, out)
    assert manifest["kind"] == "test" and counts["files"] == 11 and counts["symlinks"] == 1

    def tree(top: Path) -> dict:
        return {
            str(p.relative_to(top)): (p.is_symlink(), p.lstat().st_mode, int(p.lstat().st_mtime))
            + ((os.readlink(p),) if p.is_symlink() else (p.read_bytes(),) if p.is_file() else ())
            for p in sorted(top.rglob("*"))
            if not p.is_dir() or p.is_symlink()
        }

    assert tree(out) == {k: v for k, v in tree(root).items()}


@pytest.mark.parametrize("change", ["shrunk", "grown", "removed"])
def test_a_file_that_changed_since_the_scan_stops_the_pack(tmp_path, change):
    """GNU tar reads each file after the scan: one whose size is not the scan's is named, small or big."""
    from kit.envs.archive import archive_writer
    from kit.envs.prefix import SCAN_LIMIT, scan_tree

    root = tmp_path / "tree"
    root.mkdir()
    for name, size in (("small.py", 100), ("big.bin", SCAN_LIMIT + 100)):
        (root / name).write_bytes(b"a" * size)
    for name, size in (("small.py", 100), ("big.bin", SCAN_LIMIT + 100)):
        entries = scan_tree(root)
        victim = root / name
        if change == "removed":
            victim.unlink()
        else:
            victim.write_bytes(b"a" * (size // 2 if change == "shrunk" else size + 4))
        now = {"shrunk": f"{size // 2} now", "grown": f"{size + 4} now", "removed": "gone now"}[change]
        with open(tmp_path / "t.tar", "wb") as fh, pytest.raises(envs.EnvError) as err:
            with archive_writer(fh, "tar", 3, 1, {"kind": "test"}, str(root)) as writer:
                writer.add_entries(entries)
                writer.finish({})
        assert f"{victim} changed while it was packed ({size} bytes when the env was scanned, {now})" in str(
            err.value
        )
        victim.write_bytes(b"a" * size)


def test_a_fifo_in_the_env_stops_the_pack_and_writes_nothing(tmp_path):
    """A FIFO (or device, socket) in an env: refused by name before tar runs, no archive left behind."""
    prefix = envs.create_venv(tmp_path / "env", inherit=False)
    os.mkfifo(prefix / "pipe")
    with pytest.raises(envs.EnvArchiveError, match=r"pipe is a device, socket, FIFO"):
        envs.pack(prefix, tmp_path / "out" / "env.tar.zst")
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_a_full_disk_while_unpacking_is_one_clear_error_and_no_env(small_env, tmp_path, monkeypatch):
    """GNU tar writes the files (here a stand-in that fails as tar does on a full disk): one line, no env left."""
    from kit.errors import user_message

    archive = envs.pack(small_env, tmp_path / "env.tar.zst")["archive"]
    fake = tmp_path / "tar"
    fake.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && echo 'tar (GNU tar) 1.34' && exit 0\ncat > /dev/null\n"
        "echo 'tar: lib/x.py: Cannot write: No space left on device' >&2\necho 'tar: Exiting with failure "
        "status due to previous errors' >&2\nexit 2\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr("kit.envs.extraction.gnu_program", lambda name: str(fake))
    with pytest.raises(OSError) as info:
        envs.unpack(archive, tmp_path / "out" / "env", verify_imports=None)
    assert [p.name for p in (tmp_path / "out").iterdir()] == []
    line = user_message(info.value)
    assert "\n" not in line and "disk is full" in line


def test_without_gnu_tar_pack_and_unpack_say_to_install_it(small_env, tmp_path, monkeypatch):
    archive = envs.pack(small_env, tmp_path / "env.tar.zst")["archive"]
    monkeypatch.setattr("kit.envs.extraction.gnu_program", lambda name: None)
    monkeypatch.setattr("kit.envs.archive.gnu_program", lambda name: None)
    with pytest.raises(envs.EnvArchiveError, match=r"GNU tar is needed .*apt-get install tar"):
        envs.unpack(archive, tmp_path / "out" / "env", verify_imports=None)
    assert [p.name for p in (tmp_path / "out").iterdir()] == []
    with pytest.raises(envs.EnvError, match=r"GNU tar is needed .*apt-get install tar"):
        envs.pack(small_env, tmp_path / "out" / "again.tar.zst")
    assert [p.name for p in (tmp_path / "out").iterdir()] == []


def test_a_users_tar_options_do_not_reach_the_kits_tar(small_env, tmp_path, monkeypatch):
    """TAR_OPTIONS is read by every GNU tar: an --exclude there would drop files from pack and unpack alike."""
    monkeypatch.setenv("TAR_OPTIONS", "--exclude=*.py --absolute-names")
    archive = envs.pack(small_env, tmp_path / "env.tar.zst")["archive"]
    done = envs.unpack(archive, tmp_path / "out" / "env", verify_imports=None)
    assert done["members_verified"] and (tmp_path / "out" / "env" / "pyvenv.cfg").is_file()
    assert {p.name for p in (tmp_path / "out" / "env").rglob("mod1*.py")} >= {"mod1.py", "mod1_hard.py"}


def test_tar_read_in_small_pieces_gives_the_same_member_list(small_env, tmp_path, monkeypatch):
    """GNU tar's stream reaches the kit in pieces of any size: headers, file data and the prefix scan of text files
    cut across pieces give the member list (hashes included) and prefix files of whole reads."""

    def trailer(path: Path) -> dict:
        with tarfile.open(path) as tar:
            return json.loads(tar.extractfile(tar.getmember(".kit-env-members.json")).read())

    whole = trailer(Path(envs.pack(small_env, tmp_path / "whole.tar")["archive"]))
    monkeypatch.setattr("kit.envs.archive.CHUNK", 700)
    pieces = trailer(Path(envs.pack(small_env, tmp_path / "pieces.tar")["archive"]))
    assert pieces == whole and len(whole["prefix_files"]) >= 3
    assert any(m[1] == "h" for m in whole["members"]) and any(m[2] > 1 << 20 for m in whole["members"])


def test_links_already_in_the_target_are_never_written_through(box):
    """A target that holds a link planted before unpacking: a member under it is refused, nothing lands outside."""
    root, target = box
    (target / "planted").symlink_to(root / "outside")
    path = _tar(root / "bad.tar", [("ok.txt", "file", "fine"), ("planted/evil.txt", "file", "x")])
    with pytest.raises(envs.EnvArchiveError, match="refusing"):
        envs.extract(path, target)
    _outside_unchanged(root)


def _header(
    name: str = "a.txt",
    size: int = 3,
    mode: int = 0o644,
    kind: bytes = tarfile.REGTYPE,
    raw: Optional[dict] = None,
) -> bytes:
    """A ustar header as Python's tarfile writes it, with fields replaced by `raw` bytes ({"size": b"..."}: the
    fields of POSIX ustar), and its checksum made valid again unless raw gives one."""
    raw = raw or {}
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type, info.mtime = size, mode, kind, 1_700_000_000
    hdr = bytearray(info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
    fields = {"name": (0, 100), "mode": (100, 8), "size": (124, 12), "chksum": (148, 8), "magic": (257, 8)}
    fields.update(typeflag=(156, 1), linkname=(157, 100), prefix=(345, 155))
    for key, value in raw.items():
        at, width = fields[key]
        assert len(value) == width, key
        hdr[at : at + width] = value
    if "chksum" not in raw:
        hdr[148:156] = b" " * 8
        hdr[148:156] = b"%06o\0 " % sum(hdr)
    return bytes(hdr)


def _stream(path: Path, *blocks: bytes) -> Path:
    path.write_bytes(b"".join(blocks) + bytes(1024))
    return path


def _data(text: bytes) -> bytes:
    return text + bytes(-len(text) % 512)


PLAIN_REFUSED = {
    "size with a leading NUL (tar skips it)": dict(size=b"\0" + b"%010o" % 3 + b"\0"),
    "mode with leading spaces": dict(mode=b"  00644\0"),
    "size in base-256": dict(size=b"\x80" + bytes(10) + b"\x03"),
    "GNU magic": dict(magic=b"ustar  \0"),
    "a link name on a file": dict(linkname=b"other".ljust(100, b"\0")),
    "bad checksum": dict(chksum=b"000001\0 "),
    "an 8 in an octal field": dict(size=b"00000000008\0"),
    "underscore (int() would take it)": dict(size=b"0000000_003\0"),
}


@pytest.mark.parametrize("case", sorted(PLAIN_REFUSED))
def test_odd_headers_unpack_as_tarfile_reads_them_or_are_refused_in_one_line(box, case):
    """tarfile reads the member list, GNU tar writes the files, and what lands must be that list: a header the two
    could read another way (a leading NUL, spaces, base-256, GNU magic) unpacks exactly as tarfile reads it, or
    is refused in one line with nothing left (a header tarfile stops at, with data after it, is no clean end).
    Positive control: the same member with tarfile's own header."""
    root, target = box
    for raw in ({}, PLAIN_REFUSED[case]):
        for p in target.iterdir():
            p.unlink()
        bad = _stream(root / "bad.tar", _header(raw=raw), _data(b"abc"))
        try:
            with tarfile.open(bad) as tar:
                want = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}
        except tarfile.TarError:
            want = None
        try:
            envs.extract(bad, target)
            got = {p.name: p.read_bytes() for p in target.iterdir()}
        except envs.EnvArchiveError as exc:
            assert "\n" not in str(exc) and "Traceback" not in str(exc)
            assert list(target.iterdir()) == []  # nothing of a refused archive is left
            got = None
        assert got in (None, want) and (raw or got == {"a.txt": b"abc"})
        _outside_unchanged(root)


@pytest.mark.parametrize(
    "name, kind, mode, size, lands",
    [
        ("setuid", tarfile.REGTYPE, 0o4755, 3, ("setuid", 0o100755)),
        ("no-owner-rwx", tarfile.DIRTYPE, 0o555, 0, ("no-owner-rwx", 0o40755)),
        ("dir-with-size", tarfile.DIRTYPE, 0o755, 3, None),  # its data would be read as the next header
        ("file-with-slash/", tarfile.REGTYPE, 0o644, 3, None),  # a file to tarfile, a folder to GNU tar
        ("./dot", tarfile.REGTYPE, 0o644, 3, ("dot", 0o100644)),
        (".hidden", tarfile.REGTYPE, 0o644, 3, (".hidden", 0o100644)),
        ("a//b", tarfile.REGTYPE, 0o644, 3, ("a/b", 0o100644)),
        ("back\\slash", tarfile.REGTYPE, 0o644, 3, ("back\\slash", 0o100644)),  # a plain name on Linux
        ("contiguous", tarfile.CONTTYPE, 0o644, 3, ("contiguous", 0o100644)),
        ("naïve", tarfile.REGTYPE, 0o644, 3, ("naïve", 0o100644)),
    ],
)
def test_members_the_kit_normalises(box, name, kind, mode, size, lands):
    """Special bits dropped, folders owner-writable, names cleaned; a folder with data is refused, and so is a
    member that tarfile and GNU tar read as different kinds; nothing of a refused archive is left."""
    root, target = box
    path = _stream(root / "bad.tar", _header(name, size, mode, kind), _data(b"abc")[: size and 512])
    if lands is None:
        with pytest.raises(envs.EnvArchiveError, match="corrupt|truncated"):
            envs.extract(path, target)
        assert list(target.iterdir()) == []
        return
    envs.extract(path, target)
    where, want_mode = lands
    assert (target / where).lstat().st_mode == want_mode
    assert kind == tarfile.DIRTYPE or (target / where).read_bytes() == b"abc"


def test_a_header_tar_reads_with_another_size_cannot_smuggle_a_member_past_the_checks(box):
    """A size field with a leading NUL: GNU tar skips the NUL and reads 512 bytes of data (list.c from_header),
    tarfile reads 0 and takes the next block as a header. The member list comes from tarfile's reading (three
    empty files), GNU tar writes `a.txt` holding the header tarfile checked and never writes `seen.txt`: the tree
    is not the list, so the archive is refused and nothing of it is left."""
    root, target = box
    hidden = _header("seen.txt", 0)
    smuggler = _header("a.txt", 0, raw={"size": b"\0" + b"%010o" % 512 + b"\0"})
    bad = _stream(root / "bad.tar", _header("first.txt", 0), smuggler, hidden)
    with tarfile.open(bad) as tar:
        assert [(m.name, m.size) for m in tar] == [("first.txt", 0), ("a.txt", 0), ("seen.txt", 0)]
    with pytest.raises(envs.ArchiveDamagedError, match="missing, the first 'seen.txt'"):
        envs.extract(bad, target)
    assert list(target.iterdir()) == []
    _outside_unchanged(root)


def test_zstd_streams_are_read_frame_after_frame_and_damage_is_refused(tmp_path):
    """The zstd reader on streams python-zstandard wrote: empty, zeros over several chunks, incompressible bytes,
    three frames one after another; a stream cut anywhere inside a frame, or with a changed byte, is an error."""
    import random

    import zstandard

    from kit.envs.extraction import CHUNK, _decompressed, is_stream_error

    noise = random.Random(7).randbytes(CHUNK * 5 // 2)
    pack = zstandard.ZstdCompressor(level=3, write_checksum=True).compress
    frames = [b"a" * 1000, noise[:70_000], bytes(CHUNK + 1)]
    cases = [([b""], pack(b"")), ([bytes(3 * CHUNK)], None), ([noise], None), (frames, None)]
    path = tmp_path / "x.zst"
    for parts, data in cases:
        path.write_bytes(data if data is not None else b"".join(pack(p) for p in parts))
        chunks = list(_decompressed(str(path)))
        assert b"".join(chunks) == b"".join(parts) and all(chunks)
    data = pack(noise)
    for cut in (5, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(envs.EnvArchiveError, match="truncated"):
            list(_decompressed(str(path)))
    changed = bytearray(data)
    changed[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(changed))
    with pytest.raises(Exception) as info:
        list(_decompressed(str(path)))
    assert is_stream_error(info.value)
