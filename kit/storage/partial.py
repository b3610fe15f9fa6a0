"""Leftovers of interrupted runs, and SIGTERM handled like Ctrl-C so that runs clean up after themselves.

kit/storage/atomic.py writes every output under a temporary sibling `.NAME.partial-XXXX` and renames it when complete
(training checkpoints: `.partial-iter_*`; the data stage's Megatron files: `NAME.bin.partial-PID`). A run killed
with SIGKILL (or a machine that stops) leaves them behind: they never look finished, but they take space. Every
stage (data, convert, train, env) calls `handle_partials()` on its output folder before it starts: leftovers are
reported with their size, and removed when the user asks (`--clean-partial`, `clean_partial=True`), with the lock
files such runs left (kit/storage/locks.py). The temporary of an output whose lock a live run holds is not a leftover.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import threading
from pathlib import Path
from typing import Iterator, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]
MARK = ".partial-"


def _size(path: str) -> int:
    """Bytes under `path` (links not followed); files that vanish meanwhile count as 0."""
    total = 0
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + dirnames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def is_partial(entry: str, name: Optional[str] = None) -> bool:
    """Whether a file name is a kit temporary: `.NAME.partial-*` (kit/storage/atomic.py), `.partial-iter_*` (training
    checkpoints) or `NAME.bin.partial-PID` / `NAME.idx.partial-PID` (the data stage's Megatron files)."""
    if name is not None:
        return entry.startswith(f".{name}{MARK}")
    if entry.startswith("."):
        return MARK in entry
    head, sep, pid = entry.rpartition(MARK)
    return bool(sep) and pid.isdigit() and head.endswith((".bin", ".idx"))


def find_partials(folder: PathLike, name: Optional[str] = None) -> list:
    """[{"path", "bytes"}] of the leftovers of interrupted runs in `folder` (only those of `name` if given): their
    temporaries (not those of an output whose lock is held by a live run) and the locks they left behind."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    from kit.storage.locks import SUFFIX, holder_gone, holds, live_holder, read_holder

    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if is_partial(entry.name, name):
            owner = entry.name[1:].partition(MARK)[0] if entry.name.startswith(".") else ""
            if owner and not holds(folder / owner) and live_holder(folder / owner):
                continue  # another run is writing that output right now: its temporary is not a leftover
            found.append({"path": entry.path, "bytes": _size(entry.path)})
        elif (
            entry.name == f".{name}{SUFFIX}"
            if name
            else entry.name.startswith(".") and entry.name.endswith(SUFFIX)
        ):
            holder = read_holder(entry.path)
            if holder and holder_gone(holder):  # the lock of a run killed on this host (kit/storage/locks.py)
                found.append({"path": entry.path, "bytes": _size(entry.path)})
    return found


def remove_partials(found: list) -> list:
    """Delete the leftovers find_partials() returned; return the paths removed."""
    removed = []
    for item in found:
        path = item["path"]
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        removed.append(path)
    return removed


def handle_partials(folder: PathLike, clean: bool = False, name: Optional[str] = None) -> dict:
    """Report leftovers in `folder` with their size; remove them when `clean` is set.

    Returns {"found": [{"path", "bytes"}], "removed": [paths], "bytes": total}.
    """
    found = find_partials(folder, name)
    removed = remove_partials(found) if clean else []
    return {"found": found, "removed": removed, "bytes": sum(x["bytes"] for x in found)}


def describe(report: dict) -> Optional[str]:
    """One line about leftovers that were found and not removed (None when there are none)."""
    left = [x for x in report["found"] if x["path"] not in report["removed"]]
    if not left:
        return None
    mib = sum(x["bytes"] for x in left) / 2**20
    return (
        f"{len(left)} leftover partial output(s) of interrupted runs ({mib:.1f} MiB): "
        f"{', '.join(x['path'] for x in left[:3])}{' ...' if len(left) > 3 else ''}; "
        f"rerun with --clean-partial (clean_partial=True) to remove them."
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so the same clean-up runs (the CLI: `error: interrupted`,
    exit 130, for both)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def _interrupt(signum, frame):
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt like Ctrl-C (SIGINT) does, so temporary outputs are
    removed by the same `except BaseException` paths (kit/storage/atomic.py). Python's default for SIGTERM is to end
    at once, leaving them. No-op outside the main thread, where signal handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
