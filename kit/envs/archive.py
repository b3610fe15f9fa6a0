"""Environment archives: tar.zst (multithreaded), tar.gz (parallel or plain gzip), tar; verified, safe extraction.

Every archive the kit writes lists its members with sizes and hashes (kit/envs/tarstream.py); extraction refuses
an archive unless every listed member arrived intact, and refuses members or links that would leave the target.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import stat
import tarfile
import zlib
from pathlib import Path
from typing import IO, Callable, Optional

from kit.envs.errors import ArchiveDamagedError, EnvArchiveError, EnvError
from kit.envs.prefix import dies_with_parent, gnu_program
from kit.envs.tarstream import (
    ARCHIVE_VERSION,
    BLOCK,
    HEAD,
    TRAILER,
    TarReader,
    _ustar,
    digest_of,
    json_bytes,
    new_hasher,
    plain_header,
)

FORMATS = ("tar.zst", "tar.gz", "tar")
MANIFEST = HEAD  # first member of every archive the kit writes: kind, name, old prefix, hash algorithm
LEVELS = {"tar.zst": (1, 19), "tar.gz": (1, 9)}  # zstd 20-22 need ~GBs of memory to unpack; gzip stops at 9
__all__ = ["ArchiveDamagedError", "EnvArchiveError", "FORMATS", "MANIFEST", "TRAILER"]


def n_threads(threads: int) -> int:
    """0 or -1 means every core; otherwise the number given (at least 1)."""
    if threads in (0, -1):
        return os.cpu_count() or 1
    return max(1, int(threads))


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
    name = str(path)
    for suffix, fmt in (
        (".tar.zst", "tar.zst"),
        (".tzst", "tar.zst"),
        (".tar.gz", "tar.gz"),
        (".tgz", "tar.gz"),
        (".tar", "tar"),
    ):
        if name.endswith(suffix):
            return fmt
    return None


def format_of(path: os.PathLike | str) -> str:
    """The archive format from the file name ('x.tar.zst' -> 'tar.zst'; .tgz/.tzst accepted)."""
    name = str(path)
    fmt = suffix_format(name)
    if fmt is not None:
        return fmt
    raise EnvArchiveError(
        f"archive name {name!r} has no known suffix; use one of "
        f"{', '.join('.' + f for f in FORMATS)} (or .tgz / .tzst)."
    )


class _ZstdWriter:
    """File-like zstd compressor with a level and worker threads (conda-pack's tar.zst ignores both)."""

    def __init__(self, fileobj: IO[bytes], level: int, threads: int):
        import zstandard

        self._zstd = zstandard
        # write_checksum: each frame carries an XXH64 of its content, which zstd checks on every unpack
        cctx = zstandard.ZstdCompressor(
            level=level, threads=threads if threads > 1 else 0, write_checksum=True
        )
        self._writer = cctx.stream_writer(fileobj, closefd=False)

    def write(self, data) -> int:
        return self._writer.write(data)

    def tell(self) -> int:
        return self._writer.tell()

    def close(self) -> None:
        self._writer.flush(self._zstd.FLUSH_FRAME)
        self._writer.close()


def compressed_writer(fileobj: IO[bytes], fmt: str, level: int = 3, threads: int = 0):
    """Wrap `fileobj` in the compressor for `fmt`; the caller closes the wrapper, then the file."""
    if fmt in LEVELS:
        check_level(fmt, level)
    if fmt == "tar.zst":
        return _ZstdWriter(fileobj, level=level, threads=n_threads(threads))
    if fmt == "tar.gz":
        if n_threads(threads) > 1:
            # gzip members compressed in blocks on a thread pool (zlib releases the GIL); plain gunzip reads it
            from conda_pack.formats import ParallelGzipFileWriter

            return ParallelGzipFileWriter(fileobj, compresslevel=level, n_threads=n_threads(threads))
        return gzip.GzipFile(fileobj=fileobj, mode="wb", compresslevel=level)
    if fmt == "tar":
        return _Passthrough(fileobj)
    raise EnvArchiveError(f"archive format {fmt!r} is not one of {', '.join(FORMATS)}.")


class _Passthrough:
    def __init__(self, fileobj: IO[bytes]):
        self._f = fileobj

    def write(self, data) -> int:
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.flush()


class EarlyWriteback:
    """File wrapper that has the kernel write data to disk while packing goes on (fdatasync on a helper thread
    every `step` bytes), so the fsync that makes the finished archive durable before its rename (kit/atomic.py)
    has only the last piece left to write instead of the whole archive."""

    def __init__(self, fh, step: int = 32 << 20):
        import threading

        self._fh, self._step, self._since = fh, step, 0
        self._wake = threading.Event()
        self._done = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kit-writeback")
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(timeout=1.0)  # also on a clock: a zstd process writes to the file directly
            self._wake.clear()
            if self._done:
                return
            try:
                os.fdatasync(self._fh.fileno())
            except OSError as exc:  # reported by close(); the final fsync would hit the same error
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

    def tell(self) -> int:
        return self._fh.tell()

    def fileno(self) -> int:
        return self._fh.fileno()

    @property
    def name(self) -> str:
        return getattr(self._fh, "name", "archive")

    def flush(self) -> None:
        self._fh.flush()

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


def manifest_bytes(manifest: dict) -> bytes:
    return json_bytes(manifest)


def _corrupt(path, exc: BaseException) -> EnvArchiveError:
    return ArchiveDamagedError(
        f"archive {str(path)!r} is corrupt, truncated or not a tar archive ({exc}); "
        f"re-create it with `python -m kit env pack` (or kit.envs.pack)."
    )


def _is_stream_error(exc: BaseException) -> bool:
    """Errors of the decompressors and of parsing a damaged stream (zstandard.ZstdError, zlib.error, ...)."""
    return isinstance(exc, (zlib.error, EOFError, UnicodeDecodeError)) or type(exc).__module__.startswith(
        "zstd"
    )


def _json(data: bytes, what: str, path) -> dict:
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


def read_manifest(path: os.PathLike | str) -> Optional[dict]:
    """What a kit archive is (its first member: kind, name, old prefix, ...), or None for other archives.

    Reads only the start of the archive. Archives of kit versions before the member list carried their
    manifest last; unpack() still reads those, this returns None for them.
    """
    reader = TarReader(path)
    try:
        for member in reader.members():
            if _clean_name(member.raw_name) == MANIFEST and member.kind == "f":
                return _json(reader.read_data(member.size), MANIFEST, path)
            return None
    except EnvArchiveError:
        raise
    except Exception as exc:
        if _is_stream_error(exc):
            raise _corrupt(path, exc) from exc
        raise
    finally:
        reader.close()
    return None


def _clean_name(name: str) -> str:
    """Normalise a member name; raise on absolute names and `..` parts."""
    if not name.startswith("/") and "/." not in "/" + name and "//" not in name and "\\" not in name:
        return name.rstrip("/")  # the common case: nothing to normalise (checked per member, so kept cheap)
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise EnvArchiveError(f"archive member {name!r} has an absolute path; refusing to extract it.")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise EnvArchiveError(
            f"archive member {name!r} contains '..'; refusing to extract outside the target."
        )
    return "/".join(parts)


def _inside(root: str, path: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _write_all(fd: int, view) -> None:
    while view:
        view = view[os.write(fd, view) :]


_ZEROS = memoryview(bytes(BLOCK))


def gnu_tar() -> Optional[str]:
    """The GNU tar program that extraction hands its writes to (KIT_TAR_PROGRAM=0: the kit writes every file)."""
    return gnu_program("tar")


class _TarFeed:
    """Files, folders and hard links that _Extractor has checked, written by GNU tar in a process of its own
    (creating thousands of files is where unpacking spends its time; `tar -x` does it while this process
    decompresses, checks and hashes the next members). tar gets the archive's own headers only for plain members
    (TarReader.plain_run: headers tar reads exactly as the kit does); every other member it gets is re-written
    here from the checked fields (clean name, mode without setuid/setgid/sticky bits, no owner), so what tar
    writes is exactly what the checks allowed. Symbolic links are not passed on: the extractor makes them itself
    once everything else is written."""

    RECORD = 256 * BLOCK  # tar reads in 128 KiB records (-b 256); the stream ends padded to a whole record

    def __init__(self, exe: str, root: str):
        import subprocess
        import tempfile

        self._err = (
            tempfile.TemporaryFile()
        )  # a file, not a pipe: many warnings could fill a pipe and stall tar
        self._proc = subprocess.Popen(
            # -p: modes as given (the checks already dropped special bits); --no-same-owner: files belong to
            # whoever unpacks, also as root; -B: whole records from a pipe
            [exe, "-x", "-f", "-", "-C", root, "-b", "256", "-B", "-p", "--no-same-owner"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=self._err,
            preexec_fn=dies_with_parent(),
        )
        self._fd = self._proc.stdin.fileno()
        try:
            import fcntl

            fcntl.fcntl(self._fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
        except OSError:
            pass  # a smaller pipe only means more switches between the two processes
        self._parts: list = []  # headers, views of data and padding, written with one writev
        self._size = 0
        self.written = 0

    def _header(self, name: str, kind: bytes, mode: int, size: int, mtime: int, linkname: str = "") -> bytes:
        mtime = int(mtime)
        fast = (
            plain_header(name, kind, mode, size, mtime)
            if not linkname
            else _ustar(name, mode, 0, 0, size, mtime, kind, linkname, "", "")
        )
        if fast is not None:
            return fast
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.size, info.mtime, info.linkname = kind, mode, size, mtime, linkname
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def folder(self, name: str, mode: int, mtime: int) -> None:
        self.data(self._header(name + "/", tarfile.DIRTYPE, mode, 0, mtime))

    def hardlink(self, name: str, other: str, mtime: int) -> None:
        self.data(self._header(name, tarfile.LNKTYPE, 0o644, 0, mtime, other))

    def file_header(self, name: str, mode: int, size: int, mtime: int) -> None:
        mtime = int(mtime)
        self.data(
            plain_header(name, tarfile.REGTYPE, mode, size, mtime)
            or self._header(name, tarfile.REGTYPE, mode, size, mtime)
        )

    def data(self, piece) -> None:
        """A header, data (a view into the decompressed chunk, written from there: no copy here) or padding."""
        self._parts.append(piece)
        self._size += len(piece)
        if self._size >= 1 << 20 or len(self._parts) >= 512:  # IOV_MAX is 1024 on Linux
            self.flush()

    def flush(self) -> None:
        parts, self._parts, self._size = self._parts, [], 0
        try:
            while parts:  # a pipe takes it all unless a signal interrupts; then go on from where it stopped
                n = os.writev(self._fd, parts)
                self.written += n
                i = 0
                while i < len(parts) and n >= len(parts[i]):
                    n -= len(parts[i])
                    i += 1
                parts = parts[i:]
                if parts and n:
                    parts[0] = memoryview(parts[0])[n:]
        except BrokenPipeError:
            self.close()  # raises tar's own error
            raise

    def close(self) -> None:
        """End the stream (tar's end-of-archive blocks, padded to a record), wait for tar, raise what it met."""
        if self._proc.stdin and not self._proc.stdin.closed:
            end = 2 * BLOCK + (-(self.written + self._size + 2 * BLOCK) % self.RECORD)
            self._parts.append(bytes(end))
            try:
                self.flush()
            except BrokenPipeError:
                pass  # tar stopped early: its exit status and message say why
            self._proc.stdin.close()
        code = self._proc.wait()
        self._err.seek(0)
        err = self._err.read().decode("utf-8", "replace").strip()
        self._err.close()
        if code != 0:
            last = err.splitlines()[-1] if err else f"exit status {code}"
            if "No space left" in err:
                raise OSError(errno.ENOSPC, "No space left on device", last)
            raise EnvArchiveError(f"tar failed while writing the unpacked files: {last}")

    def abort(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        if self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        self._proc.wait()
        self._err.close()


class _Extractor:
    """Writes members under `root`, refusing anything that would land outside it; records what it wrote."""

    def __init__(self, root: str, reader: TarReader, progress, feed: Optional[_TarFeed] = None):
        self.root, self.reader, self.progress = root, reader, progress
        self.feed = feed  # when set, GNU tar writes files, folders and hard links (see _TarFeed)
        self.hard: set = set()  # hard-link members (with feed: names known to be files without a filesystem)
        self.dirs = {""}  # folders (relative) known to be real folders under root, not links
        self.links: list = []
        self.link_names: set = set()
        self.regular: set = set()
        self.seen: list = []
        self.counts = {"files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0, "bytes": 0}
        self.umask = os.umask(0o022)
        os.umask(self.umask)
        # one-shot digest for plain(), set once the archive names its hash
        self.digest: Optional[Callable] = None

    def folder(self, rel: str) -> str:
        """Make sure root/rel is a real folder (made here, or checked not to be a link); return its path."""
        path = f"{self.root}/{rel}" if rel else self.root
        if rel in self.dirs:
            return path
        if rel in self.link_names:
            raise EnvArchiveError(
                f"archive member {rel!r} is a symbolic link of the same archive used as a folder; refusing "
                f"to extract through it."
            )
        self.folder(rel.rpartition("/")[0])
        if self.feed is not None:  # an empty target: only this archive's members can be in the way
            if rel in self.regular or rel in self.hard:
                raise self._not_a_folder(rel)
            self.feed.folder(rel, 0o755, 0)  # a parent the archive does not list, as os.mkdir makes it
        else:
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise self._not_a_folder(rel) from None
        self.dirs.add(rel)
        return path

    @staticmethod
    def _not_a_folder(rel: str) -> EnvArchiveError:
        return EnvArchiveError(
            f"archive member {rel!r} needs a folder where the target has a file or link; refusing to extract it."
        )

    def _through_link(self, name: str) -> None:
        # Links are made last, so until then a link's name used as a folder is a real folder made here
        # (folder() refuses that) and one used as a file is caught here; nothing is written through a link.
        if name in self.link_names:
            raise EnvArchiveError(
                f"archive member {name!r} goes through (or replaces) a symbolic link of the same archive; "
                f"refusing to extract it."
            )

    def _open_new(self, dest: str, mode: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            return os.open(dest, flags, mode)
        except FileExistsError:
            if stat.S_ISDIR(os.lstat(dest).st_mode):
                raise self._file_and_folder(os.path.relpath(dest, self.root)) from None
            os.unlink(dest)  # a later member of the same name replaces the earlier one, as tar does
            return os.open(dest, flags, mode)

    @staticmethod
    def _file_and_folder(rel: str) -> EnvArchiveError:
        return EnvArchiveError(f"archive has both a folder and a file at {rel!r}; refusing it.")

    def _feed_file(self, m, name: str, hash_name: Optional[str]) -> None:
        """A checked file member passed on to tar (a later member of the same name replaces it, as tar does)."""
        if name in self.dirs:
            raise self._file_and_folder(name)
        feed = self.feed
        feed.file_header(name, m.mode & 0o777, m.size, m.mtime)  # setuid/setgid/sticky bits dropped
        digest = self._copy_data(m.size, feed.data, hash_name)
        if m.size % BLOCK:
            feed.data(_ZEROS[: BLOCK - m.size % BLOCK])
        self._file_done(name, m.size, digest)

    def _copy_data(self, size: int, write: Callable, hash_name: Optional[str]) -> str:
        """Pass a member's data to write(view), hashed when the archive names a hash; the hex digest or ''."""
        if not hash_name:
            self.reader.copy(size, write)
            return ""
        h = new_hasher(hash_name)

        def sink(view) -> None:
            h.update(view)
            write(view)

        self.reader.copy(size, sink)
        return h.hexdigest()

    def _file_done(self, name: str, size: int, digest: str) -> None:
        self.hard.discard(name)
        self.regular.add(name)
        self.counts["files"] += 1
        self.counts["bytes"] += size
        self.seen.append([name, "f", size, digest])
        if self.progress:
            self.progress(size)

    def plain(self, name: str, kind: str, mode: int, size: int, mtime: int, data) -> bool:
        """Record a plain file or folder that TarReader.plain_run() passes on to tar unchanged; False (nothing
        recorded) for anything member() would do more with: a missing parent, a name in use as another kind, a
        link's name."""
        if name in self.link_names or name.rpartition("/")[0] not in self.dirs:
            return False
        if kind == "d":
            if name in self.regular or name in self.hard:
                return False
            self.dirs.add(name)
            self.counts["dirs"] += 1
            self.seen.append([name, "d", 0, ""])
            return True
        if name in self.dirs:
            return False
        self._file_done(name, size, self.digest(data) if self.digest else "")
        return True

    def member(self, m, hash_name: Optional[str], name: Optional[str] = None) -> None:
        """Check member `m` and write it (or pass it to tar); `name` is its cleaned name when known already."""
        name = _clean_name(m.raw_name) if name is None else name
        if not name:
            return
        self._through_link(name)
        parent, _, _base = name.rpartition("/")
        if m.kind == "d":
            path = self.folder(name)
            if self.feed is not None:
                self.feed.folder(name, (m.mode & 0o777) | 0o700, m.mtime)
            else:
                os.chmod(path, (m.mode & 0o777) | 0o700)
            self.counts["dirs"] += 1
            self.seen.append([name, "d", 0, ""])
            return
        dest = f"{self.folder(parent)}/{_base}"
        if m.kind == "f" and self.feed is not None:
            self._feed_file(m, name, hash_name)
        elif m.kind == "f":
            mode = m.mode & 0o777  # setuid/setgid/sticky bits dropped on purpose
            fd = self._open_new(dest, mode)
            try:
                digest = self._copy_data(m.size, lambda view: _write_all(fd, view), hash_name)
                if mode & self.umask:  # open() applied the umask; only then is a second call needed
                    os.fchmod(fd, mode)
                os.utime(fd, (m.mtime, m.mtime))
            finally:
                os.close(fd)
            self._file_done(name, m.size, digest)
        elif m.kind == "l":
            if os.path.isabs(m.linkname):
                raise EnvArchiveError(
                    f"archive member {m.raw_name!r} is a link to the absolute path {m.linkname!r}; "
                    f"refusing to extract it."
                )
            resolved = os.path.normpath(os.path.join(os.path.dirname(dest), m.linkname))
            if not _inside(self.root, resolved):
                raise EnvArchiveError(
                    f"archive member {m.raw_name!r} links to {m.linkname!r}, outside the target; "
                    f"refusing to extract it."
                )
            self.links.append((dest, m.linkname))
            self.link_names.add(name)
            self.seen.append([name, "l", 0, m.linkname])
        elif m.kind == "h":
            other = _clean_name(m.linkname)
            if other not in self.regular:
                raise EnvArchiveError(
                    f"archive member {m.raw_name!r} is a hard link to {m.linkname!r}, which is not a file "
                    f"extracted before it; refusing to extract it."
                )
            if self.feed is not None:
                if name in self.dirs:
                    raise self._file_and_folder(name)
                self.feed.hardlink(name, other, m.mtime)
                self.regular.discard(name)
            else:
                if os.path.lexists(dest):
                    if os.path.isdir(dest) and not os.path.islink(dest):
                        raise self._file_and_folder(name)
                    os.unlink(dest)
                os.link(os.path.join(self.root, *other.split("/")), dest)
            self.hard.add(name)
            self.counts["hardlinks"] += 1
            self.seen.append([name, "h", 0, other])
        else:
            raise EnvArchiveError(
                f"archive member {m.raw_name!r} is a device, FIFO or other special file; environments never "
                f"contain those, refusing to extract it."
            )

    def finish_writes(self) -> None:
        """Wait until tar has written everything passed on (raises what it met); nothing to do without it."""
        if self.feed is not None:
            feed, self.feed = self.feed, None
            feed.close()

    def abort(self) -> None:
        if self.feed is not None:
            feed, self.feed = self.feed, None
            feed.abort()

    def make_links(self) -> None:
        for dest, linkname in self.links:
            if os.path.lexists(dest):
                raise EnvArchiveError(
                    f"archive has both a file and a link at {os.path.relpath(dest, self.root)!r}; refusing it."
                )
            os.symlink(linkname, dest)
            self.counts["symlinks"] += 1
        for dest, linkname in self.links:
            # Chains of links can climb out although each one looks inside on its own (a -> ., b -> a/..).
            if not _inside(self.root, os.path.realpath(dest)):
                raise EnvArchiveError(
                    f"link {os.path.relpath(dest, self.root)!r} -> {linkname!r} resolves outside the "
                    f"target through other links; refusing the archive."
                )


def _first_difference(path, seen: list, expected: list) -> ArchiveDamagedError:
    for i, want in enumerate(expected):
        got = seen[i] if i < len(seen) else None
        if got != want:
            if got is None:
                what = f"member {want[0]!r} and {len(expected) - i - 1} after it are missing"
            elif got[0] != want[0]:
                what = f"member {i} is {got[0]!r} where the member list has {want[0]!r}"
            elif got[2] != want[2]:
                what = f"member {want[0]!r} has {got[2]} bytes where the member list has {want[2]}"
            else:
                what = f"member {want[0]!r} differs from its hash (damaged data)"
            break
    else:
        what = f"{len(seen) - len(expected)} members are not in the member list"
    return ArchiveDamagedError(
        f"archive {str(path)!r} is damaged or incomplete: {what}; copy it again from its source or re-create "
        f"it with `python -m kit env pack`."
    )


def extract(
    archive: os.PathLike | str, target: os.PathLike | str, progress: Optional[Callable[[int], None]] = None
) -> tuple:
    """Extract into the existing folder `target`, checking every member; return (counts, manifest or None).

    A kit archive must end with its member list and every member must match it (name, type, size, hash);
    another archive (`conda pack`, `tar`) must at least end with tar's end-of-archive block and a complete
    compressed stream. Members or links that would land outside `target` are refused, links are made last.
    """
    root = os.path.realpath(target)
    reader = TarReader(archive)
    exe = gnu_tar()
    try:
        # tar writes only into an empty target: there nothing but this archive's members can be in the way
        feed = _TarFeed(exe, root) if exe and not any(os.scandir(root)) else None
    except BaseException:
        reader.close()
        raise
    ex = _Extractor(root, reader, progress, feed)
    head = trailer = legacy = hash_name = None
    try:
        first = True
        members = reader.members()
        while True:
            if feed is not None and not first and trailer is None:
                # runs of plain members go to tar as they are in the stream, checked but not re-written
                run = reader.plain_run(ex.plain)
                if run is not None:
                    feed.data(run)
            m = next(members, None)
            if m is None:
                break
            name = _clean_name(m.raw_name)
            if trailer is not None:
                raise ArchiveDamagedError(
                    f"archive {str(archive)!r} has members after its member list; it was altered, re-create it."
                )
            if first and name == MANIFEST and m.kind == "f":
                head = _json(reader.read_data(m.size), MANIFEST, archive)
                if int(head.get("kit_archive", 0)) > ARCHIVE_VERSION:
                    raise EnvArchiveError(
                        f"archive {str(archive)!r} was written by a newer kit (format {head['kit_archive']}); "
                        f"update the kit to unpack it."
                    )
                hash_name = head.get("hash")
                ex.digest = digest_of(hash_name) if hash_name else None
                first = False
                continue
            first = False
            if head is not None and name == TRAILER and m.kind == "f":
                trailer = _json(reader.read_data(m.size), TRAILER, archive)
                continue
            if head is None and name == MANIFEST and m.kind == "f":  # kit archives before the member list
                legacy = _json(reader.read_data(m.size), MANIFEST, archive)
                continue
            ex.member(m, hash_name, name)
        reader.drain()
        ex.finish_writes()
    except EnvArchiveError:
        raise
    except Exception as exc:
        if _is_stream_error(exc):
            raise _corrupt(archive, exc) from exc
        raise
    finally:
        ex.abort()  # tar stopped (no-op after finish_writes); what it wrote is the caller's to remove
        reader.close()
    if head is not None:
        if trailer is None:
            raise ArchiveDamagedError(
                f"archive {str(archive)!r} is incomplete: it stops after {len(ex.seen)} members, before its "
                f"member list; copy it again from its source or re-create it with `python -m kit env pack`."
            )
        if ex.seen != trailer.get("members"):
            raise _first_difference(archive, ex.seen, trailer.get("members") or [])
    elif not reader.ended:
        raise ArchiveDamagedError(
            f"archive {str(archive)!r} is truncated: it has no end-of-archive block after its "
            f"{len(ex.seen)} members; copy it again or re-create it with `python -m kit env pack`."
        )
    ex.make_links()
    manifest = legacy
    if head is not None:
        manifest = dict(head, **{k: v for k, v in trailer.items() if k != "members"})
    return ex.counts, manifest


def safe_extract(
    archive: os.PathLike | str, target: os.PathLike | str, progress: Optional[Callable[[int], None]] = None
) -> dict:
    """Extract into the existing folder `target` (see extract()); return counts of what was written."""
    return extract(archive, target, progress)[0]


def archive_size(path: os.PathLike | str) -> int:
    return Path(path).stat().st_size
