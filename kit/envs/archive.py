"""Environment archives: tar.zst (multithreaded), tar.gz (parallel or plain gzip), tar; safe extraction."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import zlib
from pathlib import Path
from typing import IO, Callable, Iterator, Optional

from kit.errors import KitError

FORMATS = ("tar.zst", "tar.gz", "tar")
MANIFEST = ".kit-env.json"  # first member of every archive the kit writes: kind, old prefix, files to fix
_CHUNK = 1 << 20


class EnvArchiveError(KitError, ValueError):
    """An archive that is unsafe, corrupt, or in a format the kit cannot read."""


def n_threads(threads: int) -> int:
    """0 or -1 means every core; otherwise the number given (at least 1)."""
    if threads in (0, -1):
        return os.cpu_count() or 1
    return max(1, int(threads))


def format_of(path: os.PathLike | str) -> str:
    """The archive format from the file name ('x.tar.zst' -> 'tar.zst'; .tgz/.tzst accepted)."""
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
    raise EnvArchiveError(
        f"archive name {name!r} has no known suffix; use one of "
        f"{', '.join('.' + f for f in FORMATS)} (or .tgz / .tzst)."
    )


class _ZstdWriter:
    """File-like zstd compressor with a level and worker threads (conda-pack's tar.zst ignores both)."""

    def __init__(self, fileobj: IO[bytes], level: int, threads: int):
        import zstandard

        self._zstd = zstandard
        self._writer = zstandard.ZstdCompressor(level=level, threads=threads).stream_writer(
            fileobj, closefd=False
        )

    def write(self, data) -> int:
        return self._writer.write(data)

    def tell(self) -> int:
        return self._writer.tell()

    def close(self) -> None:
        self._writer.flush(self._zstd.FLUSH_FRAME)
        self._writer.close()


def compressed_writer(fileobj: IO[bytes], fmt: str, level: int = 3, threads: int = 0):
    """Wrap `fileobj` in the compressor for `fmt`; the caller closes the wrapper, then the file."""
    if fmt == "tar.zst":
        return _ZstdWriter(fileobj, level=level, threads=n_threads(threads))
    if fmt == "tar.gz":
        level = min(max(level, 1), 9)
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


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8")


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    """Add an in-memory file to an open tar."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def _detect(fh: IO[bytes]) -> str:
    head = fh.read(4)
    fh.seek(0)
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head == b"\x28\xb5\x2f\xfd":
        return "tar.zst"
    return "tar"


def iter_members(path: os.PathLike | str) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
    """Stream (tar, member) pairs from an archive of any kit format, detected from its first bytes."""
    with open(path, "rb") as raw:
        fmt = _detect(raw)
        if fmt == "tar.zst":
            import zstandard

            stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        elif fmt == "tar.gz":
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        else:
            stream = raw
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                yield tar, member


def read_manifest(path: os.PathLike | str) -> Optional[dict]:
    """The kit manifest of an archive, or None (e.g. an archive made by plain `conda pack`)."""
    try:
        for tar, member in iter_members(path):
            if _clean_name(member.name) == MANIFEST:
                return json.loads(tar.extractfile(member).read().decode("utf-8"))
            return None  # the kit always writes it first
    except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError) as exc:
        raise _corrupt(path, exc) from exc
    return None


def _corrupt(path, exc: BaseException) -> EnvArchiveError:
    return EnvArchiveError(
        f"archive {str(path)!r} is corrupt, truncated or not a tar archive ({exc}); "
        f"re-create it with `python -m kit env pack` (or kit.envs.pack)."
    )


def _clean_name(name: str) -> str:
    """Normalise a member name; raise on absolute names and `..` parts."""
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


def safe_extract(
    archive: os.PathLike | str, target: os.PathLike | str, progress: Optional[Callable[[int], None]] = None
) -> dict:
    """Extract into the existing folder `target`; refuse members or links that would land outside it.

    Symbolic links are created after every file, so no member can be written through one; their resolved
    targets must stay inside `target`. Devices and FIFOs are refused. Returns counts.
    """
    root = os.path.realpath(target)
    links: list[tuple[str, str]] = []
    link_names: set[str] = set()
    regular: set[str] = set()
    counts = {"files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0, "bytes": 0}
    try:
        for tar, m in iter_members(archive):
            name = _clean_name(m.name)
            if not name:
                continue
            parents = name.split("/")
            if any("/".join(parents[:i]) in link_names for i in range(1, len(parents) + 1)):
                raise EnvArchiveError(
                    f"archive member {m.name!r} goes through (or replaces) a symbolic link "
                    f"of the same archive; refusing to extract it."
                )
            dest = os.path.join(root, *parents)
            if m.isdir():
                os.makedirs(dest, exist_ok=True)
                os.chmod(dest, (m.mode & 0o777) | 0o700)
                counts["dirs"] += 1
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if not _inside(root, os.path.realpath(os.path.dirname(dest))):
                raise EnvArchiveError(f"archive member {m.name!r} would land outside {root}.")
            if m.isreg():
                src = tar.extractfile(m)
                if os.path.lexists(dest):
                    os.unlink(dest)
                with open(dest, "wb") as out:
                    while True:
                        chunk = src.read(_CHUNK)
                        if not chunk:
                            break
                        out.write(chunk)
                        if progress:
                            progress(len(chunk))
                os.chmod(dest, m.mode & 0o777)  # setuid/setgid/sticky bits dropped on purpose
                os.utime(dest, (m.mtime, m.mtime))
                regular.add(name)
                counts["files"] += 1
                counts["bytes"] += m.size
            elif m.issym():
                if os.path.isabs(m.linkname):
                    raise EnvArchiveError(
                        f"archive member {m.name!r} is a link to the absolute path "
                        f"{m.linkname!r}; refusing to extract it."
                    )
                resolved = os.path.normpath(os.path.join(os.path.dirname(dest), m.linkname))
                if not _inside(root, resolved):
                    raise EnvArchiveError(
                        f"archive member {m.name!r} links to {m.linkname!r}, outside the "
                        f"target; refusing to extract it."
                    )
                links.append((dest, m.linkname))
                link_names.add(name)
            elif m.islnk():
                other = _clean_name(m.linkname)
                if other not in regular:
                    raise EnvArchiveError(
                        f"archive member {m.name!r} is a hard link to {m.linkname!r}, which is "
                        f"not a file extracted before it; refusing to extract it."
                    )
                if os.path.lexists(dest):
                    os.unlink(dest)
                os.link(os.path.join(root, *other.split("/")), dest)
                counts["hardlinks"] += 1
            else:
                raise EnvArchiveError(
                    f"archive member {m.name!r} is a device, FIFO or other special file; "
                    f"environments never contain those, refusing to extract it."
                )
    except EnvArchiveError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise _corrupt(archive, exc) from exc
    except Exception as exc:  # zstandard.ZstdError and friends
        if type(exc).__module__.startswith("zstd"):
            raise _corrupt(archive, exc) from exc
        raise
    for dest, linkname in links:
        if os.path.lexists(dest):
            raise EnvArchiveError(f"archive has both a file and a link at {os.path.relpath(dest, root)!r}.")
        os.symlink(linkname, dest)
        counts["symlinks"] += 1
    for dest, linkname in links:
        # Chains of links can climb out although each one looks inside on its own (a -> ., b -> a/..).
        if not _inside(root, os.path.realpath(dest)):
            raise EnvArchiveError(
                f"link {os.path.relpath(dest, root)!r} -> {linkname!r} resolves outside the "
                f"target through other links; refusing the archive."
            )
    return counts


def archive_size(path: os.PathLike | str) -> int:
    return Path(path).stat().st_size
