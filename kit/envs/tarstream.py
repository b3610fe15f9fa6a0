"""Streaming tar for env archives: a writer that records every member with its size and hash, and a reader
that parses the stream (decompressed on a thread of its own) so unpacking can check each member as it lands.

Layout of an archive the kit writes (POSIX pax tar, readable by any tar):
  1. `.kit-env.json`          what it is (kit_archive=2, kind, name, old prefix, hash algorithm): read first;
  2. the env's members         directories, files, links, in walk order;
  3. `.kit-env-members.json`  every member as [name, type, size, hash or link target], and the prefix fixes.
A copy that stops anywhere (even exactly between two members, where a tar reader sees a clean end) lacks
the member list or some of its members, so unpacking refuses it instead of leaving a partial env.
"""

from __future__ import annotations

import json
import os
import queue
import stat
import tarfile
import threading
import zlib
from typing import Callable, Iterator, Optional

from kit.envs.errors import ArchiveDamagedError, EnvArchiveError

HEAD = ".kit-env.json"
TRAILER = ".kit-env-members.json"
ARCHIVE_VERSION = 2
BLOCK = 512
_ZERO = bytes(BLOCK)
_READ = 1 << 20  # compressed bytes read per step
_FLUSH = 4 << 20  # small members are gathered up to this size before one write to the compressor
SMALL = 2 << 20  # files up to this size are read whole (and scanned for the old prefix)


class _Crc32:
    """zlib.crc32 behind the hashlib interface (the fallback when xxhash is not installed)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def default_hash() -> str:
    """xxh3_64 (about 5x faster than crc32 here, so hashing stays off the critical path), else crc32."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64"


def new_hasher(name: str):
    """A fresh hasher for the algorithm an archive names; EnvArchiveError when it is not available here."""
    if name == "crc32":
        return _Crc32()
    if name == "xxh3_64":
        try:
            import xxhash
        except ImportError as exc:
            raise EnvArchiveError(
                "this archive's member hashes are xxh3_64; install xxhash (`pip install xxhash`) to unpack it."
            ) from exc
        return xxhash.xxh3_64()
    raise EnvArchiveError(f"archive member hash {name!r} is not one the kit knows (xxh3_64, crc32).")


def json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=None, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


class TarWriter:
    """Write tar members to `out` (anything with write()), recording [name, type, size, hash|link] for each."""

    def __init__(self, out, hash_name: Optional[str] = None, scan: Optional[bytes] = None, mtime=None):
        self.out = out
        self.hash_name = hash_name or default_hash()
        self.scan = scan  # files that hold these bytes (the old prefix) are listed in prefix_files
        self.mtime = mtime
        self.members: list = []
        self.prefix_files: list = []
        self.bytes = 0
        self._buf = bytearray()
        self._inodes: dict = {}
        self._names: dict = {}

    # -- low level
    def _emit(self, data) -> None:
        self._buf += data
        if len(self._buf) >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self.out.write(self._buf)
            self._buf = bytearray()

    def _owner(self, uid: int, gid: int) -> tuple:
        key = (uid, gid)
        if key not in self._names:
            import grp
            import pwd

            try:
                user = pwd.getpwuid(uid).pw_name
            except KeyError:
                user = ""
            try:
                group = grp.getgrgid(gid).gr_name
            except KeyError:
                group = ""
            self._names[key] = (user, group)
        return self._names[key]

    def _header(self, name: str, kind: bytes, st=None, size: int = 0, linkname: str = "", mode=None) -> bytes:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.size = size
        info.linkname = linkname
        if st is not None:
            info.mode = stat.S_IMODE(st.st_mode)
            info.uid, info.gid = st.st_uid, st.st_gid
            info.uname, info.gname = self._owner(st.st_uid, st.st_gid)
            info.mtime = int(st.st_mtime)
        else:
            info.mode = 0o644
            info.mtime = int(self.mtime or 0)
        if mode is not None:
            info.mode = mode
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def _pad(self, size: int) -> None:
        if size % BLOCK:
            self._emit(_ZERO[: BLOCK - size % BLOCK])

    # -- members
    def add_bytes(self, name: str, data: bytes, mode: int = 0o644, st=None, record: bool = True) -> None:
        self._emit(self._header(name, tarfile.REGTYPE, st, len(data), mode=mode))
        self._emit(data)
        self._pad(len(data))
        if record:
            h = new_hasher(self.hash_name)
            h.update(data)
            self.members.append([name, "f", len(data), h.hexdigest()])
            self.bytes += len(data)

    def add_path(self, path: str, name: str, st=None) -> None:
        """Add the file, folder or link at `path` (links not followed) under the member name `name`."""
        st = st or os.lstat(path)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            self._emit(self._header(name, tarfile.DIRTYPE, st))
            self.members.append([name, "d", 0, ""])
        elif stat.S_ISLNK(mode):
            target = os.readlink(path)
            self._emit(self._header(name, tarfile.SYMTYPE, st, linkname=target))
            self.members.append([name, "l", 0, target])
        elif stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in self._inodes:
                first = self._inodes[key]
                self._emit(self._header(name, tarfile.LNKTYPE, st, linkname=first))
                self.members.append([name, "h", 0, first])
                return
            if st.st_nlink > 1:
                self._inodes[key] = name
            self._add_file(path, name, st)
        else:
            raise EnvArchiveError(
                f"{path} is a device, socket or FIFO; environments never hold those, remove it and pack again."
            )

    def _add_file(self, path: str, name: str, st) -> None:
        h = new_hasher(self.hash_name)
        if st.st_size <= SMALL:
            with open(path, "rb") as fh:
                data = fh.read()
            if self.scan and self.scan in data and b"\0" not in data[:8192]:
                self.prefix_files.append(name)
            self._emit(self._header(name, tarfile.REGTYPE, st, len(data)))
            self._emit(data)
            self._pad(len(data))
            h.update(data)
            size = len(data)
        else:
            self._emit(self._header(name, tarfile.REGTYPE, st, st.st_size))
            self.flush()
            size = 0
            buf = bytearray(_FLUSH)
            view = memoryview(buf)
            with open(path, "rb", buffering=0) as fh:
                while size < st.st_size:
                    n = fh.readinto(view[: min(_FLUSH, st.st_size - size)])
                    if not n:
                        break
                    h.update(view[:n])
                    self.out.write(view[:n])
                    size += n
            if size != st.st_size:
                raise EnvArchiveError(
                    f"{path} changed size while it was packed ({st.st_size} -> {size} bytes); stop what writes "
                    f"to the env and pack again."
                )
            self._pad(size)
        self.members.append([name, "f", size, h.hexdigest()])
        self.bytes += size

    def finish(self, extra: dict) -> None:
        """Write the member list (with `extra`, e.g. prefix fixes) and the end-of-archive blocks."""
        trailer = dict(extra, members=self.members, hash=self.hash_name, prefix_files=self.prefix_files)
        self.add_bytes(TRAILER, json_bytes(trailer), record=False)
        self._emit(_ZERO * 2)
        self.flush()


# ---------------------------------------------------------------- reading


def detect(head: bytes) -> str:
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "tar.zst"
    return "tar"


def _decompressed(path: str, fmt: str) -> Iterator[bytes]:
    """Decompressed chunks of the file; raises when the compressed stream is cut short or damaged."""
    if fmt == "tar.zst":
        import zstandard

        dctx = zstandard.ZstdDecompressor()
        new = dctx.decompressobj
    elif fmt == "tar.gz":

        def new():
            return zlib.decompressobj(wbits=31)

    with open(path, "rb", buffering=0) as raw:
        if fmt == "tar":
            while True:
                data = raw.read(_READ)
                if not data:
                    return
                yield data
        dobj, started = new(), False
        while True:
            data = raw.read(_READ)
            if not data:
                break
            while data:
                out = dobj.decompress(data)
                started = True
                if out:
                    yield out
                if dobj.eof:  # a frame / gzip member ended; what follows is the next one
                    data = dobj.unused_data
                    dobj, started = new(), False
                else:
                    data = b""
        if started and not dobj.eof:
            raise ArchiveDamagedError(
                f"archive {path!r} is truncated: its {fmt.split('.')[-1]} stream stops in the middle; "
                f"copy it again (compare its size with the original) or re-create it with `python -m kit env pack`."
            )


class _Chunks:
    """Decompress on a background thread (zstd and zlib release the GIL) while the caller writes files."""

    def __init__(self, path: str, fmt: str, depth: int = 8):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(path, fmt), daemon=True, name="kit-unpack-read"
        )
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, path: str, fmt: str) -> None:
        try:
            for chunk in _decompressed(path, fmt):
                if not self._put(chunk):
                    return
            self._put(None)
        except BaseException as exc:  # handed to the reading thread, which raises it
            self._put(exc)

    def __iter__(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class _Stream:
    """Exact reads and zero-copy data spans over a sequence of chunks."""

    def __init__(self, chunks):
        self._it = iter(chunks)
        self._view = memoryview(b"")
        self._pos = 0
        self.offset = 0

    def _fill(self) -> bool:
        for chunk in self._it:
            if chunk:
                self._view, self._pos = memoryview(chunk), 0
                return True
        return False

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            if self._pos >= len(self._view) and not self._fill():
                break
            take = min(n - len(out), len(self._view) - self._pos)
            piece = self._view[self._pos : self._pos + take]
            out = bytes(piece) if not out else out + piece
            self._pos += take
        self.offset += len(out)
        return out

    def spans(self, n: int) -> Iterator[memoryview]:
        """Yield views over the next n bytes; stops early at the end of the stream."""
        left = n
        while left:
            if self._pos >= len(self._view) and not self._fill():
                return
            take = min(left, len(self._view) - self._pos)
            yield self._view[self._pos : self._pos + take]
            self._pos += take
            self.offset += take
            left -= take

    def skip(self, n: int) -> int:
        return sum(len(s) for s in self.spans(n))


class Member:
    __slots__ = ("name", "raw_name", "kind", "size", "mode", "mtime", "linkname")

    def __init__(self, raw_name, kind, size, mode, mtime, linkname):
        self.raw_name, self.kind, self.size, self.mode, self.mtime = raw_name, kind, size, mode, mtime
        self.linkname = linkname
        self.name = ""


_KINDS = {
    tarfile.REGTYPE: "f",
    tarfile.AREGTYPE: "f",
    tarfile.CONTTYPE: "f",
    tarfile.DIRTYPE: "d",
    tarfile.SYMTYPE: "l",
    tarfile.LNKTYPE: "h",
}


def _pax(data: bytes) -> dict:
    out, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


class TarReader:
    """Parse a tar stream of any kit format; `ended` says whether the end-of-archive block was seen."""

    def __init__(self, path: str):
        self.path = str(path)
        with open(self.path, "rb") as fh:
            self.fmt = detect(fh.read(4))
        self._chunks = _Chunks(self.path, self.fmt)
        self.stream = _Stream(self._chunks)
        self.ended = False

    def close(self) -> None:
        self._chunks.close()

    def _data(self, size: int) -> bytes:
        data = self.stream.read(size)
        self.stream.skip(-size % BLOCK)
        if len(data) < size:
            raise self.truncated()
        return data

    def truncated(self) -> ArchiveDamagedError:
        return ArchiveDamagedError(
            f"archive {self.path!r} is truncated (it stops inside a member); copy it again or re-create it "
            f"with `python -m kit env pack`."
        )

    def members(self) -> Iterator[Member]:
        pax: dict = {}
        long_name = long_link = None
        while True:
            hdr = self.stream.read(BLOCK)
            if not hdr:
                return  # no end-of-archive block: the caller decides whether that is acceptable
            if len(hdr) < BLOCK:
                raise self.truncated()
            if hdr == _ZERO:
                self.ended = True
                return
            try:
                info = tarfile.TarInfo.frombuf(hdr, "utf-8", "surrogateescape")
            except tarfile.HeaderError as exc:
                raise ArchiveDamagedError(
                    f"archive {self.path!r} is corrupt at byte {self.stream.offset - BLOCK} of its tar stream "
                    f"({exc}); re-create it with `python -m kit env pack`."
                ) from exc
            if info.type == tarfile.XHDTYPE:
                pax = _pax(self._data(info.size))
                continue
            if info.type == tarfile.XGLTYPE:
                self._data(info.size)
                continue
            if info.type == tarfile.GNUTYPE_LONGNAME:
                long_name = self._data(info.size).rstrip(b"\0").decode("utf-8", "surrogateescape")
                continue
            if info.type == tarfile.GNUTYPE_LONGLINK:
                long_link = self._data(info.size).rstrip(b"\0").decode("utf-8", "surrogateescape")
                continue
            name = pax.get("path", long_name or info.name)
            linkname = pax.get("linkpath", long_link or info.linkname)
            size = int(pax.get("size", info.size))
            mtime = int(float(pax.get("mtime", info.mtime)))
            pax, long_name, long_link = {}, None, None
            kind = _KINDS.get(info.type, "?")
            if kind == "f" and info.isdir():
                kind = "d"
            yield Member(name, kind, size if kind == "f" else 0, info.mode, mtime, linkname)

    def copy(self, size: int, sink: Callable) -> None:
        """Pass the member's `size` data bytes to sink(view) and skip its padding."""
        got = 0
        for view in self.stream.spans(size):
            sink(view)
            got += len(view)
        if got < size:
            raise self.truncated()
        self.stream.skip(-size % BLOCK)

    def read_data(self, size: int) -> bytes:
        return self._data(size)

    def skip(self, size: int) -> None:
        if self.stream.skip(size + (-size % BLOCK)) < size:
            raise self.truncated()
