"""Writing env archives: tar (GNU format) compressed by python-zstandard on every core, or gzip. GNU tar writes the
env's members from a list of names; the stream passes through here, where every file is hashed and checked against
its scanned size; the kit's own members (manifest first, member list last) get their headers from tarfile.

Layout (any tar reads it): `.kit-env.json` (kit_archive=2, kind, name, old prefix, hash algorithm), the env's
members in walk order, `.kit-env-members.json` (every member as [name, type, size, hash or link target], and the
prefix fixes). A copy cut anywhere lacks the member list or some members, so unpacking refuses it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import subprocess
import tarfile
import tempfile
from typing import IO, Iterator, Optional

from kit.envs.prefix import (
    SCAN_LIMIT,
    EnvArchiveError,
    EnvError,
    changed_error,
    gnu_program,
    helper_program,
    scan_prefix,
    special_file_error,
)

FORMATS = ("tar.zst", "tar.gz", "tar")
MANIFEST = ".kit-env.json"
TRAILER = ".kit-env-members.json"
ARCHIVE_VERSION = 2
LEVELS = {"tar.zst": (1, 19), "tar.gz": (1, 9)}  # zstd 20-22 need ~GBs of memory to unpack; gzip stops at 9
CHUNK = 1 << 20
HASH = "xxh3_64"  # the member hash pack writes: xxhash keeps hashing off the critical path
_END = bytes(512)  # tar's end-of-archive block
_KINDS = (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK)  # what an env holds; pack refuses the rest
_ROWS = {b"0": "f", b"\0": "f", b"1": "h", b"2": "l", b"5": "d"}  # tar type flag -> member list type
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


def new_hasher(name: str):
    """A fresh hasher for the algorithm an archive names; EnvArchiveError when the kit does not know it."""
    if name != HASH:
        raise EnvArchiveError(f"archive member hash {name!r} is not the one the kit writes ({HASH}).")
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
    so the fsync before the final rename (kit/storage/atomic.py) has only the last piece to write."""

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


class _TarPipe:
    """What GNU tar writes into a pipe, read in pieces of up to CHUNK bytes; what was consumed goes to `send` when
    the next piece is read, and by send_consumed() at the end."""

    def __init__(self, fd: int, send):
        self.fd, self.send, self.buf, self.pos = fd, send, b"", 0

    def _more(self) -> None:
        data = os.read(self.fd, CHUNK)
        if not data:
            raise EOFError
        self.send_consumed()
        self.buf, self.pos = self.buf[self.pos :] + data, 0

    def send_consumed(self) -> None:
        if self.pos:
            self.send(memoryview(self.buf)[: self.pos])

    def take(self, n: int) -> bytes:
        while len(self.buf) - self.pos < n:
            self._more()
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def spans(self, n: int) -> Iterator[tuple]:
        """The next `n` bytes as (buffer, start, end) pieces, consumed."""
        while n > 0:
            if self.pos == len(self.buf):
                self._more()
            take = min(n, len(self.buf) - self.pos)
            yield self.buf, self.pos, self.pos + take
            self.pos, n = self.pos + take, n - take


class ArchiveWriter:
    """A tar stream into `out` (a compressor) of files under the folder `root`, recording [name, type, size,
    hash|link] for every member; `scan`: text files that hold these bytes (the old prefix) are listed in
    prefix_files. The members given to add() are written by GNU tar at finish(); their stream passes through here,
    where each member is checked against its scanned size, hashed and recorded. add() and add_bytes() are the
    archive interface conda-pack's Packer writes into."""

    def __init__(self, out, root: str, scan: Optional[bytes] = None):
        self.out, self.root, self.scan, self.hash_name = out, root, scan, HASH
        self.members: list = []
        self.prefix_files: list = []
        self.bytes = self._offset = 0
        self._listed: list = []  # (name, lstat) for tar, in order
        self._progress = None

    def _write(self, data) -> None:
        self.out.write(data)
        self._offset += len(data)

    def add_bytes(self, source: Optional[str], data: bytes, target: str) -> None:
        """The member `target` holding `data`: a file conda-pack rewrote, with the mode and times of `source`, or
        (source None) one of the kit's own JSON members, mode 0644 and not in the member list."""
        st, info = os.lstat(source) if source is not None else None, tarfile.TarInfo(target)
        info.size, info.mode = len(data), 0o644 if st is None else st.st_mode & 0o777
        if st is not None:
            info.uid, info.gid, info.mtime = st.st_uid, st.st_gid, int(st.st_mtime)
        self._write(info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape"))
        self._write(data + bytes(-len(data) % 512))
        if st is not None:
            h = new_hasher(self.hash_name)
            h.update(data)
            self._file(target, len(data), h.hexdigest())

    def _file(self, name: str, size: int, digest: str) -> None:
        self.members.append([name, "f", size, digest])
        self.bytes += size

    def add(self, path: str, name: str, st=None) -> None:
        """List the file, folder or link at `path` (links not followed) as the member `name`; a file outside
        `root` (a script conda-pack wrote to a temporary file) is read now."""
        st = st or os.lstat(path)
        if stat.S_IFMT(st.st_mode) not in _KINDS:
            raise special_file_error(path, "remove it and pack again", EnvArchiveError)
        if path == os.path.join(self.root, name):
            self._listed.append((name, st))
        else:
            with open(path, "rb") as fh:
                self.add_bytes(path, fh.read(), name)

    def add_entries(self, entries, skip=(), progress=None) -> None:
        """add() for every (name, path, lstat) of scan_tree() not in `skip`; progress(1) per file or link."""
        self._progress = progress
        for name, path, st in entries:
            if name not in skip:
                self.add(path, name, st)
            elif progress and not stat.S_ISDIR(st.st_mode):
                progress(1)

    def _tar_listed(self) -> None:
        """GNU tar writes the listed members into a pipe (its headers, hard links as it finds them, no end) and
        this process passes them on to `out`."""
        exe = gnu_program("tar")
        if exe is None:
            raise EnvError("GNU tar is needed to pack environments: install it (apt-get install tar).")
        cmd = [exe, "-c", "-f", "-", "--format=gnu", "--numeric-owner", "--no-recursion", "-b", "2048"]
        cmd += ["-C", self.root, "--null", "--no-unquote", "-T", "-"]
        with tempfile.TemporaryFile() as names:
            names.write(b"".join(os.fsencode(name) + b"\0" for name, _st in self._listed))
            names.seek(0)
            with helper_program(
                cmd,
                f"packing {self.root}",
                EnvError,
                stdin=names,
                stdout=subprocess.PIPE,
                env=dict(os.environ, LC_ALL="C"),
            ) as proc:
                with contextlib.suppress(OSError):  # 1 MiB reads, not 64 KiB (Linux's F_SETPIPE_SZ)
                    fcntl.fcntl(proc.stdout.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), CHUNK)
                pipe: Optional[_TarPipe] = _TarPipe(proc.stdout.fileno(), self._write)
                try:
                    self._pass_on(pipe)
                except EOFError:  # tar stopped early: its message says why
                    pipe = None
                else:
                    pipe.send_consumed()
                    while os.read(pipe.fd, CHUNK):  # tar's end blocks and record padding
                        pass
        if pipe is None:  # and tar said nothing
            raise EnvError(f"packing {self.root} failed: tar's stream stopped before its end")

    def _pass_on(self, pipe: _TarPipe) -> None:
        """Check, hash and record each member tar writes until its end block, which is left unconsumed."""
        listed, long = iter(self._listed), {}
        while True:
            hdr = pipe.take(512)
            if hdr == _END:
                pipe.pos -= 512
                break
            kind, size = hdr[156:157], tarfile.nti(hdr[124:136])
            if kind in (b"L", b"K"):  # a GNU long name or link target, for the header that follows
                long[kind] = pipe.take(size + -size % 512)[:size].rstrip(b"\0")
                continue
            name = os.fsdecode(long.pop(b"L", None) or hdr[:100].split(b"\0", 1)[0]).rstrip("/")
            link = os.fsdecode(long.pop(b"K", None) or hdr[157:257].split(b"\0", 1)[0])
            row = _ROWS.get(kind, "?")
            want, st = next(listed, (None, None))
            if name != want or (row == "f" and size != st.st_size) or row == "?":
                raise self._changed(want or name)  # tar skips a file gone since the scan
            if row == "f":
                self._file(name, size, self._data(pipe, name, size))
            else:
                self.members.append([name, row, 0, link if row in "hl" else ""])
            if self._progress and row != "d":
                self._progress(1)
        gone = next(listed, None)
        if gone is not None:
            raise self._changed(gone[0])

    def _changed(self, name: str) -> Exception:
        """The error for a listed member tar found gone, changed in size, or not a file, folder or link."""
        path, scanned = os.path.join(self.root, name), dict(self._listed).get(name)
        st = os.lstat(path) if os.path.lexists(path) else None
        if st is not None and stat.S_IFMT(st.st_mode) not in _KINDS:
            return special_file_error(path, "remove it and pack again", EnvArchiveError)
        return changed_error(path, scanned.st_size if scanned else 0, st and st.st_size, "packed")

    def _data(self, pipe: _TarPipe, name: str, size: int) -> str:
        """The hash of a file's data (a small file also scanned for the old prefix), its padding consumed."""
        h = new_hasher(self.hash_name)
        if size > SCAN_LIMIT:  # a binary: passed on in pieces
            for buf, start, end in pipe.spans(size):
                h.update(memoryview(buf)[start:end])
        else:
            data = pipe.take(size)
            h.update(data)
            if self.scan and scan_prefix(data, self.scan):  # text that holds the old prefix
                self.prefix_files.append(name)
        pipe.take(-size % 512)
        return h.hexdigest()

    def finish(self, extra: dict) -> None:
        """Have tar write the listed members, then write the member list (with `extra`, e.g. prefix fixes) and
        tar's end: two zero blocks, then zeros to a whole record of 10 KiB, as tarfile and tar end theirs."""
        if self._listed:
            self._tar_listed()
        trailer = dict(extra, members=self.members, hash=self.hash_name, prefix_files=self.prefix_files)
        self.add_bytes(None, json_bytes(trailer), TRAILER)
        self._write(bytes(1024))
        self._write(bytes(-self._offset % tarfile.RECORDSIZE))


@contextlib.contextmanager
def archive_writer(
    raw: IO[bytes], fmt: str, level: int, threads: int, head: dict, root: str, scan: Optional[bytes] = None
) -> Iterator[ArchiveWriter]:
    """An ArchiveWriter of files under `root` into the open file `raw` that has written `head` (+ kit_archive,
    hash) as the first member; the caller adds the members and calls finish()."""
    comp = compressed_writer(raw, fmt, level, threads)
    try:
        writer = ArchiveWriter(comp, root, scan)
        head = dict(head, kit_archive=ARCHIVE_VERSION, hash=writer.hash_name)
        writer.add_bytes(None, json_bytes(head), MANIFEST)
        yield writer
    finally:
        if comp is not raw:
            comp.close()
