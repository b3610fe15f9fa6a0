"""Writing env archives: tar (GNU format, as `tar -c` writes) compressed by python-zstandard on every core, or gzip.
tarfile builds each member's header; the kit writes the members itself (not TarFile.addfile) for what that buys: a
manifest first, every file hashed as it is read and checked against its scanned size, a member list with sizes and
hashes last, and the stream handed to the compressor in 1 MiB writes.

Layout (any tar reads it): `.kit-env.json` (kit_archive=2, kind, name, old prefix, hash algorithm), the env's
members in walk order, `.kit-env-members.json` (every member as [name, type, size, hash or link target], and the
prefix fixes). A copy cut anywhere lacks the member list or some members, so unpacking refuses it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tarfile
import zlib
from typing import IO, Iterator, Optional

from kit.envs.prefix import (
    EnvArchiveError,
    EnvError,
    read_scanned,
    scan_prefix,
    special_file_error,
)

FORMATS = ("tar.zst", "tar.gz", "tar")
MANIFEST = ".kit-env.json"
TRAILER = ".kit-env-members.json"
ARCHIVE_VERSION = 2
LEVELS = {"tar.zst": (1, 19), "tar.gz": (1, 9)}  # zstd 20-22 need ~GBs of memory to unpack; gzip stops at 9
SMALL = 2 << 20  # files up to this size are read whole (and scanned for the old prefix)
CHUNK = 1 << 20
HASH = "xxh3_64"  # the member hash pack writes: xxhash keeps hashing off the critical path
_SUFFIXES = {".tar.zst": "tar.zst", ".tzst": "tar.zst", ".tar.gz": "tar.gz", ".tgz": "tar.gz", ".tar": "tar"}


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


class _Crc32:
    """zlib.crc32 behind the hashlib interface (the member hash of archives packed where xxhash was missing)."""

    value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hasher(name: str):
    """A fresh hasher for the algorithm an archive names; EnvArchiveError when the kit does not know it."""
    if name == "crc32":
        return _Crc32()
    if name != HASH:
        raise EnvArchiveError(f"archive member hash {name!r} is not one the kit knows (xxh3_64, crc32).")
    import xxhash

    return xxhash.xxh3_64()


def json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")


def compressed_writer(fileobj: IO[bytes], fmt: str, level: int = 3, threads: int = 0):
    """Wrap `fileobj` in the compressor for `fmt` (the level checked by check_level), or return it for plain tar;
    the caller closes a wrapper, then the file."""
    threads = n_threads(threads)
    if fmt == "tar.zst":  # libzstd's worker threads; each frame carries a checksum zstd checks on unpack
        import zstandard

        cctx = zstandard.ZstdCompressor(
            level=level, threads=threads if threads > 1 else 0, write_checksum=True
        )
        return cctx.stream_writer(fileobj, closefd=False)
    if fmt == "tar.gz":  # one gzip member, its blocks compressed on a thread pool; gunzip reads it
        from conda_pack.formats import ParallelGzipFileWriter

        return ParallelGzipFileWriter(fileobj, compresslevel=level, n_threads=threads)
    if fmt != "tar":  # pack() said so before
        raise EnvArchiveError(f"archive format {fmt!r} is not one of {', '.join(FORMATS)}.")
    return fileobj


class EarlyWriteback:
    """File wrapper that starts the kernel's writeback every 32 MiB (posix_fadvise DONTNEED does not wait for it),
    so the fsync before the final rename (kit/atomic.py) has only the last piece to write."""

    def __init__(self, fh, step: int = 32 << 20):
        self._fh, self._step, self._since, self.flush = fh, step, 0, fh.flush

    def write(self, data) -> int:
        n = self._fh.write(data)
        self._since += n
        if self._since >= self._step and hasattr(os, "posix_fadvise"):
            self._since = 0
            self._fh.flush()
            os.posix_fadvise(self._fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return n


class ArchiveWriter:
    """A tar stream into `out` (a compressor), written in pieces of 1 MiB, recording [name, type, size, hash|link]
    for every member; `scan`: text files that hold these bytes (the old prefix) are listed in prefix_files. Its
    add() and add_bytes() are the archive interface conda-pack's Packer writes into."""

    def __init__(self, out, scan: Optional[bytes] = None):
        self.out, self.scan, self.hash_name = out, scan, HASH
        self.members: list = []
        self.prefix_files: list = []
        self.bytes = 0
        self._buf, self._offset, self._inodes = bytearray(), 0, {}

    def _write(self, data, pad: bool = False) -> None:
        self._buf += data
        if pad:  # to a whole 512-byte block
            self._buf += bytes(-len(data) % 512)
        if len(self._buf) >= CHUNK:
            self._flush()

    def _flush(self) -> None:
        self.out.write(self._buf)
        self._offset += len(self._buf)
        self._buf = bytearray()

    def _header(self, name: str, kind: bytes, st=None, mode=None, size: int = 0, link: str = "") -> None:
        info = tarfile.TarInfo(name)
        info.type, info.size, info.linkname = kind, size, link
        if st is not None:
            info.uid, info.gid, info.mtime = st.st_uid, st.st_gid, int(st.st_mtime)
        info.mode = stat.S_IMODE(st.st_mode) if mode is None else mode  # add_bytes() always gives one
        self._write(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))

    def add_bytes(self, source: Optional[str], data: bytes, target: str) -> None:
        """The member `target` holding `data`: a file conda-pack rewrote, with the mode and times of `source`, or
        (source None) one of the kit's own JSON members, mode 0644 and not in the member list."""
        st = os.lstat(source) if source is not None else None
        self._header(target, tarfile.REGTYPE, st, 0o644 if st is None else st.st_mode & 0o777, len(data))
        self._write(data, pad=True)
        if st is not None:
            h = new_hasher(self.hash_name)
            h.update(data)
            self._file(target, len(data), h.hexdigest())

    def _file(self, name: str, size: int, digest: str) -> None:
        self.members.append([name, "f", size, digest])
        self.bytes += size

    def add(self, path: str, name: str, st=None) -> None:
        """Add the file, folder or link at `path` (links not followed) under the member name `name`."""
        st = st or os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            self._header(name, tarfile.DIRTYPE, st)
            self.members.append([name, "d", 0, ""])
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            self._header(name, tarfile.SYMTYPE, st, link=target)
            self.members.append([name, "l", 0, target])
        elif stat.S_ISREG(st.st_mode):
            first = self._inodes.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
            if first is not None:
                self._header(name, tarfile.LNKTYPE, st, link=first)
                self.members.append([name, "h", 0, first])
                return
            if st.st_nlink > 1:
                self._inodes[(st.st_dev, st.st_ino)] = name
            self._add_file(path, name, st)
        else:
            raise special_file_error(path, "remove it and pack again", EnvArchiveError)

    def _add_file(self, path: str, name: str, st) -> None:
        """The file's header and data, hashed on the way (a small file read whole and scanned for the old prefix);
        a file whose size is not the scan's is an error."""
        self._header(name, tarfile.REGTYPE, st, size=st.st_size)
        h, small = new_hasher(self.hash_name), st.st_size <= SMALL
        for data in read_scanned(path, st, "packed", max(st.st_size, 1) if small else CHUNK):
            h.update(data)
            self._write(data)
            if small and self.scan and scan_prefix(data, self.scan):  # text that holds the old prefix
                self.prefix_files.append(name)
        self._write(bytes(-st.st_size % 512))
        self._file(name, st.st_size, h.hexdigest())

    def add_entries(self, entries, skip=(), progress=None) -> None:
        """add() for every (name, path, lstat) of scan_tree() not in `skip`; progress(1) per file or link."""
        for name, path, st in entries:
            if progress and not stat.S_ISDIR(st.st_mode):
                progress(1)
            if name not in skip:
                self.add(path, name, st)

    def finish(self, extra: dict) -> None:
        """Write the member list (with `extra`, e.g. prefix fixes) and tar's end: two zero blocks, then zeros to a
        whole record of 10 KiB, as tarfile and tar end theirs."""
        trailer = dict(extra, members=self.members, hash=self.hash_name, prefix_files=self.prefix_files)
        self.add_bytes(None, json_bytes(trailer), TRAILER)
        self._write(bytes(1024))
        self._write(bytes(-(self._offset + len(self._buf)) % tarfile.RECORDSIZE))
        self._flush()


@contextlib.contextmanager
def archive_writer(
    raw: IO[bytes], fmt: str, level: int, threads: int, head: dict, scan: Optional[bytes] = None
) -> Iterator[ArchiveWriter]:
    """An ArchiveWriter into the open file `raw` that has written `head` (+ kit_archive, hash) as the first
    member; the caller adds the members and calls finish()."""
    comp = compressed_writer(raw, fmt, level, threads)
    try:
        writer = ArchiveWriter(comp, scan)
        head = dict(head, kit_archive=ARCHIVE_VERSION, hash=writer.hash_name)
        writer.add_bytes(None, json_bytes(head), MANIFEST)
        yield writer
    finally:
        if comp is not raw:
            comp.close()
