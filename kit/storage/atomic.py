"""Outputs that appear only when complete: temporary names, then rename; never overwrite unless asked."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional, Union

from kit.errors import KitError, OutputError, current_language

# the file a stage writes last into its output folder (kit.core.manifest): a folder that holds it is complete
MANIFEST_NAME = "kit_manifest.json"

PathLike = Union[str, "os.PathLike[str]"]


class OutputExistsError(KitError, FileExistsError):
    """An output already exists and overwrite was not requested."""


# The refusal in each language; this layer sits below the catalog (kit.core.messages), which holds this very dict.
EXISTS = {
    "en": "{what} {path!r} already exists; choose another path or pass overwrite=True "
    "(OVERWRITE = True in the notebook, --overwrite on the command line) to replace it.",
    "zh": "{what} {path!r} 已存在；请换一个路径，或传入 overwrite=True"
    "（notebook 中设 OVERWRITE = True，命令行加 --overwrite）以覆盖它。",
}


def refuse_existing(path: PathLike, overwrite: bool, what: str = "output") -> None:
    """Raise OutputExistsError naming the path and the way out, unless it is absent or overwrite is set."""
    if os.path.lexists(path) and not overwrite:
        line = EXISTS.get(current_language(), EXISTS["en"])
        raise OutputExistsError(line.format(what=what, path=str(path)))


def free_bytes(path: PathLike) -> int:
    """Free bytes this user may write on the filesystem that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_space(target: PathLike, needed: int, what: str, free: Optional[int] = None) -> None:
    """Refuse to start (OutputError, ENOSPC) when the filesystem of `target` cannot hold `needed` bytes (+5 %,
    +64 MiB); `free`: the free bytes measured before a copy started beside the scan (default: measured now)."""
    want = int(needed * 1.05) + (64 << 20)
    free = free_bytes(target) if free is None else free
    if free < want:
        raise OutputError(
            errno.ENOSPC,
            f"not enough space for {what} at {str(target)!r}: about {want / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free; free space there or choose another folder (on ModelArts, "
            f"/home/ma-user/work is the persistent volume; EVS can be expanded).",
        )


def _temp_name(final: Path) -> Path:
    """A fresh hidden name beside `final` (what tempfile would pick; tempfile is not imported: it costs a CLI's
    start-up a few ms, and its `random` more)."""
    return final.with_name(f".{final.name}.partial-{os.urandom(6).hex()}")


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def current_umask() -> int:
    """The process's umask (os.umask can only be read by setting it: set the strictest mask for that instant)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def write_all(fd: int, data, path: PathLike = "?") -> None:
    """Write every byte of `data` to `fd` (os.write may write fewer); an OSError names `path`."""
    mv = memoryview(data).cast("B")
    try:
        while len(mv):
            mv = mv[os.write(fd, mv) :]
    except OSError as exc:  # name the file, so disk full / read-only reads as one line about it
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def _before_publish(final: Path) -> None:
    """Called with the lock held, after the body and before the rename (tests pause a writer here)."""


def aside_name(final: Path) -> Path:
    """Where a replaced output waits until its successor is in place (a `.partial-` name: never looks
    finished, and a crash leaves it for the next run to report, kit/storage/partial.py)."""
    return final.with_name(f".{final.name}.partial-old-{os.urandom(6).hex()}")


@contextlib.contextmanager
def atomic_dir(
    final: PathLike,
    overwrite: bool = False,
    what: str = "output folder",
    lock: bool = True,
    before_rename=None,
) -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `final` on success, delete it on any error.

    With `lock` (the default), the lock of `final` (kit/storage/locks.py) is held from the start to the rename, so a
    second writer is refused at once. An output that appeared under `final` meanwhile is never replaced unless
    `overwrite`; a replaced output is moved aside, and deleted only once the new one is in place.
    `before_rename()` runs after the old output has been moved aside and before the new one is renamed in (a
    stage's other files, published with this folder as one unit: the folder, with its manifest, comes last).
    """
    from kit.storage.locks import hold

    final = Path(final)
    with hold(final, what, enabled=lock):
        refuse_existing(final, overwrite, what)
        final.parent.mkdir(parents=True, exist_ok=True)
        while True:
            tmp = _temp_name(final)
            try:
                os.mkdir(tmp, 0o700)  # private while it fills, as mkdtemp makes it
                break
            except FileExistsError:  # 48 random bits taken: pick again
                continue
        os.chmod(tmp, 0o777 & ~current_umask())  # the finished folder gets normal permissions
        old = None
        companions_started = False
        try:
            yield tmp
            # the renames inside the try: a Ctrl-C (or SIGTERM, kit.storage.partial) landing between the body's end and
            # the rename must still remove the temporary folder
            _before_publish(final)
            if os.path.lexists(final):
                if not overwrite:  # appeared while this run worked: a writer that took no lock
                    raise OutputExistsError(
                        f"{what} {str(final)!r} appeared while this run was writing it (a writer that does not "
                        f"take the kit's lock?); it was left as it is and this run's output was discarded — "
                        f"choose another path, or pass --overwrite (OVERWRITE = True) to replace it."
                    )
                # Move the old one aside first so that a crash between the two renames loses nothing.
                old = aside_name(final)
                os.replace(final, old)
            if before_rename is not None:
                companions_started = True
                before_rename()
            os.replace(tmp, final)
        except BaseException:
            # interrupted between the renames: the previous output goes back, unless some of the new unit's
            # files already replaced its companions (then it stays aside, reported as a leftover)
            if old is not None and not companions_started and old.exists() and not os.path.lexists(final):
                os.replace(old, final)
                old = None
            _rmtree(tmp)
            raise
        if old is not None:
            _rmtree(old)


@contextlib.contextmanager
def atomic_file(final: PathLike, mode: str = "wb", overwrite: bool = True) -> Iterator:
    """Open a temporary file beside `final` for writing; fsync and rename on success, delete on error."""
    final = Path(final)
    refuse_existing(final, overwrite, "output file")
    final.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = _temp_name(final)
        try:  # O_EXCL: a new file, never one that appeared under the name (as mkstemp opens it)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            break
        except FileExistsError:
            continue
    os.chmod(tmp, 0o666 & ~current_umask())
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: PathLike, text: str) -> Path:
    """Write text to `path` atomically (replacing it)."""
    with atomic_file(path, "w") as fh:
        fh.write(text)
    return Path(path)
