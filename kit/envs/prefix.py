"""What an environment folder is (conda or venv), its size, its python, and fixing its embedded prefix."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from kit.envs.errors import EnvError

DEFAULT_IMPORTS = ("torch", "torch_npu", "deepspeed")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SCAN_LIMIT = 2 << 20  # text files with a prefix are scripts and configs; bigger ones are binaries
_HEAD = 8192  # a file with a NUL byte in its first 8 KiB is binary (what looks_text() reads)
_GNU: dict = {}


def dies_with_parent():
    """A preexec_fn for helper programs (cp, tar, zstd): Linux kills the child when this process dies, so a
    killed clone or unpack does not leave a program writing into its partial output; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(1, 9)  # PR_SET_PDEATHSIG (1), SIGKILL (9)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_death_signal


def gnu_program(name: str) -> Optional[str]:
    """The GNU `name` program (tar, cp) the kit hands bulk file work to, or None: not installed, another
    implementation (their options differ), or KIT_<NAME>_PROGRAM=0; then the kit does that work itself."""
    if os.environ.get(f"KIT_{name.upper()}_PROGRAM", "1") == "0":
        return None
    exe = shutil.which(name)
    if exe and exe not in _GNU:
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, timeout=30).stdout
            _GNU[exe] = out.startswith(f"{name} (GNU ".encode())
        except (OSError, subprocess.SubprocessError):
            _GNU[exe] = False
    return exe if exe and _GNU[exe] else None


def check_name(name: str, what: str = "environment name") -> str:
    """Return `name` if it is a plain folder name, else raise EnvError saying what is allowed."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise EnvError(
            f"{what} {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (no '/', spaces or shell characters), e.g. 'torch-npu-env'."
        )
    return name


@dataclass(frozen=True)
class EnvInfo:
    """One environment: name, folder, kind ('conda' or 'venv') and its python."""

    name: str
    prefix: Path
    kind: str

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"


def kind_of(prefix: os.PathLike | str) -> Optional[str]:
    """'conda' if the folder has conda-meta/, 'venv' if it has pyvenv.cfg, else None."""
    p = Path(prefix)
    if (p / "conda-meta").is_dir():
        return "conda"
    if (p / "pyvenv.cfg").is_file():
        return "venv"
    return None


def env_info(prefix: os.PathLike | str, name: Optional[str] = None) -> EnvInfo:
    """EnvInfo for an existing environment folder; EnvError if it is not one."""
    p = Path(prefix).expanduser().absolute()
    kind = kind_of(p)
    if kind is None:
        raise EnvError(
            f"{str(p)!r} is not an environment (no conda-meta/ and no pyvenv.cfg); pass the folder "
            f"of a conda env or a virtualenv (see kit.envs.list_envs())."
        )
    return EnvInfo(name or p.name, p, kind)


def scan_tree(root: os.PathLike | str) -> list:
    """[(relative name, path, lstat)] of everything under `root`: each folder before its contents, names sorted,
    links not followed. One lstat per entry; pack and clone work from this list (no second walk)."""
    out: list = []
    root = os.fspath(root)

    def walk(folder: str, rel: str) -> None:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for entry in entries:
            name = f"{rel}/{entry.name}" if rel else entry.name
            st = entry.stat(follow_symlinks=False)
            out.append((name, entry.path, st))
            if stat.S_ISDIR(st.st_mode):
                subdirs.append((entry.path, name))
        for path, name in subdirs:
            walk(path, name)

    walk(root, "")
    return out


def tree_totals(entries: list) -> tuple[int, int]:
    """(number of files and links, total bytes) of scan_tree() entries, what walk_tree() counts."""
    count = size = 0
    for _rel, _path, st in entries:
        if not stat.S_ISDIR(st.st_mode):
            count += 1
            size += st.st_size
    return count, size


def walk_tree(root: os.PathLike | str) -> tuple[int, int]:
    """(number of files and links, total bytes) under `root`, links not followed."""
    return tree_totals(scan_tree(root))


def free_bytes(path: os.PathLike | str) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_space(target: os.PathLike | str, needed: int, what: str, free: Optional[int] = None) -> None:
    """Raise EnvError before starting if the target filesystem cannot hold `needed` bytes (+5%, +64 MiB);
    `free`: the free bytes measured before a copy started (default: measured now)."""
    want = int(needed * 1.05) + (64 << 20)
    free = free_bytes(target) if free is None else free
    if free < want:
        raise EnvError(
            f"not enough space for {what} at {str(target)!r}: about {want / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free; free space there or choose another target "
            f"(on ModelArts, /home/ma-user/work is the persistent one; EVS can be expanded)."
        )


def space_checker(target: os.PathLike | str, what: str) -> Callable[[list], tuple]:
    """check(entries) -> tree_totals(entries), raising check_space's EnvError when the target filesystem cannot
    hold them; free space is measured now, before anything is copied, so a copy that runs beside the scan (see
    copy_tree's on_scanned) does not count against itself."""
    free = free_bytes(target)

    def check(entries: list) -> tuple:
        totals = tree_totals(entries)
        check_space(target, totals[1], what, free=free)
        return totals

    return check


def looks_text(data: bytes) -> bool:
    return data.find(b"\0", 0, _HEAD) < 0


def scan_prefix(data: bytes, old: bytes) -> bool:
    """True when `data` is text that mentions the old prefix (and so must be rewritten on relocation).
    The cheap test first: binaries (most of an env's bytes) are never searched."""
    return looks_text(data) and old in data


def rewrite_prefix_files(root: os.PathLike | str, files: Iterable[str], old: str, new: str) -> int:
    """Replace `old` by `new` in the listed text files under `root` (modes kept); return how many changed."""
    changed = 0
    old_b, new_b = old.encode(), new.encode()
    for rel in files:
        path = os.path.join(root, rel)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        if old_b in data:
            mode = os.stat(path).st_mode
            with open(path, "wb") as fh:
                fh.write(data.replace(old_b, new_b))
            os.chmod(path, mode)
            changed += 1
    return changed


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _copy_file(s: str, d: str, st, old_b: bytes, new_b: bytes, umask: int = 0o022) -> tuple[int, bool]:
    """Copy one file (mode and times kept), rewriting the prefix if it is text that holds it.

    Small files are read whole (they must be scanned for the prefix anyway); big ones are copied by the kernel
    (copy_file_range, else sendfile), like `cp` does, without passing through Python.
    """
    mode = stat.S_IMODE(st.st_mode)
    rewritten = False
    try:
        src = os.open(s, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _changed(s, st.st_size, None) from None
    try:
        fd = os.open(d, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode & 0o777)
        try:
            if st.st_size <= SCAN_LIMIT:
                # the first 8 KiB say text or binary; a binary's rest is copied by the kernel (one copy, as
                # cp does), a text's is read to be scanned for the prefix
                data = os.read(src, min(st.st_size, _HEAD))
                binary = not looks_text(data)
                got = len(data)
                if binary and got < st.st_size:
                    _write_all(fd, data)
                    got += _kernel_copy(src, fd, st.st_size - got)
                    data = b""
                while len(data) < st.st_size and not binary:  # short reads are allowed
                    more = os.read(src, st.st_size - len(data))
                    if not more:
                        break
                    data += more
                    got = len(data)
                _check_unchanged(s, st, got, src)
                rewritten = not binary and old_b in data
                if rewritten:
                    data = data.replace(old_b, new_b)
                _write_all(fd, data)
                size = st.st_size if binary else len(data)
            else:
                _check_unchanged(s, st, _kernel_copy(src, fd, st.st_size), src)
                size = st.st_size
            if mode & (umask | 0o7000):  # open() applied the umask (and never sets setuid/setgid/sticky)
                os.fchmod(fd, mode)
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fd)
    finally:
        os.close(src)
    return size, rewritten


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _changed(path: str, size: int, now: Optional[int]) -> EnvError:
    got = "gone now" if now is None else f"{now} now"
    return EnvError(
        f"{path} changed while it was copied ({size} bytes when the env was scanned, {got}); clone again "
        f"when nothing writes to the source env (a running pip or conda install?)."
    )


def _check_unchanged(path: str, st, copied: int, fd: int) -> None:
    """Raise when a file was not copied whole at the size the scan saw, or has grown since (its copy would be a
    mix of two versions, or cut); a truncated file shows up as a short copy."""
    if copied != st.st_size:
        raise _changed(path, st.st_size, copied)
    now = os.fstat(fd).st_size
    if now != st.st_size:
        raise _changed(path, st.st_size, now)


def _kernel_copy(src: int, dst: int, size: int) -> int:
    """Copy up to `size` bytes from the current offsets in the kernel; the number copied (less at end of file)."""
    done = 0
    copy = getattr(os, "copy_file_range", None)
    while done < size:
        try:
            n = copy(src, dst, size - done) if copy else os.sendfile(dst, src, None, size - done)
        except OSError as exc:
            if copy is None or exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            copy = None  # old kernels / some filesystems: sendfile works everywhere on Linux
            continue
        if n == 0:
            break
        done += n
    return done


NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "fuse", "fuse.sshfs", "lustre", "gpfs", "ceph", "9p", "efs")


def is_network_fs(path: os.PathLike | str) -> bool:
    """True when `path` lies on a network filesystem (ModelArts default storage is SFS, mounted over NFS)."""
    p = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if (
                    len(parts) > 2
                    and (p == parts[1] or p.startswith(parts[1].rstrip("/") + "/"))
                    and len(parts[1]) > len(best)
                ):
                    best, fstype = parts[1], parts[2]
    except OSError:
        return False
    return fstype.split(".")[0] in {f.split(".")[0] for f in NETWORK_FS}


def copy_tree(
    src: os.PathLike | str,
    dst: os.PathLike | str,
    new_prefix: str,
    progress=None,
    workers: int = 0,
    entries: Optional[list] = None,
    on_scanned: Optional[Callable[[list], object]] = None,
) -> dict:
    """Copy an env tree into the existing folder `dst`, rewriting `src` to `new_prefix` in text files.

    Symbolic links are copied as links; absolute ones into the source are re-pointed into the copy. On a
    network filesystem (SFS/NFS: every small file costs a round trip) files are copied on 8 threads; on a local
    disk GNU cp copies in a process of its own while this one scans the source and finds the files to rewrite
    (threads of ours are slower there: the interpreter lock changes hands around every short system call), else
    one thread of ours. `entries` is scan_tree(src) when the caller has it already; otherwise the tree is scanned
    here and on_scanned(entries) is called before the copy's result counts (a space check that raises stops the
    copy: with GNU cp it runs beside the first ~0.1 s of copying, whose output the caller removes). Every file
    must still have the size the scan saw once copied, else EnvError names it.
    """
    from concurrent.futures import ThreadPoolExecutor

    src, dst = os.path.abspath(src), os.path.abspath(dst)
    workers = workers or (8 if is_network_fs(dst) else 1)
    exe = gnu_program("cp") if workers == 1 else None
    if exe:  # a local disk: GNU cp copies (network filesystems gain more from several threads of our own)
        return _copy_with_cp(exe, src, dst, new_prefix, entries, progress, on_scanned)
    if entries is None:
        entries = scan_tree(src)
        if on_scanned is not None:
            on_scanned(entries)
    old_b, new_b = src.encode(), new_prefix.encode()
    counts = {"files": 0, "links": 0, "rewritten": 0, "bytes": 0}
    jobs = []
    for rel, s, st in entries:
        d = os.path.join(dst, rel)
        if stat.S_ISDIR(st.st_mode):
            os.mkdir(d, 0o700)
            os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(s)
            if os.path.isabs(target) and (target == src or target.startswith(src + os.sep)):
                target = new_prefix + target[len(src) :]
            os.symlink(target, d)
            counts["links"] += 1
            if progress:
                progress(1)
        elif stat.S_ISREG(st.st_mode):
            jobs.append((s, d, st))
        else:
            raise EnvError(
                f"{s} is a device, socket or FIFO; environments never hold those, remove it first."
            )
    umask = _umask()

    def one(job):
        return _copy_file(*job, old_b, new_b, umask)

    if workers == 1:
        results = map(one, jobs)
    else:
        pool = ThreadPoolExecutor(max_workers=workers)
        results = pool.map(one, jobs, chunksize=64)
    try:
        for size, rewritten in results:
            counts["files"] += 1
            counts["bytes"] += size
            counts["rewritten"] += rewritten
            if progress:
                progress(1)
    finally:
        if workers != 1:
            pool.shutdown()
    return counts


def _special(entries: list) -> None:
    for _rel, s, st in entries:
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode) or stat.S_ISREG(st.st_mode)):
            raise EnvError(
                f"{s} is a device, socket or FIFO; environments never hold those, remove it first."
            )


def _copy_with_cp(
    exe: str, src: str, dst: str, new_prefix: str, entries: Optional[list], progress, on_scanned=None
) -> dict:
    """copy_tree() with GNU cp doing the copying in a process of its own (modes and times kept, links copied as
    links), while this process scans the source (unless `entries` has it) and reads its text files to find those
    that hold the old prefix; then those are rewritten in the copy, absolute links into the source re-pointed,
    and folders made owner-writable, as copy_tree's own copy leaves them. Same result and counts (tested side by
    side)."""
    import tempfile

    old_b, new_b = src.encode(), new_prefix.encode()
    if entries is not None:
        _special(entries)
    err = tempfile.TemporaryFile()
    # --preserve=mode,timestamps: no owners (the copy belongs to whoever clones, also as root) and every hard
    # link a file of its own, as the kit's own copy makes them
    proc = subprocess.Popen(
        [exe, "-R", "--no-dereference", "--preserve=mode,timestamps", "--", f"{src}/.", dst],
        stdout=subprocess.DEVNULL,
        stderr=err,
        preexec_fn=dies_with_parent(),
    )
    try:
        if entries is None:  # the scan that would otherwise come first runs beside cp's copy
            entries = scan_tree(src)
            _special(entries)
            if on_scanned is not None:
                on_scanned(entries)
        counts = {"files": 0, "links": 0, "rewritten": 0, "bytes": 0}
        texts = []
        for rel, s, st in entries:
            if stat.S_ISLNK(st.st_mode):
                counts["links"] += 1
            elif stat.S_ISREG(st.st_mode):
                counts["files"] += 1
                counts["bytes"] += st.st_size
                if 0 < st.st_size <= SCAN_LIMIT and _holds_prefix(s, st.st_size, old_b):
                    texts.append((rel, st))
            else:
                continue
            if progress:
                progress(1)
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err.seek(0)
    message = err.read().decode("utf-8", "replace").strip().splitlines()
    err.close()
    if code != 0:
        last = message[-1] if message else f"exit status {code}"
        if any("No space left" in line for line in message):
            raise OSError(errno.ENOSPC, "No space left on device", last)
        raise EnvError(f"copying {src} failed: {last}")
    for rel, s, st in entries:  # cp copied what it found: a file that changed since the scan differs in size
        if stat.S_ISREG(st.st_mode):
            try:
                now: Optional[int] = os.lstat(os.path.join(dst, rel)).st_size
            except FileNotFoundError:  # removed before cp came to it
                now = None
            if now != st.st_size:
                raise _changed(s, st.st_size, now)
    for rel, st in texts:
        d = os.path.join(dst, rel)
        with open(d, "rb") as fh:
            data = fh.read()
        new = data.replace(old_b, new_b)
        with open(d, "wb") as fh:  # the file cp made: its mode stays
            fh.write(new)
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
        counts["rewritten"] += 1
        counts["bytes"] += len(new) - len(data)
    for rel, s, st in entries:
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(s)
            if os.path.isabs(target) and (target == src or target.startswith(src + os.sep)):
                d = os.path.join(dst, rel)
                os.unlink(d)
                os.symlink(new_prefix + target[len(src) :], d)
        elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o700 != 0o700:
            os.chmod(os.path.join(dst, rel), stat.S_IMODE(st.st_mode) | 0o700)
    return counts


def _holds_prefix(path: str, size: int, old: bytes) -> bool:
    """True when the file is text (no NUL in its first 8 KiB) and mentions `old`; binaries are read no further."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # removed since the scan saw it
        raise _changed(path, size, None) from None
    try:
        data = os.read(fd, min(size, _HEAD))
        if not looks_text(data):
            return False
        while len(data) < size:
            more = os.read(fd, size - len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    return old in data


_VERIFY = r"""
import importlib, importlib.util, json, sys
out = {"prefix": sys.prefix, "executable": sys.executable, "version": sys.version.split()[0], "imports": {}}
for name in sys.argv[1:]:
    if importlib.util.find_spec(name) is None:
        out["imports"][name] = "absent"
        continue
    try:
        mod = importlib.import_module(name)
        out["imports"][name] = "ok " + str(getattr(mod, "__version__", ""))
    except BaseException as exc:
        out["imports"][name] = "error: %s: %s" % (type(exc).__name__, exc)
print("KIT-VERIFY " + json.dumps(out))
"""


def verify(
    prefix: os.PathLike | str,
    imports: Sequence[str] = DEFAULT_IMPORTS,
    env: Optional[dict] = None,
    timeout: float = 900,
) -> dict:
    """Run the env's own python: report sys.prefix, version and each import ('ok', 'absent' or the error).

    Runs in a child process, so torch_npu is imported there only, with `env` (e.g. the CANN variables) added.
    """
    python = Path(prefix) / "bin" / "python"
    if not python.exists():
        raise EnvError(f"{python} does not exist: {str(prefix)!r} has no python; it is not a usable env.")
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
    child_env.update(env or {})
    proc = subprocess.run(
        [str(python), "-c", _VERIFY, *imports],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env,
        cwd=str(prefix),
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("KIT-VERIFY ")), None)
    if proc.returncode != 0 or line is None:
        raise EnvError(
            f"python of {str(prefix)!r} does not run (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-800:]}"
        )
    report = json.loads(line[len("KIT-VERIFY ") :])
    report["ok"] = not any(v.startswith("error") for v in report["imports"].values())
    return report


def find_editable(prefix: os.PathLike | str) -> list[str]:
    """Distributions installed with `pip install -e` (dist-info/direct_url.json says editable)."""
    out = []
    for direct_url in sorted(Path(prefix).glob("lib/python3*/site-packages/*.dist-info/direct_url.json")):
        try:
            if json.loads(direct_url.read_text(encoding="utf-8")).get("dir_info", {}).get("editable") is True:
                out.append(direct_url.parent.name.split("-")[0])
        except (ValueError, OSError):
            continue
    return out


def python_version(prefix: os.PathLike | str) -> str:
    """'3.11' from the env's lib/pythonX.Y folder (no process started)."""
    libs = sorted(Path(prefix, "lib").glob("python3.*"))
    return libs[0].name[len("python") :] if libs else f"{sys.version_info[0]}.{sys.version_info[1]}"
