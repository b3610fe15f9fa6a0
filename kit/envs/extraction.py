"""Safe extraction, one path for every archive: GNU tar writes into an empty temporary folder, then the tree must
match a member list (type, size, hash, link target): a kit archive's last member, or for another tool's archive the
one tarfile reads from it first, member by member (tarfile extracts nothing: its 'data' filter is not used)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
import zlib
from typing import Callable, Iterator, Optional

from kit.envs.archive import ARCHIVE_VERSION, CHUNK, HASH, MANIFEST, TRAILER, new_hasher
from kit.envs.prefix import (
    ArchiveDamagedError,
    EnvArchiveError,
    gnu_program,
    helper_program,
    inside,
    special_file_error,
    walk_tree,
)
from kit.storage.atomic import current_umask

_END = bytes(512)  # tar's end-of-archive block


def _damaged(archive, what: str) -> ArchiveDamagedError:
    return ArchiveDamagedError(
        f"archive {str(archive)!r} is damaged or incomplete: {what}; copy it again from its source or "
        f"re-create it with `python -m kit env pack`."
    )


def detect(head: bytes) -> str:
    """The format the first bytes of an archive say (gzip's and zstd's magic numbers), else plain tar."""
    return "tar.gz" if head[:2] == b"\x1f\x8b" else "tar.zst" if head[:4] == b"\x28\xb5\x2f\xfd" else "tar"


def _decompressed(path: str, step: int = CHUNK) -> Iterator[bytes]:
    """The file's decompressed chunks, frame after frame (gzip members, zstd frames); raises when a stream stops
    inside a frame, where python-zstandard's stream_reader returns what it has (a cut archive reads shorter)."""
    with open(path, "rb") as raw:
        fmt = detect(raw.read(4))
        raw.seek(0)
        if fmt == "tar":
            yield from iter(lambda: raw.read(step), b"")
            return
        if fmt == "tar.zst":
            import zstandard

            new = zstandard.ZstdDecompressor().decompressobj
        else:
            new = functools.partial(zlib.decompressobj, wbits=31)
        dobj, started = new(), False
        for data in iter(lambda: raw.read(step), b""):
            while data:
                out, started = dobj.decompress(data), True
                if out:
                    yield out
                data = b""
                if dobj.eof:  # a frame ended; what follows is the next one
                    data, dobj, started = dobj.unused_data, new(), False
        if started and not dobj.eof:
            raise _damaged(path, f"its {fmt[4:]} stream stops in the middle (truncated)")


class Stream:
    """The decompressed tar as a file tarfile reads (seeks only forward). `last`, the latest read, tells tar's
    end-of-archive block (tarfile reads each header as one 512-byte read) from a stream that just stops."""

    def __init__(self, path: str, step: int = CHUNK):
        self._chunks = _decompressed(path, step)
        self._buf, self._pos, self._start = b"", 0, 0  # _start: the stream offset of _buf[0]
        self.last = b""

    def read(self, n: int) -> bytes:  # tarfile always asks for a size
        while len(self._buf) - self._pos < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            self._start += self._pos
            self._buf, self._pos = self._buf[self._pos :] + chunk, 0
        data = self._buf[self._pos : self._pos + n]
        self._pos += len(data)
        self.last = data
        return data

    def tell(self) -> int:
        return self._start + self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0 or pos < self.tell():
            raise io.UnsupportedOperation("an archive stream only seeks forward")
        while self.tell() < pos and self.read(min(pos - self.tell(), CHUNK)):
            pass
        return self.tell()

    def drain(self) -> None:
        """Read to the end, so that a compressed stream cut short or failing its checksum there is reported."""
        for _ in self._chunks:
            pass

    def close(self) -> None:
        self._chunks.close()  # closes the file


@contextlib.contextmanager
def damage_named(path) -> Iterator[None]:
    """A damaged stream's error (see is_stream_error) raised as one ArchiveDamagedError that names `path`."""
    try:
        yield
    except Exception as exc:
        if not is_stream_error(exc):
            raise
        raise _damaged(path, f"corrupt, truncated or not a tar archive ({exc})") from exc


def is_stream_error(exc: BaseException) -> bool:
    """Errors of tarfile and the decompressors on a damaged stream (tarfile.TarError, zstandard.ZstdError, ...)."""
    return isinstance(exc, (tarfile.TarError, zlib.error, EOFError, UnicodeDecodeError)) or type(
        exc
    ).__module__.startswith("zstandard")


def json_member(data: bytes, what: str, path) -> dict:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _damaged(path, f"its {what} is not valid JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise _damaged(path, f"its {what} is not a JSON object")
    return obj


def read_archive_manifest(path: os.PathLike | str) -> Optional[dict]:
    """What a kit archive is (its first member: kind, name, old prefix, ...), or None for other archives.
    Reads only the start of the archive."""
    with damage_named(path), contextlib.closing(Stream(str(path), 64 << 10)) as stream:
        tar = tarfile.open(fileobj=stream, mode="r:")
        first = tar.next()
        if first is None or first.name != MANIFEST or not first.isreg():
            return None
        return json_member(tar.extractfile(first).read(), MANIFEST, path)


def _clean_name(name: str) -> str:
    """Normalise a member name as GNU tar does (`./` and `//` dropped); raise on absolute names and `..` parts."""
    if not name.startswith("/") and "/." not in "/" + name and "//" not in name:
        return name.rstrip("/")  # the common case: nothing to normalise
    if name.startswith("/"):
        raise _refused(name, "has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _refused(name, "contains '..', a way out of the target")
    return "/".join(parts)


_KINDS = {"d": "folder", "f": "file", "l": "symbolic link", "h": "hard link"}


def _refused(name: str, why: str) -> EnvArchiveError:
    return EnvArchiveError(f"archive member {name!r} {why}; refusing to extract it.")


def _listed(archive, hash_name: str) -> list:
    """The member list of another tool's archive as tarfile reads it, each member checked, each file hashed;
    what GNU tar then extracts must be this list, so a header it reads another way is refused."""
    rows: dict = {}
    with damage_named(archive), contextlib.closing(Stream(str(archive))) as stream:
        tar = tarfile.open(fileobj=stream, mode="r:")
        for m in iter(tar.next, None):
            _list_member(tar, m, rows, hash_name)
        ended = stream.last == _END
        stream.drain()
    if not ended:
        files = sum(r[1] == "f" for r in rows.values())
        raise _damaged(archive, f"it has no end-of-archive block after its {files} files (truncated)")
    return list(rows.values())


def _list_member(tar: tarfile.TarFile, m: tarfile.TarInfo, rows: dict, hash_name: str) -> None:
    """Check member `m` against those before it and add its row [name, kind, size, hash or link] to `rows`."""
    name = _clean_name(m.name)
    if not name:
        return
    parts = name.split("/")
    for i in range(1, len(parts)):
        up = rows.get("/".join(parts[:i]))
        if up is not None and up[1] != "d":
            raise _refused(name, f"goes through {up[0]!r}, a {_KINDS[up[1]]} of the same archive")
    old = rows.get(name)
    if old is not None and (old[1] == "l" or (old[1] == "d") != m.isdir()):
        raise _refused(name, f"comes after a {_KINDS[old[1]]} of the same name")
    if m.isdir():
        rows[name] = [name, "d", 0, ""]
    elif m.isreg():
        h, src = new_hasher(hash_name), tar.extractfile(m)
        for data in iter(lambda: src.read(CHUNK), b""):
            h.update(data)
        rows[name] = [name, "f", m.size, h.hexdigest()]
    elif m.issym():
        if os.path.isabs(m.linkname):
            raise _refused(m.name, f"is a link to the absolute path {m.linkname!r}")
        if not inside("/r", os.path.normpath(os.path.join("/r", os.path.dirname(name), m.linkname))):
            raise _refused(m.name, f"links to {m.linkname!r}, outside the target")
        rows[name] = [name, "l", 0, m.linkname]
    elif m.islnk():
        other = _clean_name(m.linkname)
        if rows.get(other, [0, ""])[1] != "f":
            raise _refused(m.name, f"is a hard link to {m.linkname!r}, not to a file extracted before it")
        rows[name] = [name, "h", 0, other]
    else:
        raise special_file_error(f"archive member {m.name!r}", "refusing to extract it", EnvArchiveError)


def _with_gnu_tar(exe: str, archive, root: str, progress) -> int:
    """GNU tar extracts (no owners, no setuid/setgid, no device files, folder modes at the end), running
    `zstd` / `gzip` where installed, else fed from here; progress(n) gets the bytes tar wrote (returned)."""
    archive = os.path.abspath(archive)
    with open(archive, "rb") as fh:
        program = {"tar.zst": "zstd", "tar.gz": "gzip", "tar": ""}[detect(fh.read(4))]
    fed = bool(program) and shutil.which(program) is None
    source = ["-f", "-"] if fed else ["--force-local", "-f", archive] + (["-I", program] if program else [])
    cmd = [exe, "-x", *source, "-C", root, "--no-same-owner", "--no-same-permissions"]
    cmd += ["--delay-directory-restore", "-b", "512"]  # 256 KiB records, not 10 KiB
    hint = "the archive is truncated, corrupt or unsafe: copy it again or re-create it (`python -m kit env pack`)"
    with helper_program(
        cmd,
        f"unpacking {archive}",
        ArchiveDamagedError,
        hint,
        extracting=True,
        stdin=subprocess.PIPE if fed else subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=dict(os.environ, LC_ALL="C"),  # its messages in English, so a full disk is recognised
    ) as proc:
        if not fed:
            return _follow(proc, progress)
        shown = 0
        with damage_named(archive), contextlib.suppress(BrokenPipeError):  # until tar stops (it says why)
            for chunk in _decompressed(archive):
                proc.stdin.write(chunk)
                progress(len(chunk))
                shown += len(chunk)
            proc.stdin.close()
    return shown


def _follow(proc: subprocess.Popen, progress) -> int:
    """Wait for tar, passing the bytes it has written so far to progress() 4 times a second (Linux's
    /proc/PID/io; elsewhere nothing); return their sum. It looks every 5 ms whether tar has ended: Popen.wait
    with a timeout notices up to 50 ms late, 5-10 % of unpacking an env that takes tar half a second."""
    done = 0
    while True:
        for _ in range(50):
            if proc.poll() is not None:
                return done
            time.sleep(0.005)
        with contextlib.suppress(OSError, ValueError, StopIteration):
            with open(f"/proc/{proc.pid}/io") as fh:
                written = int(next(line for line in fh if line.startswith("wchar:")).split()[1])
            progress(written - done)
            done = written


def _hash(path: str, hash_name: str) -> tuple:
    """(size, hash) of the file at `path`, read in big pieces (a small file in one)."""
    h = new_hasher(hash_name)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        size = left = os.fstat(fd).st_size
        while left > 0:
            data = os.read(fd, min(left, 4 * CHUNK))
            if not data:
                break
            h.update(data)
            left -= len(data)
    finally:
        os.close(fd)
    return size - left, h.hexdigest()


def _check_tree(archive, root: str, members, hash_name: str) -> dict:
    """The tree under `root` must be the member list (types, sizes, hashes, link targets; nothing else but the
    folders that hold them); folders become owner-writable, those tar made unlisted get the usual mode."""
    found = dict(walk_tree(root))
    for name, e in found.items():
        if e.is_symlink():  # a chain of links can climb out although each looks inside (a -> ., b -> a/..)
            if os.path.isabs(os.readlink(e.path)) or not inside(root, os.path.realpath(e.path)):
                raise EnvArchiveError(
                    f"link {name!r} -> {os.readlink(e.path)!r} leads outside the target; refusing the archive."
                )
        elif not (e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False)):
            raise special_file_error(f"archive member {name!r}", "refusing the archive", EnvArchiveError)
    if not isinstance(members, list) or not all(isinstance(m, list) and len(m) == 4 for m in members):
        raise _damaged(archive, "its member list is not a list of [name, type, size, hash or link]")
    missing = [m[0] for m in members if m[0] not in found]
    if missing:
        raise _damaged(archive, f"{len(missing)} member(s) are missing, the first {missing[0]!r}")
    counts = {"files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0, "bytes": 0}
    files: dict = {}
    for name, kind, size, extra in members:
        e = found.pop(name, None)
        if e is None:
            raise _damaged(archive, f"member {name!r} is listed twice")
        if kind == "d" and e.is_dir(follow_symlinks=False):
            mode = e.stat(follow_symlinks=False).st_mode
            if mode & 0o700 != 0o700:
                os.chmod(e.path, stat.S_IMODE(mode) | 0o700)
            counts["dirs"] += 1
        elif kind == "f" and e.is_file(follow_symlinks=False):
            got, digest = _hash(e.path, hash_name)
            if got != size:
                raise _damaged(archive, f"member {name!r} has {got} bytes where the member list has {size}")
            if digest != extra:
                raise _damaged(archive, f"member {name!r} differs from its hash (damaged data)")
            files[name] = e.inode()
            counts["files"] += 1
            counts["bytes"] += size
        elif kind == "l" and e.is_symlink() and os.readlink(e.path) == extra:
            counts["symlinks"] += 1
        elif kind == "h" and e.is_file(follow_symlinks=False) and files.get(extra) == e.inode():
            counts["hardlinks"] += 1
        else:
            raise _damaged(archive, f"member {name!r} is not the {kind!r} member the member list describes")
    extra = [name for name, e in found.items() if not e.is_dir(follow_symlinks=False)]
    if extra:
        raise _damaged(archive, f"{len(extra)} member(s) are not in the member list, e.g. {extra[0]!r}")
    mode = 0o777 & ~current_umask()  # tar ran with umask 0
    for e in found.values():
        if stat.S_IMODE(e.stat(follow_symlinks=False).st_mode) != mode:
            os.chmod(e.path, mode)
    return counts


def _take_json(archive, root: str, what: str) -> Optional[dict]:
    """The JSON object in the regular file `what` at the top of `root` (removed after reading), or None."""
    path = os.path.join(root, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO: no wait
    except OSError:  # absent, or a link
        return None
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = fh.read()
    os.unlink(path)
    return json_member(data, what, archive)


def extract(
    archive: os.PathLike | str, target: os.PathLike | str, progress: Optional[Callable[[int], None]] = None
) -> tuple:
    """Extract into the existing folder `target`; return (counts, manifest or None). GNU tar writes into a
    temporary folder, whose tree must match the member list; only then do its entries move into `target`,
    which must not hold any of their names. progress(n) gets the bytes extracted."""
    root, progress = os.path.realpath(target), progress or (lambda n: None)
    head = read_archive_manifest(archive)
    if head is not None:
        if int(head.get("kit_archive", 0)) > ARCHIVE_VERSION:
            raise EnvArchiveError(
                f"archive {str(archive)!r} was written by a newer kit (format {head['kit_archive']}); update "
                f"the kit to unpack it."
            )
        new_hasher(head.get("hash"))  # an unknown hash: one clear line before any write
    exe = gnu_program("tar")
    if exe is None:
        raise EnvArchiveError("GNU tar is needed to unpack archives: install it (apt-get install tar).")
    hash_name = head["hash"] if head is not None else HASH
    members = _listed(archive, hash_name) if head is None else None  # a kit archive's: its last member
    tmp = tempfile.mkdtemp(prefix=".kit-extract-", dir=root)  # tar follows links it finds: only in its own
    try:
        shown = _with_gnu_tar(exe, archive, tmp, progress)
        os.chmod(tmp, 0o700)  # an archived `.` gave it its mode: its entries must still move out
        manifest = _take_json(archive, tmp, MANIFEST)  # a kit archive's was read from the stream before
        if head is not None:
            trailer = _take_json(archive, tmp, TRAILER)
            if trailer is None:
                raise _damaged(archive, "it stops before its member list")
            members = trailer.pop("members", None)
            manifest = dict(head, **trailer)
        counts = _check_tree(archive, tmp, members, hash_name)
        progress(max(0, counts["bytes"] - shown))  # the rest (tar wrote faster than it was polled)
        names = os.listdir(tmp)
        clash = next((n for n in names if os.path.lexists(os.path.join(root, n))), None)
        if clash is not None:
            raise EnvArchiveError(
                f"target {root!r} already holds {clash!r}, which the archive has too; refusing to extract into "
                f"it: extract into an empty folder."
            )
        for name in names:
            os.rename(os.path.join(tmp, name), os.path.join(root, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return counts, manifest
