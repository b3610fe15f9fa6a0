"""Safe extraction: tarfile parses, the kit writes each member itself, buying what tarfile's 'data' filter lacks:
data hashed as it lands and checked against the member list; links made last, so a link chain that climbs out, a
member written through a link of the archive, a file where a folder was, or a hard link to a member not extracted
is refused; special files refused. (The filter itself is not run: it resolves every member's path on disk.)"""

from __future__ import annotations

import os
import stat
import tarfile
from typing import Callable, Optional

from kit.envs.archive import (
    ARCHIVE_VERSION,
    CHUNK,
    MANIFEST,
    TRAILER,
    Stream,
    corrupt,
    is_stream_error,
    json_member,
    new_hasher,
)
from kit.envs.errors import ArchiveDamagedError, EnvArchiveError
from kit.envs.prefix import umask, write_all

_END = bytes(512)  # tar's end-of-archive block


def _clean_name(name: str) -> str:
    """Normalise a member name; raise on absolute names and `..` parts."""
    if not name.startswith("/") and "/." not in "/" + name and "//" not in name and "\\" not in name:
        return name.rstrip("/")  # the common case: nothing to normalise
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


class _Extractor:
    """Writes members under `root`, refusing anything that would land outside it; records what it wrote."""

    def __init__(self, root: str, stream: Stream, progress):
        self.root, self.stream, self.progress = root, stream, progress
        self.tar = tarfile.open(fileobj=stream, mode="r:")
        self.dirs = {""}  # folders (relative) known to be real folders under root, not links
        self.regular: set = set()
        self.hard: set = set()
        self.links: list = []
        self.link_names: set = set()
        self.seen: list = []
        self.counts = {"files": 0, "dirs": 0, "symlinks": 0, "hardlinks": 0, "bytes": 0}
        self.umask = umask()

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
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise EnvArchiveError(
                    f"archive member {rel!r} needs a folder where the target has a file or link; refusing to "
                    f"extract it."
                ) from None
        self.dirs.add(rel)
        return path

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

    def _write(self, m: tarfile.TarInfo, name: str, dest: str, hash_name: Optional[str]) -> None:
        mode = m.mode & 0o777  # setuid/setgid/sticky bits dropped on purpose
        fd = self._open_new(dest, mode)
        h = new_hasher(hash_name) if hash_name else None
        try:
            # the data follows the header in the stream (or, sparse, comes through tarfile's own reader)
            src = (
                self.stream
                if self.stream.tell() == m.offset_data and not m.issparse()
                else self.tar.extractfile(m)
            )
            left = m.size
            while left:
                data = src.read(min(left, CHUNK))
                if not data:
                    raise tarfile.ReadError("unexpected end of data")
                left -= len(data)
                if h is not None:
                    h.update(data)
                write_all(fd, data)
            if src is self.stream:
                src.read(-m.size % 512)  # the padding too: tarfile then finds the next header where it is
            if mode & self.umask:  # open() applied the umask; only then is a second call needed
                os.fchmod(fd, mode)
            os.utime(fd, (m.mtime, m.mtime))
        finally:
            os.close(fd)
        self.hard.discard(name)
        self.regular.add(name)
        self.counts["files"] += 1
        self.counts["bytes"] += m.size
        self.seen.append([name, "f", m.size, h.hexdigest() if h is not None else ""])
        if self.progress:
            self.progress(m.size)

    def member(self, m: tarfile.TarInfo, name: str, hash_name: Optional[str]) -> None:
        """Check member `m` (cleaned name `name`) and write it; links are only recorded, make_links() makes them."""
        if not name:
            return
        if name in self.link_names:
            # links are made last: until then a link's name used as a folder is a real folder made here (folder()
            # refuses that) and one used as a file is caught here; nothing is written through a link
            raise EnvArchiveError(
                f"archive member {name!r} goes through (or replaces) a symbolic link of the same archive; "
                f"refusing to extract it."
            )
        parent, _, base = name.rpartition("/")
        if m.isdir():
            os.chmod(self.folder(name), (m.mode & 0o777) | 0o700)
            self.counts["dirs"] += 1
            self.seen.append([name, "d", 0, ""])
            return
        dest = f"{self.folder(parent)}/{base}"
        if m.isreg():
            self._write(m, name, dest, hash_name)
        elif m.issym():
            if os.path.isabs(m.linkname):
                raise EnvArchiveError(
                    f"archive member {m.name!r} is a link to the absolute path {m.linkname!r}; refusing to "
                    f"extract it."
                )
            if not _inside(self.root, os.path.normpath(os.path.join(os.path.dirname(dest), m.linkname))):
                raise EnvArchiveError(
                    f"archive member {m.name!r} links to {m.linkname!r}, outside the target; refusing to extract it."
                )
            self.links.append((dest, m.linkname))
            self.link_names.add(name)
            self.seen.append([name, "l", 0, m.linkname])
        elif m.islnk():
            other = _clean_name(m.linkname)
            if other not in self.regular:
                raise EnvArchiveError(
                    f"archive member {m.name!r} is a hard link to {m.linkname!r}, which is not a file "
                    f"extracted before it; refusing to extract it."
                )
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
                f"archive member {m.name!r} is a device, FIFO or other special file; environments never "
                f"contain those, refusing to extract it."
            )

    def make_links(self) -> None:
        for dest, linkname in self.links:
            if os.path.lexists(dest):
                raise EnvArchiveError(
                    f"archive has both a file and a link at {os.path.relpath(dest, self.root)!r}; refusing it."
                )
            os.symlink(linkname, dest)
            self.counts["symlinks"] += 1
        for dest, linkname in self.links:
            # chains of links can climb out although each one looks inside on its own (a -> ., b -> a/..)
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


def _read_members(archive, ex: _Extractor) -> tuple:
    """Extract every member; return (manifest first, member list last, legacy manifest) as found."""
    tar, head, trailer, legacy, hash_name = ex.tar, None, None, None, None
    for i, m in enumerate(iter(tar.next, None)):
        name = _clean_name(m.name)
        if trailer is not None:
            raise ArchiveDamagedError(
                f"archive {str(archive)!r} has members after its member list; it was altered, re-create it."
            )
        ours = name == (TRAILER if head is not None else MANIFEST)  # head: a manifest first, else legacy
        if not (m.isreg() and ours):
            ex.member(m, name, hash_name)
            continue
        data = json_member(tar.extractfile(m).read(), name, archive)
        if i == 0:
            head, hash_name = data, data.get("hash")
            if int(head.get("kit_archive", 0)) > ARCHIVE_VERSION:
                raise EnvArchiveError(
                    f"archive {str(archive)!r} was written by a newer kit (format {head['kit_archive']}); "
                    f"update the kit to unpack it."
                )
            if hash_name:
                new_hasher(hash_name)  # an unknown hash, or xxhash missing: one clear line before any write
        elif name == TRAILER:
            trailer = data
        elif head is None:  # kit archives before the member list carried their manifest last
            legacy = data
    return head, trailer, legacy


def extract(
    archive: os.PathLike | str, target: os.PathLike | str, progress: Optional[Callable[[int], None]] = None
) -> tuple:
    """Extract into the existing folder `target`, checking every member; return (counts, manifest or None).

    A kit archive must end with its member list and every member must match it (name, type, size, hash);
    another archive (`conda pack`, `tar`) must at least end with tar's end-of-archive block and a complete
    compressed stream. Members or links that would land outside `target` are refused, links are made last.
    """
    stream = Stream(str(archive))
    try:
        ex = _Extractor(os.path.realpath(target), stream, progress)
        head, trailer, legacy = _read_members(archive, ex)
        ended = stream.last == _END
        stream.drain()
    except EnvArchiveError:
        raise
    except Exception as exc:
        if is_stream_error(exc):
            raise corrupt(archive, exc) from exc
        raise
    finally:
        stream.close()
    if head is not None:
        if trailer is None:
            raise ArchiveDamagedError(
                f"archive {str(archive)!r} is incomplete: it stops after {len(ex.seen)} members, before its "
                f"member list; copy it again from its source or re-create it with `python -m kit env pack`."
            )
        if ex.seen != trailer.get("members"):
            raise _first_difference(archive, ex.seen, trailer.get("members") or [])
    elif not ended:
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
