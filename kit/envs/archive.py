"""Env archives: tarfile (GNU format, as `tar -c` writes) compressed by python-zstandard on every core, or gzip.
Hand-written here only what buys safety: a manifest read first and a member list with sizes and hashes last.

Layout of an archive the kit writes (any tar reads it):
  1. `.kit-env.json`          what it is (kit_archive=2, kind, name, old prefix, hash algorithm): read first;
  2. the env's members         folders, files, links, in walk order;
  3. `.kit-env-members.json`  every member as [name, type, size, hash or link target], and the prefix fixes.
A copy cut anywhere (even exactly between two members, where a tar reader sees a clean end) lacks the member list
or some of its members, so unpacking refuses it (kit/envs/extraction.py).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import stat
import tarfile
import threading
import zlib
from typing import IO, Iterator, Optional

from kit.envs.errors import ArchiveDamagedError, EnvArchiveError, EnvError
from kit.envs.prefix import changed_error, read_whole, scan_prefix

FORMATS = ("tar.zst", "tar.gz", "tar")
MANIFEST = ".kit-env.json"
TRAILER = ".kit-env-members.json"
ARCHIVE_VERSION = 2
LEVELS = {"tar.zst": (1, 19), "tar.gz": (1, 9)}  # zstd 20-22 need ~GBs of memory to unpack; gzip stops at 9
SMALL = 2 << 20  # files up to this size are read whole (and scanned for the old prefix)
CHUNK = 1 << 20
_SUFFIXES = {".tar.zst": "tar.zst", ".tzst": "tar.zst", ".tar.gz": "tar.gz", ".tgz": "tar.gz", ".tar": "tar"}
__all__ = ["ArchiveDamagedError", "EnvArchiveError", "FORMATS", "MANIFEST", "TRAILER"]


def n_threads(threads: int) -> int:
    """0 or -1 means every core; otherwise the number given (at least 1)."""
    return (os.cpu_count() or 1) if threads in (0, -1) else max(1, int(threads))


def check_level(fmt: str, level: int) -> int:
    """`level` if it is valid for `fmt` (plain tar has none), else EnvError naming the allowed range."""
    low, high = LEVELS.get(fmt, (None, None))
    if low is not None and not (isinstance(level, int) and low <= level <= high):
        raise EnvError(
            f"compression level {level!r} is outside {low}..{high} for {fmt}; pass --level between "
            f"{low} and {high} (3 is fast and small enough for envs)."
        )
    return level


def suffix_format(path: os.PathLike | str) -> Optional[str]:
    """The format a file name announces ('x.tar.zst' -> 'tar.zst'; .tgz/.tzst accepted), or None."""
    return next((fmt for suffix, fmt in _SUFFIXES.items() if str(path).endswith(suffix)), None)


def format_of(path: os.PathLike | str) -> str:
    """The archive format from the file name; EnvArchiveError when the name has no known suffix."""
    fmt = suffix_format(path)
    if fmt is None:
        raise EnvArchiveError(
            f"archive name {str(path)!r} has no known suffix; use one of "
            f"{', '.join('.' + f for f in FORMATS)} (or .tgz / .tzst)."
        )
    return fmt


def default_hash() -> str:
    """xxh3_64 (hashing stays off the critical path), else crc32 where xxhash is not installed."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64"


class _Crc32:
    """zlib.crc32 behind the hashlib interface."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(name: str):
    """A fresh hasher for the algorithm an archive names; EnvArchiveError when it is not available here."""
    if name == "crc32":
        return _Crc32()
    if name != "xxh3_64":
        raise EnvArchiveError(f"archive member hash {name!r} is not one the kit knows (xxh3_64, crc32).")
    try:
        import xxhash
    except ImportError as exc:
        raise EnvArchiveError(
            "this archive's member hashes are xxh3_64; install xxhash (`pip install xxhash`) to unpack it."
        ) from exc
    return xxhash.xxh3_64()


def json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


class _Plain:
    def __init__(self, fileobj: IO[bytes]):
        self.write, self.tell, self.close = fileobj.write, fileobj.tell, fileobj.flush


def compressed_writer(fileobj: IO[bytes], fmt: str, level: int = 3, threads: int = 0):
    """Wrap `fileobj` in the compressor for `fmt`; the caller closes the wrapper, then the file."""
    if fmt in LEVELS:
        check_level(fmt, level)
    if fmt == "tar.zst":  # each frame carries a checksum zstd checks on unpack; close() ends the frame
        import zstandard

        threads = n_threads(threads)
        cctx = zstandard.ZstdCompressor(
            level=level, threads=threads if threads > 1 else 0, write_checksum=True
        )
        return cctx.stream_writer(fileobj, closefd=False)
    if (
        fmt == "tar.gz" and n_threads(threads) > 1
    ):  # gzip members compressed on a thread pool; gunzip reads it
        from conda_pack.formats import ParallelGzipFileWriter

        return ParallelGzipFileWriter(fileobj, compresslevel=level, n_threads=n_threads(threads))
    if fmt == "tar.gz":
        return gzip.GzipFile(fileobj=fileobj, mode="wb", compresslevel=level)
    if fmt == "tar":
        return _Plain(fileobj)
    raise EnvArchiveError(f"archive format {fmt!r} is not one of {', '.join(FORMATS)}.")


class EarlyWriteback:
    """File wrapper that has the kernel write the archive to disk while packing goes on (fdatasync on a helper
    thread every 32 MiB), so the fsync before the final rename (kit/atomic.py) has only the last piece to write."""

    def __init__(self, fh, step: int = 32 << 20):
        self._fh, self._step, self._since = fh, step, 0
        self.fileno, self.flush, self.tell = fh.fileno, fh.flush, fh.tell
        self._wake, self._done, self._error = threading.Event(), False, None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kit-writeback")
        self._thread.start()

    def _run(self) -> None:
        while not self._done:
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            try:
                os.fdatasync(self._fh.fileno())
            except OSError as exc:  # reported by close(); the final fsync would meet the same error
                self._error = exc
                return

    def write(self, data) -> int:
        n = self._fh.write(data)
        self._since += len(data)
        if self._since >= self._step:
            self._since = 0
            self._fh.flush()
            self._wake.set()
        return n

    def close(self) -> None:
        self._done = True
        self._wake.set()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Hashed:
    """A big file read by tarfile in pieces, hashed on the way; a file that shrank since its stat is an error."""

    def __init__(self, fh, hasher, path: str, size: int):
        self._fh, self._hasher, self._path, self._size, self._got = fh, hasher, path, size, 0

    def read(self, n: int) -> bytes:
        data = self._fh.read(n)
        if not data and self._got < self._size:
            raise changed_error(self._path, self._size, self._got, "packed")
        self._got += len(data)
        self._hasher.update(data)
        return data


class ArchiveWriter:
    """tarfile writing into `out` (a compressor), recording [name, type, size, hash|link] for every member."""

    def __init__(self, out, hash_name: Optional[str] = None, scan: Optional[bytes] = None, mtime=None):
        self.tar = tarfile.open(fileobj=out, mode="w:", format=tarfile.GNU_FORMAT, copybufsize=CHUNK)
        self.hash_name = hash_name or default_hash()
        self.scan = scan  # text files that hold these bytes (the old prefix) are listed in prefix_files
        self.mtime = mtime
        self.members: list = []
        self.prefix_files: list = []
        self.bytes = 0
        self._inodes: dict = {}

    def _info(
        self, name: str, kind: bytes, st=None, mode=None, size: int = 0, link: str = ""
    ) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.size, info.linkname = kind, size, link
        if st is not None:
            info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
            info.uid, info.gid = st.st_uid, st.st_gid
        else:
            info.mode, info.mtime = 0o644, int(self.mtime or 0)
        if mode is not None:
            info.mode = mode
        return info

    def add_bytes(self, name: str, data: bytes, mode: int = 0o644, st=None, record: bool = True) -> None:
        self.tar.addfile(self._info(name, tarfile.REGTYPE, st, mode, len(data)), io.BytesIO(data))
        if record:
            h = new_hasher(self.hash_name)
            h.update(data)
            self._file(name, len(data), h.hexdigest())

    def _file(self, name: str, size: int, digest: str) -> None:
        self.members.append([name, "f", size, digest])
        self.bytes += size

    def add_path(self, path: str, name: str, st=None) -> None:
        """Add the file, folder or link at `path` (links not followed) under the member name `name`."""
        st = st or os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            self.tar.addfile(self._info(name, tarfile.DIRTYPE, st))
            self.members.append([name, "d", 0, ""])
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            self.tar.addfile(self._info(name, tarfile.SYMTYPE, st, link=target))
            self.members.append([name, "l", 0, target])
        elif stat.S_ISREG(st.st_mode):
            first = self._inodes.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
            if first is not None:
                self.tar.addfile(self._info(name, tarfile.LNKTYPE, st, link=first))
                self.members.append([name, "h", 0, first])
                return
            if st.st_nlink > 1:
                self._inodes[(st.st_dev, st.st_ino)] = name
            self._add_file(path, name, st)
        else:
            raise EnvArchiveError(
                f"{path} is a device, socket or FIFO; environments never hold those, remove it and pack again."
            )

    def _add_file(self, path: str, name: str, st) -> None:
        info = self._info(name, tarfile.REGTYPE, st, size=st.st_size)
        h = new_hasher(self.hash_name)
        if st.st_size > SMALL:
            with open(path, "rb") as fh:
                self.tar.addfile(info, _Hashed(fh, h, path, st.st_size))
        else:
            data = read_whole(path, st, "packed")
            h.update(data)
            if self.scan and scan_prefix(data, self.scan):  # text that holds the old prefix
                self.prefix_files.append(name)
            self.tar.addfile(info, io.BytesIO(data))
        self._file(name, st.st_size, h.hexdigest())

    def add_entries(self, entries, skip=(), progress=None) -> None:
        """add_path() for every (name, path, lstat) of scan_tree() not in `skip`; progress(1) per file or link."""
        for name, path, st in entries:
            if progress and not stat.S_ISDIR(st.st_mode):
                progress(1)
            if name not in skip:
                self.add_path(path, name, st)

    def finish(self, extra: dict) -> None:
        """Write the member list (with `extra`, e.g. prefix fixes) and tar's end-of-archive blocks."""
        trailer = dict(extra, members=self.members, hash=self.hash_name, prefix_files=self.prefix_files)
        self.add_bytes(TRAILER, json_bytes(trailer), record=False)
        self.tar.close()  # the end-of-archive blocks; `out` stays open


@contextlib.contextmanager
def archive_writer(
    raw: IO[bytes], fmt: str, level: int, threads: int, head: dict, **kw
) -> Iterator[ArchiveWriter]:
    """An ArchiveWriter into the open file `raw` that has written `head` (+ kit_archive, hash) as the first
    member; the caller adds the members and calls finish()."""
    comp = compressed_writer(raw, fmt, level, threads)
    try:
        writer = ArchiveWriter(comp, **kw)
        head = dict(head, kit_archive=ARCHIVE_VERSION, hash=writer.hash_name)
        writer.add_bytes(MANIFEST, json_bytes(head), record=False)
        yield writer
    finally:
        comp.close()


# ---------------------------------------------------------------- reading


def detect(head: bytes) -> str:
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "tar.zst"
    return "tar"


def _decompressed(path: str, step: int = CHUNK) -> Iterator[bytes]:
    """The file's decompressed chunks, frame after frame (gzip members, zstd frames); raises when a stream stops
    inside a frame (python-zstandard's stream_reader returns what it has without an error: a cut archive would
    read as a shorter one)."""
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

            def new():
                return zlib.decompressobj(wbits=31)

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
            raise ArchiveDamagedError(
                f"archive {path!r} is truncated: its {fmt[4:]} stream stops in the middle; copy it again "
                f"(compare its size with the original) or re-create it with `python -m kit env pack`."
            )


class Stream:
    """The decompressed tar as the file tarfile reads: read, tell, and seek forward (by reading on). `last` is
    what the latest read returned: tarfile reads each header as one 512-byte read, so after it stops, `last`
    tells tar's end-of-archive block (zeros) from a stream that just stops."""

    def __init__(self, path: str, step: int = CHUNK):
        self._chunks = _decompressed(path, step)
        self._buf, self._pos, self._start = b"", 0, 0  # _start: the stream offset of _buf[0]
        self.last = b""

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            return b"".join(iter(lambda: self.read(CHUNK), b""))
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
        raise ArchiveDamagedError(
            f"archive {str(path)!r} is corrupt, truncated or not a tar archive ({exc}); "
            f"re-create it with `python -m kit env pack` (or kit.envs.pack)."
        ) from exc


def is_stream_error(exc: BaseException) -> bool:
    """Errors of tarfile and the decompressors on a damaged stream (tarfile.TarError, zstandard.ZstdError, ...)."""
    return isinstance(exc, (tarfile.TarError, zlib.error, EOFError, UnicodeDecodeError)) or type(
        exc
    ).__module__.startswith("zstandard")


def json_member(data: bytes, what: str, path) -> dict:
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ArchiveDamagedError(
            f"archive {str(path)!r}: its {what} is not valid JSON ({exc}); the archive is damaged or was "
            f"edited; re-create it with `python -m kit env pack`."
        ) from exc
    if not isinstance(obj, dict):
        raise ArchiveDamagedError(f"archive {str(path)!r}: its {what} is not a JSON object; re-create it.")
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
