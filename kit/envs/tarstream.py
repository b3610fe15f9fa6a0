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
import struct
import sys
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
_CAPACITY = _FLUSH + SMALL + 2 * BLOCK  # the output buffer: what is gathered, plus the largest small file


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


def digest_of(name: str) -> Callable:
    """hex digest of one whole buffer with the algorithm an archive names (one call, no hasher object)."""
    if name == "crc32":
        return lambda data: f"{zlib.crc32(data):08x}"
    new_hasher(name)  # raises when the algorithm is unknown or its module is missing
    import xxhash

    one = getattr(xxhash, "xxh3_64_hexdigest", None)  # one-shot form (xxhash >= 2)
    return one if one is not None else (lambda data: xxhash.xxh3_64(data).hexdigest())


def json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=None, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


_TAILS: dict = {}  # (kind, uname, gname) -> the constant part of a header after the link name, and its sum


def _tail(kind: bytes, uname: str, gname: str) -> tuple:
    key = (kind, uname, gname)
    if key not in _TAILS:
        u, g = uname.encode("utf-8", "replace")[:31], gname.encode("utf-8", "replace")[:31]
        tail = b"ustar\x0000" + u.ljust(32, b"\0") + g.ljust(32, b"\0") + b"0000000\0" * 2
        _TAILS[key] = (tail, sum(tail))
    return _TAILS[key]


def _ustar(name, mode, uid, gid, size, mtime, kind, linkname, uname, gname) -> Optional[bytes]:
    """A POSIX ustar header built directly (tarfile's builder costs more per member than reading a small
    file), or None when the member needs pax records (long or non-ASCII names, big sizes or ids)."""
    if not (name.isascii() and linkname.isascii()):
        return None
    path = name.encode("ascii")
    link = linkname.encode("ascii")
    prefix = b""
    if len(path) > 100:
        cut = path.rfind(b"/", 0, 156)
        if cut <= 0 or not 0 < len(path) - cut - 1 <= 100:
            return None
        prefix, path = path[:cut], path[cut + 1 :]
    if (
        len(link) > 100
        or size >= 0o77777777777
        or not 0 <= mtime < 0o77777777777
        or uid > 0o7777777
        or gid > 0o7777777
    ):
        return None
    tail, tail_sum = _tail(kind, uname, gname)
    numbers = b"%07o\0%07o\0%07o\0%011o\0%011o\0" % (mode, uid, gid, size, mtime)
    chksum = sum(path) + sum(numbers) + 256 + kind[0] + sum(link) + tail_sum + sum(prefix)
    return b"".join(
        (
            path.ljust(100, b"\0"),
            numbers,
            b"%06o\0 " % chksum,
            kind,
            link.ljust(100, b"\0"),
            tail,
            prefix.ljust(155, b"\0"),
            _ZERO[:12],
        )
    )


_PARTS: dict = {}  # (kind, uid, gid, user, group) -> (id fields, the header from the checksum field on, ASCII?)


def plain_header(
    name: str, kind: bytes, mode: int, size: int, mtime: int, uid: int = 0, gid: int = 0, user="", group=""
) -> Optional[bytes]:
    """The ustar header of a member without link name, built from parts cached per kind and owner, with its
    checksum from adler32 (for ASCII bytes adler32's low half is 1 + their sum: 512 bytes below 128 sum to less
    than its modulus 65521); None when it needs pax records (non-ASCII or long names, big numbers)."""
    if not name.isascii() or not 0 <= mtime < 0o77777777777 or size >= 0o77777777777:
        return None
    prefix = b""
    if len(name) > 100:  # ustar keeps up to 155 bytes of folders apart from the last 100 bytes
        cut = name.rfind("/", 0, 156)
        if cut <= 0 or len(name) - cut - 1 > 100:
            return None
        prefix, name = name[:cut].encode("ascii"), name[cut + 1 :]
    key = (kind, uid, gid, user, group)
    parts = _PARTS.get(key)
    if parts is None:
        if uid > 0o7777777 or gid > 0o7777777:
            return None
        tail, _ = _tail(kind, user, group)
        rest = b" " * 8 + kind + bytes(100) + tail + bytes(155 + 12)
        parts = _PARTS[key] = (b"%07o\0%07o\0" % (uid, gid), rest, rest.isascii())
    ids, rest, ascii_ = parts
    header = b"%s%07o\0%s%011o\0%011o\0%s" % (
        name.encode("ascii").ljust(100, b"\0"),
        mode,
        ids,
        size,
        mtime,
        rest,
    )
    if prefix:
        header = b"%s%s%s" % (header[:345], prefix.ljust(155, b"\0"), header[500:])
    chksum = (zlib.adler32(header) & 0xFFFF) - 1 if ascii_ else sum(header)
    return b"%s%06o\0%s" % (header[:148], chksum, header[155:])


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
        self._buf = bytearray(_CAPACITY)  # filled from _pos on; small files are read straight into it
        self._pos = 0
        self._inodes: dict = {}
        self._names: dict = {}
        self._oneshot = None

    # -- low level
    def _digest(self, data) -> str:
        if self.hash_name == "xxh3_64":
            if self._oneshot is None:
                import xxhash

                self._oneshot = xxhash.xxh3_64_hexdigest
            return self._oneshot(data)
        h = new_hasher(self.hash_name)
        h.update(data)
        return h.hexdigest()

    def _emit(self, data) -> None:
        n = len(data)
        if self._pos + n > len(self._buf):
            self._room(n)
        self._buf[self._pos : self._pos + n] = data
        self._pos += n
        if self._pos >= _FLUSH:
            self.flush()

    def _room(self, n: int) -> None:
        """Make room for n more bytes in the buffer (handing on what it holds first)."""
        self.flush()
        if n > len(self._buf):
            self._buf = bytearray(n)

    def flush(self) -> None:
        if self._pos:
            # `out` may keep the buffer (ThreadedSink hands it to another thread): go on in another one, one
            # that `out` says it is done with if it gives buffers back (a new one costs page faults)
            self.out.write(memoryview(self._buf)[: self._pos])
            spare = getattr(self.out, "spare", None)
            try:
                self._buf = spare.get_nowait() if spare is not None else bytearray(_CAPACITY)
            except queue.Empty:
                self._buf = bytearray(_CAPACITY)
            self._pos = 0

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
        if st is not None:
            fast = _ustar(
                name + "/" if kind == tarfile.DIRTYPE else name,  # tar's convention for folders
                stat.S_IMODE(st.st_mode) if mode is None else mode,
                st.st_uid,
                st.st_gid,
                size,
                int(st.st_mtime),
                kind,
                linkname,
                *self._owner(st.st_uid, st.st_gid),
            )
            if fast is not None:
                return fast
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
        if st.st_size <= SMALL:
            self._add_small(path, name, st.st_size, self._header(name, tarfile.REGTYPE, st, st.st_size))
            return
        h = new_hasher(self.hash_name)
        self._emit(self._header(name, tarfile.REGTYPE, st, st.st_size))
        self.flush()
        size = 0
        with open(path, "rb", buffering=0) as fh:
            while size < st.st_size:
                chunk = fh.read(min(_FLUSH, st.st_size - size))  # a new buffer each time: `out` may keep it
                if not chunk:
                    break
                h.update(chunk)
                self.out.write(chunk)
                size += len(chunk)
        if size != st.st_size:
            raise self._changed(path, st.st_size, size)
        self._pad(size)
        self.members.append([name, "f", size, h.hexdigest()])
        self.bytes += size

    def _add_small(self, path: str, name: str, size: int, header: bytes) -> None:
        """A file read whole straight into its place in the output buffer, after its header (no copy)."""
        padded = size + (-size % BLOCK)
        start = self._pos + len(header)  # one block, or three with pax records (long or non-ASCII names)
        if start + padded > len(self._buf):
            self._room(len(header) + padded)
            start = len(header)
        buf = self._buf
        buf[start - len(header) : start] = header
        if size:
            view = memoryview(buf)[start : start + size]
            got = 0
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # the size stat() gave, in one read (as tar does); short reads are allowed, so loop
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if not n:
                        break
                    got += n
            finally:
                os.close(fd)
            if got != size:
                view.release()
                raise self._changed(path, size, got)
            if padded > size:
                buf[start + size : start + padded] = _ZERO[: padded - size]
            # text files (no NUL in their first 8 KiB) that hold the old prefix; binaries are not rewritten
            if self.scan and buf.find(b"\0", start, start + min(size, 8192)) < 0:
                if buf.find(self.scan, start, start + size) >= 0:
                    self.prefix_files.append(name)
            digest = self._digest(view)
            view.release()
        else:
            digest = self._digest(b"")
        self._pos = start + padded
        if self._pos >= _FLUSH:
            self.flush()
        self.members.append([name, "f", size, digest])
        self.bytes += size

    def add_entries(self, entries, skip=(), progress: Optional[Callable] = None) -> None:
        """add_path() for every (name, path, lstat) of scan_tree() not in `skip`; progress(1) per file or link.
        Nearly every member of an env is a small file with a plain name: its header comes from plain_header()."""
        for name, path, st in entries:
            mode = st.st_mode
            if progress and not stat.S_ISDIR(mode):
                progress(1)
            if name in skip:
                continue
            size = st.st_size
            header = None
            if stat.S_ISREG(mode) and st.st_nlink == 1 and size <= SMALL:
                uid, gid = st.st_uid, st.st_gid
                header = plain_header(
                    name,
                    tarfile.REGTYPE,
                    stat.S_IMODE(mode),
                    size,
                    int(st.st_mtime),
                    uid,
                    gid,
                    *self._owner(uid, gid),
                )
            if header is None:
                self.add_path(path, name, st)
            else:
                self._add_small(path, name, size, header)

    @staticmethod
    def _changed(path: str, before: int, now: int) -> EnvArchiveError:
        return EnvArchiveError(
            f"{path} changed size while it was packed ({before} -> {now} bytes); stop what writes to the env "
            f"and pack again."
        )

    def finish(self, extra: dict) -> None:
        """Write the member list (with `extra`, e.g. prefix fixes) and the end-of-archive blocks."""
        trailer = dict(extra, members=self.members, hash=self.hash_name, prefix_files=self.prefix_files)
        self.add_bytes(TRAILER, json_bytes(trailer), record=False)
        self._emit(_ZERO * 2)
        self.flush()


class ThreadedSink:
    """Feed `out` (a compressor) from a helper thread, so that reading files and building the tar (the calling
    thread) overlaps with handing data to zstd's workers, as `tar | zstd` overlap as two processes. Buffers
    passed to write() must not be changed afterwards. With recycle=True (for an `out` that is done with what
    it was given when its write() returns, as zstd and files are; conda-pack's parallel gzip keeps buffers),
    the bytearray under each memoryview written goes to `spare` once written, for the writer to fill again."""

    def __init__(self, out, depth: int = 4, recycle: bool = False):
        self._out = out
        self.spare: Optional[queue.SimpleQueue] = queue.SimpleQueue() if recycle else None
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kit-pack-compress")
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if self._error is None:
                try:
                    self._out.write(item)
                except BaseException as exc:  # raised again in the writing thread
                    self._error = exc
                if (
                    self.spare is not None
                    and isinstance(item, memoryview)
                    and isinstance(item.obj, bytearray)
                ):
                    buf = item.obj
                    try:
                        item.release()  # refused (BufferError) while anything still holds the view
                    except BufferError:
                        continue
                    self.spare.put(buf)

    def write(self, data) -> int:
        if self._error is not None:
            raise self._error
        self._q.put(data)
        return len(data)

    def close(self) -> None:
        """Wait until everything was handed over; raise what the helper thread met."""
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


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


_LIBZSTD = None  # (library, buffer struct) once looked up; False where there is none


def _libzstd():
    """libzstd through ctypes, for unpacking (None without it, or with KIT_ZSTD_LIB=0). A foreign call through
    ctypes releases the interpreter lock, so a thread decompressing with it runs beside the member checks,
    which python-zstandard's objects do not allow (they keep the lock) and the `zstd` program allows at the
    cost of a pipe copy of every byte. Signatures: zstd.h, "Streaming decompression" (ZSTD_DStream, stable
    since zstd 1.0)."""
    global _LIBZSTD
    if os.environ.get("KIT_ZSTD_LIB", "1") == "0":
        return None
    if _LIBZSTD is None:
        _LIBZSTD = False
        try:
            import ctypes

            lib = ctypes.CDLL("libzstd.so.1" if sys.platform.startswith("linux") else "libzstd.1.dylib")

            # ZSTD_inBuffer and ZSTD_outBuffer share one layout: {void *, size_t size, size_t pos}
            class Buffer(ctypes.Structure):
                _fields_ = [("ptr", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]

            lib.ZSTD_createDStream.restype = ctypes.c_void_p
            lib.ZSTD_freeDStream.argtypes = [ctypes.c_void_p]
            lib.ZSTD_initDStream.argtypes = [ctypes.c_void_p]
            lib.ZSTD_initDStream.restype = ctypes.c_size_t
            lib.ZSTD_decompressStream.argtypes = [
                ctypes.c_void_p,
                ctypes.POINTER(Buffer),
                ctypes.POINTER(Buffer),
            ]
            lib.ZSTD_decompressStream.restype = ctypes.c_size_t
            lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
            lib.ZSTD_isError.restype = ctypes.c_uint
            lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
            lib.ZSTD_getErrorName.restype = ctypes.c_char_p
            _LIBZSTD = (lib, Buffer)
        except (OSError, AttributeError):
            pass
    return _LIBZSTD or None


def _libzstd_chunks(path: str, found) -> Iterator[bytearray]:
    """Decompressed chunks of a zstd file from libzstd (frames one after another, each frame's checksum checked
    by libzstd); raises when the stream is damaged or stops inside a frame."""
    import ctypes

    lib, Buffer = found
    stream = lib.ZSTD_createDStream()
    if not stream:
        raise MemoryError("libzstd could not allocate a decompression stream")
    try:
        lib.ZSTD_initDStream(stream)
        raw = bytearray(_READ)
        window = (ctypes.c_char * _READ).from_buffer(raw)
        src = Buffer(ctypes.addressof(window), 0, 0)
        left, full = 0, False  # left: the last call's return, 0 when a frame ended and was flushed
        with open(path, "rb", buffering=0) as fh:
            while True:
                src.size, src.pos = fh.readinto(raw), 0
                at_end = not src.size
                # a full output may hold back more of the frame (unless the call said the frame ended: 0)
                while src.pos < src.size or (full and left):
                    out = bytearray(_READ)
                    out_window = (ctypes.c_char * _READ).from_buffer(out)
                    dst = Buffer(ctypes.addressof(out_window), _READ, 0)
                    left = lib.ZSTD_decompressStream(stream, ctypes.byref(dst), ctypes.byref(src))
                    del out_window  # releases `out`, so that it can be cut to what was written
                    if lib.ZSTD_isError(left):
                        raise ArchiveDamagedError(
                            f"archive {path!r} is corrupt: its zstd stream does not decompress "
                            f"({lib.ZSTD_getErrorName(left).decode('ascii', 'replace')}); copy it again or "
                            f"re-create it with `python -m kit env pack`."
                        )
                    full = dst.pos == _READ
                    if dst.pos:
                        if not full:
                            del out[dst.pos :]
                        yield out
                if at_end:
                    break
        del window
        if left:
            raise ArchiveDamagedError(
                f"archive {path!r} is truncated: its zstd stream stops in the middle; copy it again (compare its "
                f"size with the original) or re-create it with `python -m kit env pack`."
            )
    finally:
        lib.ZSTD_freeDStream(stream)


class _ProgramChunks:
    """Decompressed chunks from the `zstd` program: a process of its own decompresses while this one checks
    members. (python-zstandard's decompressobj holds the interpreter lock while it works, so a thread of ours
    would not run beside the checks; measured here: decompressing plus a busy loop took their sum.)"""

    def __init__(self, path: str, exe: str):
        import subprocess
        import tempfile

        self.path = path
        self._err = tempfile.TemporaryFile()
        from kit.envs.prefix import dies_with_parent

        self._proc = subprocess.Popen(
            [exe, "-d", "-q", "-c", "--", path],
            stdout=subprocess.PIPE,
            stderr=self._err,
            preexec_fn=dies_with_parent(),
        )
        self._fd = self._proc.stdout.fileno()
        try:
            import fcntl

            fcntl.fcntl(self._fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except OSError:
            pass

    def __iter__(self):
        while True:
            data = os.read(self._fd, _READ)
            if not data:
                break
            yield data
        if self._proc.wait() != 0:
            self._err.seek(0)
            err = self._err.read().decode("utf-8", "replace").strip().splitlines()
            raise ArchiveDamagedError(
                f"archive {self.path!r} is truncated or corrupt: its zstd stream does not decompress "
                f"({err[-1] if err else 'zstd failed'}); copy it again (compare its size with the original) or "
                f"re-create it with `python -m kit env pack`."
            )

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.stdout.close()
        self._proc.wait()
        self._err.close()


def _zstd_program() -> Optional[str]:
    """The `zstd` program for unpacking where libzstd is not found, unless KIT_ZSTD_PROGRAM=0 (then
    python-zstandard on a thread)."""
    if os.environ.get("KIT_ZSTD_PROGRAM", "1") == "0":
        return None
    import shutil

    return shutil.which("zstd")


class _Chunks:
    """Decompress on a background thread while the caller checks members (zlib and libzstd through ctypes
    release the interpreter lock while they work; python-zstandard's decompressobj does not, see
    _ProgramChunks, which the kit uses for zstd where libzstd is not found)."""

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
            lib = _libzstd() if fmt == "tar.zst" else None
            for chunk in _libzstd_chunks(path, lib) if lib else _decompressed(path, fmt):
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
        try:  # a reader that stopped early: free the queue, so the thread's waiting put returns at once
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
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
        pos = self._pos
        if pos + n <= len(self._view):  # the common case: within the current chunk
            self._pos = pos + n
            self.offset += n
            return self._view[pos : pos + n].tobytes()
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
        if self._pos + n <= len(self._view):
            self._pos += n
            self.offset += n
            return n
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


class _Info:
    """The fields of a header that reading needs (what tarfile.TarInfo has, without its per-field cost)."""

    __slots__ = ("name", "mode", "size", "mtime", "type", "linkname")

    def isdir(self) -> bool:
        return self.type == tarfile.DIRTYPE


_FIELDS = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s")  # POSIX ustar, up to the padding


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _parse_ustar(hdr: bytes) -> Optional[_Info]:
    """Parse a plain POSIX ustar header with octal fields; None for anything else (tarfile parses those)."""
    if hdr[257:263] != b"ustar\x00" or (hdr[100] | hdr[124] | hdr[136]) & 0x80:
        return None
    name, mode, _u, _g, size, mtime, chk, kind, link, _m, _v, _un, _gn, _dj, _dn, prefix = _FIELDS.unpack(
        hdr[:500]
    )
    try:
        # the sum of the header's bytes with the checksum field as spaces; for ASCII bytes adler32's low half
        # is 1 + that sum (512 bytes below 128 stay under its modulus), else count them one by one
        total = (zlib.adler32(hdr) & 0xFFFF) - 1 if hdr.isascii() else sum(hdr)
        if _octal(chk) != total - sum(chk) + 256:
            raise tarfile.InvalidHeaderError("bad checksum")
        info = _Info()
        name = name.split(b"\0", 1)[0]
        if prefix[0]:
            name = prefix.split(b"\0", 1)[0] + b"/" + name
        info.name = name.decode("utf-8", "surrogateescape")
        info.mode = _octal(mode)
        info.size = _octal(size)
        info.mtime = _octal(mtime)
        info.type = tarfile.REGTYPE if kind == b"\0" else kind
        info.linkname = link.split(b"\0", 1)[0].decode("utf-8", "surrogateescape") if link[0] else ""
    except ValueError as exc:
        raise tarfile.InvalidHeaderError(f"bad number field ({exc})") from exc
    if info.type == tarfile.AREGTYPE and info.name.endswith("/"):
        info.type = tarfile.DIRTYPE
    return info


# The fields plain_run() reads: name, mode, (uid, gid skipped), size, mtime, checksum, typeflag, link name,
# magic + version, (owner names, device numbers skipped), prefix.
_PLAIN = struct.Struct("100s8s16x12s12s8sc100s8s80x155s")
_USTAR = b"ustar\x0000"
_SLASH, _DOT_PART, _BACKSLASH = b"/", b"/.", b"\\"


class TarReader:
    """Parse a tar stream of any kit format; `ended` says whether the end-of-archive block was seen."""

    def __init__(self, path: str):
        self.path = str(path)
        with open(self.path, "rb") as fh:
            self.fmt = detect(fh.read(4))
        exe = _zstd_program() if self.fmt == "tar.zst" and not _libzstd() else None
        self._chunks = _ProgramChunks(self.path, exe) if exe else _Chunks(self.path, self.fmt)
        self.stream = _Stream(self._chunks)
        self.ended = False

    def close(self) -> None:
        self._chunks.close()

    def drain(self) -> None:
        """Read the stream to its end (past tar's end-of-archive block), so that a compressed stream that is
        cut short or fails its checksum there is reported too."""
        while self.stream._fill():
            pass

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
                info = _parse_ustar(hdr) or tarfile.TarInfo.frombuf(hdr, "utf-8", "surrogateescape")
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

    def plain_run(self, take: Callable) -> Optional[memoryview]:
        """Consume the plain files and folders that lie whole in the current chunk for as long as
        take(name, kind, mode, size, mtime, data) accepts them (kind 'f' or 'd', data a view of the file's bytes);
        return the bytes they occupy in the stream (headers, data, padding) as one view, or None if none was taken.

        A writer may pass that view on to GNU tar unchanged: a plain header is one that tar reads exactly as this
        reader does. That means POSIX ustar magic and version "00"; typeflag '0' or '5' with no link name; mode,
        size, mtime and checksum written as all-octal-digit fields ending in NUL (how GNU tar, Python's tarfile
        and this kit write them); mode at most 0o777 (a folder's with the owner's rwx, as the kit gives folders);
        a folder's size 0; ASCII bytes only; a clean relative name (no leading '/', no '.' or '..' parts, no '//',
        no backslash), a file's without a trailing '/' (GNU tar extracts those as folders). Anything else is
        left for members(), whose members are re-written before tar sees them: tar also accepts numeric fields
        with a leading NUL or spaces, base-256 or base-64 numbers (GNU tar, list.c from_header), which a looser
        reader could read differently, and one header read differently would shift every header after it.
        Names starting with '.' (the kit's own two members among them) are left for members() too.
        """
        stream = self.stream
        if stream._pos >= len(stream._view) and not stream._fill():
            return None
        view = stream._view
        chunk, start = view.obj, stream._pos
        if not isinstance(chunk, (bytes, bytearray)) or len(chunk) != len(view):
            return None  # offsets below index the chunk itself (every reader here yields whole chunks)
        pos = start
        end = len(view) - BLOCK
        unpack = _PLAIN.unpack_from
        while pos <= end:
            hdr = chunk[pos : pos + BLOCK]
            name, mode, size, mtime, chk, kind, link, magic, prefix = unpack(hdr)
            if (
                magic != _USTAR
                or link[0]
                or kind not in b"05"
                or mode[7]
                or size[11]
                or mtime[11]
                or chk[6:] != b"\0 "
                or not (mode[:7] + size[:11] + mtime[:11] + chk[:6]).isdigit()
                or not hdr.isascii()
            ):
                break
            try:
                mode, size, mtime = int(mode[:7], 8), int(size[:11], 8), int(mtime[:11], 8)
                if int(chk[:6], 8) != (zlib.adler32(hdr) & 0xFFFF) - 1 - sum(chk) + 256:
                    break  # members() reports the bad checksum
            except ValueError:  # an 8 or 9
                break
            name = name.split(b"\0", 1)[0]
            if prefix[0]:
                name = prefix.split(b"\0", 1)[0] + _SLASH + name
            folder = kind == b"5"
            if folder:
                if size or mode & 0o700 != 0o700:
                    break
                name = name.rstrip(_SLASH)
            stop = pos + BLOCK + size + (-size % BLOCK)
            if (
                mode > 0o777
                or stop > len(view)
                or not name
                or name.startswith(_SLASH)
                or name.endswith(_SLASH)
                or _DOT_PART in _SLASH + name
                or b"//" in name
                or _BACKSLASH in name
            ):
                break
            if not take(
                name.decode("ascii"),
                "d" if folder else "f",
                mode,
                size,
                mtime,
                view[pos + BLOCK : pos + BLOCK + size],
            ):
                break
            pos = stop
        if pos == start:
            return None
        stream._pos = pos
        stream.offset += pos - start
        return view[start:pos]

    def copy(self, size: int, sink: Callable) -> None:
        """Pass the member's `size` data bytes to sink(view) and skip its padding."""
        stream, pos, padded = self.stream, self.stream._pos, size + (-size % BLOCK)
        if pos + padded <= len(stream._view):  # the common case: data and padding within the current chunk
            sink(stream._view[pos : pos + size])
            stream._pos = pos + padded
            stream.offset += padded
            return
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
