"""One writer per output: a lock file beside the output, taken before any work and held to the final rename.

Hand-written because the stdlib's locks do not fit: fcntl/flock are advisory per host and unreliable on NFS
(SFS), and the lock must name its holder. A lock is the file `.NAME.lock` beside the output NAME, holding JSON
(host, PID, process start time, since when, what). It is created the NFS-safe way open(2) describes for when
O_EXCL cannot be trusted: write a unique file, link(2) it to the lock name, and count the unique file's links
(2 = ours, even when the reply to link was lost). Where hard links are not supported (some FUSE mounts), the lock
is created with O_CREAT|O_EXCL instead (atomic on local filesystems and NFSv3+).

Stale locks: a lock whose holder ran on this host (same hostname, boot and PID namespace) and is gone (no such
PID, a zombie, or a PID reused by a process that started later) is removed, under a per-holder breaker file so
that two runs breaking the same stale lock cannot remove a live one. A lock held from another host is never
broken automatically: the error says which file to delete once that run is known to be over. A lock records the
inode of its own file, so a copy of it (a run folder copied while that run was writing) is recognised and broken.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Union

from kit.errors import KitError

PathLike = Union[str, "os.PathLike[str]"]
SUFFIX = ".lock"
# link(2) unsupported: FUSE object-store mounts (obsfs/s3fs), some SMB mounts
_NO_LINK = {
    errno.EPERM,
    errno.ENOSYS,
    errno.EXDEV,
    errno.EMLINK,
    getattr(errno, "ENOTSUP", 95),
    errno.EOPNOTSUPP,
}

_held: Dict[str, list] = {}  # lock path -> [thread ident, depth, token]: re-entrant within one thread
_held_guard = threading.Lock()


class LockedError(KitError, RuntimeError):
    """Another run holds the lock of this output."""


def lock_path(target: PathLike) -> Path:
    """The lock file of output `target`: `.NAME.lock` beside it."""
    target = Path(os.path.abspath(target))
    return target.with_name(f".{target.name}{SUFFIX}")


def _read_first_line(path: str) -> Optional[str]:
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            return fh.readline().strip()
    except OSError:
        return None


def _proc_start(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # the name in parentheses may hold spaces
    try:
        return int(fields[19]) if fields[0] != "Z" else -1  # -1: a zombie, as good as gone
    except (IndexError, ValueError):
        return None


def _pid_ns() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def identity() -> Dict[str, Any]:
    """This process as a lock holder."""
    return {
        "host": socket.gethostname(),
        "boot_id": _read_first_line("/proc/sys/kernel/random/boot_id"),
        "pid_ns": _pid_ns(),
        "pid": os.getpid(),
        "started": _proc_start(os.getpid()),
    }


def _same_host(holder: Dict[str, Any], me: Dict[str, Any]) -> bool:
    return all(holder.get(k) == me[k] for k in ("host", "boot_id", "pid_ns"))


def copied(holder: Dict[str, Any], path: PathLike) -> bool:
    """True when the lock file at `path` is not the one its holder created but a copy of it (a run folder copied
    with the locks inside it while that run was writing): it locks nothing."""
    try:
        return isinstance(holder.get("inode"), int) and os.stat(path).st_ino != holder["inode"]
    except OSError:
        return False


def holder_gone(holder: Dict[str, Any]) -> bool:
    """True only when the holder ran on this host and that process no longer runs (never for another host)."""
    me = identity()
    if not _same_host(holder, me):
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    start = _proc_start(pid)
    if start == -1:
        return True
    # a PID reused by a process that started after the holder: the holder is gone
    return start is not None and holder.get("started") is not None and start != holder["started"]


def read_holder(path: PathLike) -> Optional[Dict[str, Any]]:
    """The lock's holder, {} when the file is unreadable or damaged, None when there is no lock."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _content(fd: int, info: Dict[str, Any]) -> bytes:
    """The lock's JSON, with the inode of the file it is written to: a copy of the lock is another inode."""
    return (json.dumps(dict(info, inode=os.fstat(fd).st_ino), sort_keys=True) + "\n").encode()


def _create(path: Path, info: Dict[str, Any]) -> bool:
    """Create `path` holding `info` if it does not exist; True when this call created it."""
    unique = path.with_name(f"{path.name}.{info['token']}")
    try:
        fd = os.open(unique, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            os.write(fd, _content(fd, info))
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:  # read-only, full, no permission: about the lock the user would see, not our name
        with contextlib.suppress(OSError):
            os.unlink(unique)
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        try:
            os.link(unique, path)
            return True
        except FileExistsError:
            return os.stat(unique).st_nlink == 2  # NFS: a retransmitted link can answer EEXIST after success
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                if os.stat(unique).st_nlink == 2:
                    return True
                raise OSError(exc.errno, exc.strerror, str(path)) from None
        # no hard links here: O_EXCL (the content follows at once; a reader in between sees an unreadable lock)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, _content(fd, info))
            os.fsync(fd)
        finally:
            os.close(fd)
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unique)


def _break(path: Path, holder: Dict[str, Any], me: Dict[str, Any]) -> None:
    """Remove the stale lock `holder` of `path`, unless another run is breaking it or it changed meanwhile."""
    breaker = path.with_name(f"{path.name}.break-{holder.get('token', 'none')}")
    if not _create(breaker, dict(me, token=os.urandom(8).hex(), since=_now())):
        return  # another run breaks this one; the caller looks again
    try:
        again = read_holder(path)
        # only the holder of this breaker removes this token's lock, so the lock cannot change between the
        # read and the unlink unless its (gone) holder comes back
        if again is not None and again.get("token") == holder.get("token"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(breaker)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def describe_holder(holder: Dict[str, Any], noun: str = "") -> str:
    if not holder:
        return "an unknown run (the lock file is empty or damaged)"
    what = f" ({holder['what']})" if holder.get("what") and holder["what"] != noun else ""
    return f"PID {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}{what}"


def _locked(target: Path, path: Path, holder: Dict[str, Any], what: str) -> LockedError:
    me = identity()
    if holder and _same_host(holder, me):
        clear = f"wait for it to finish or stop it (kill {holder.get('pid')})"
    else:
        clear = f"wait for it to finish; once that run is known to be over, delete {str(path)!r}"
    return LockedError(
        f"{what} {str(target)!r} is being written by another run: {describe_holder(holder, what)} — {clear}, "
        f"or choose another output."
    )


def acquire(target: PathLike, what: str = "output") -> str:
    """Take the lock of `target` (re-entrant in one thread); return its token. LockedError if another holds it."""
    target = Path(os.path.abspath(target))
    path = lock_path(target)
    key = str(path)
    with _held_guard:
        mine = _held.get(key)
        if mine is not None:
            if mine[0] == threading.get_ident():
                mine[1] += 1
                return mine[2]
            raise _locked(target, path, read_holder(path) or {}, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    me = identity()
    info = dict(me, token=os.urandom(8).hex(), since=_now(), what=what)
    holder: Optional[Dict[str, Any]] = None
    for _ in range(8):  # each round either creates the lock, finds a live holder, or removes a stale one
        if _create(path, info):
            with _held_guard:
                _held[key] = [threading.get_ident(), 1, info["token"]]
            return info["token"]
        holder = read_holder(path)
        if holder is None:
            continue  # released meanwhile
        if holder and (holder_gone(holder) or copied(holder, path)):
            _break(path, holder, me)
            continue
        break
    raise _locked(target, path, holder or {}, what)


def release(target: PathLike) -> None:
    """Give back the lock of `target` taken by acquire() (the file is removed only if it is still ours)."""
    path = lock_path(target)
    key = str(path)
    with _held_guard:
        mine = _held.get(key)
        if mine is None or mine[0] != threading.get_ident():
            return
        mine[1] -= 1
        if mine[1] > 0:
            return
        del _held[key]
    holder = read_holder(path)
    if holder and holder.get("token") == mine[2]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def live_holder(target: PathLike) -> Optional[Dict[str, Any]]:
    """The holder of `target`'s lock unless there is none or it is gone ({} when unknown): a run that cleans
    leftovers beside other outputs skips those that are being written."""
    path = lock_path(target)
    holder = read_holder(path)
    if holder is None or (holder and (holder_gone(holder) or copied(holder, path))):
        return None
    return holder


def check_free(target: PathLike, what: str = "output") -> None:
    """The LockedError acquire() would raise when a live run holds `target`'s lock; nothing is taken."""
    holder = live_holder(target)
    if holder is not None:
        raise _locked(Path(os.path.abspath(target)), lock_path(target), holder, what)


def holds(target: PathLike) -> bool:
    """True when this thread holds the lock of `target`."""
    mine = _held.get(str(lock_path(target)))
    return mine is not None and mine[0] == threading.get_ident()


def covered(target: PathLike) -> bool:
    """True when this thread holds the lock of `target` or of a folder above it (a run's folder covers its
    `hf/`): no lock of its own is needed then."""
    target = Path(os.path.abspath(target))
    return bool(_held) and any(holds(p) for p in (target, *target.parents) if p.name)


@contextlib.contextmanager
def hold(target: PathLike, what: str = "output", enabled: bool = True) -> Iterator[None]:
    """Hold the lock of `target` for the block (see the module doc); `enabled=False` does nothing."""
    if not enabled or covered(target):
        yield
        return
    acquire(target, what)
    try:
        yield
    finally:
        release(target)
