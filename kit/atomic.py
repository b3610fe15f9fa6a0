"""Outputs that appear only when complete: temporary names, then rename; never overwrite unless asked."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Union

from kit.errors import KitError

PathLike = Union[str, "os.PathLike[str]"]


class OutputExistsError(KitError, FileExistsError):
    """An output already exists and overwrite was not requested."""


def refuse_existing(path: PathLike, overwrite: bool, what: str = "output") -> None:
    """Raise OutputExistsError naming the path and the way out, unless it is absent or overwrite is set."""
    if os.path.lexists(path) and not overwrite:
        raise OutputExistsError(
            f"{what} {str(path)!r} already exists; choose another path or pass overwrite=True "
            f"(OVERWRITE = True in the notebook, --overwrite on the command line) to replace it."
        )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_dir(final: PathLike, overwrite: bool = False, what: str = "output folder") -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `final` on success, delete it on any error."""
    final = Path(final)
    refuse_existing(final, overwrite, what)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; the finished folder gets normal permissions
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        # Move the old one aside first so that a crash between the two renames loses nothing.
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


@contextlib.contextmanager
def atomic_file(final: PathLike, mode: str = "wb", overwrite: bool = True) -> Iterator:
    """Open a temporary file beside `final` for writing; fsync and rename on success, delete on error."""
    final = Path(final)
    refuse_existing(final, overwrite, "output file")
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.partial-", dir=final.parent)
    os.chmod(tmp, 0o666 & ~_umask())
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


def atomic_write_bytes(path: PathLike, data: bytes) -> Path:
    """Write bytes to `path` atomically (replacing it)."""
    with atomic_file(path, "wb") as fh:
        fh.write(data)
    return Path(path)
