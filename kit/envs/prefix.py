"""What an env folder is; clone = GNU cp plus what no copier does: the old prefix rewritten in text files, links into
the env re-pointed, every file checked against its scanned size."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from kit.errors import IntegrityError, KitError
from kit.system.procs import Proc


class EnvError(KitError, ValueError):
    """A bad environment name, a missing source, a target that exists, no space: says what to do next."""


class EnvArchiveError(KitError, ValueError):
    """An archive that is unsafe, corrupt, or in a format the kit cannot read."""


class ArchiveDamagedError(EnvArchiveError, IntegrityError):
    """An archive that is truncated or damaged: a member is missing, cut short or differs from its hash."""


DEFAULT_IMPORTS = ("torch", "torch_npu", "deepspeed")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SCAN_LIMIT = 2 << 20  # text files with a prefix are scripts and configs; bigger ones are binaries
_HEAD = 8192  # a file with a NUL byte in its first 8 KiB is binary
_GNU: dict = {}


def gnu_program(name: str) -> Optional[str]:
    """The GNU `name` program (cp, tar) the kit hands bulk file work to, or None: not installed, or another
    implementation (their options differ)."""
    exe = shutil.which(name)
    if exe and exe not in _GNU:
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, timeout=30).stdout
            _GNU[exe] = out.startswith(f"{name} (GNU ".encode())
        except (OSError, subprocess.SubprocessError):
            _GNU[exe] = False
    return exe if exe and _GNU[exe] else None


def inside(root: str, path: str) -> bool:
    """True when `path` is `root` or below it (both absolute, normalised)."""
    return path == root or path.startswith(root + os.sep)


def check_name(name: str, what: str = "environment name") -> str:
    """Return `name` if it is a plain folder name, else raise EnvError saying what is allowed."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise EnvError(
            f"{what} {name!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting "
            f"with a letter or digit (no '/', spaces or shell characters), e.g. 'torch-npu-env'."
        )
    return name


def check_choice(value, allowed: Sequence[str], what: str) -> str:
    """Return `value` if it is one of `allowed`, else raise EnvError listing them."""
    if value not in allowed:
        raise EnvError(f"{what} {value!r} is not one of {', '.join(allowed)}.")
    return value


@dataclass(frozen=True)
class EnvInfo:
    """One environment: name, folder and kind ('conda' or 'venv')."""

    name: str
    prefix: Path
    kind: str


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


def walk_tree(root: os.PathLike | str) -> list:
    """[(relative name, os.DirEntry)] of everything under `root`: each folder before its contents, names sorted,
    links not followed; types and inodes come with the folder listings (no stat per entry)."""
    out, folders = [], [(os.fspath(root), "")]
    while folders:  # depth first without recursion: an archive's tree may be deeper than Python's stack
        folder, rel = folders.pop()
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for entry in entries:
            name = f"{rel}/{entry.name}" if rel else entry.name
            out.append((name, entry))
            if entry.is_dir(follow_symlinks=False):
                subdirs.append((entry.path, name))
        folders += reversed(subdirs)
    return out


def scan_tree(root: os.PathLike | str) -> list:
    """[(relative name, path, lstat)] of walk_tree(root), one lstat per entry: what pack and clone work from."""
    return [(name, e.path, e.stat(follow_symlinks=False)) for name, e in walk_tree(root)]


def tree_totals(entries: list) -> tuple[int, int]:
    """(number of files and links, total bytes) of scan_tree() entries."""
    sizes = [st.st_size for _rel, _path, st in entries if not stat.S_ISDIR(st.st_mode)]
    return len(sizes), sum(sizes)


def scan_prefix(data: bytes, old: bytes) -> bool:
    """True when `data` is text (no NUL in its first 8 KiB) that mentions the old prefix (and so must be rewritten
    on relocation). The cheap test first: binaries (most of an env's bytes) are never searched."""
    return data.find(b"\0", 0, _HEAD) < 0 and old in data


def holds_prefix(path: str, size: int, old: bytes) -> bool:
    """scan_prefix() of the file at `path`; a binary is read no further than its first 8 KiB."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # removed since the scan saw it
        raise changed_error(path, size, None) from None
    try:
        data = os.read(fd, min(size, _HEAD))
        if data.find(b"\0") >= 0:
            return False
        while len(data) < size:
            more = os.read(fd, size - len(data))
            if not more:
                break
            data += more
    finally:
        os.close(fd)
    return old in data


def rewrite_prefix_files(
    root: os.PathLike | str, files: Iterable[str], old: str, new: str
) -> tuple[int, int]:
    """Replace `old` by `new` in the listed text files under `root` (modes and times kept); return how many
    changed and by how many bytes they grew."""
    changed = grown = 0
    old_b, new_b = old.encode(), new.encode()
    for rel in files:
        path = os.path.join(root, rel)
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        if old_b in data:
            st = os.stat(path)
            with open(path, "wb") as fh:  # the same file: its mode stays
                fh.write(data.replace(old_b, new_b))
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            changed += 1
            grown += data.count(old_b) * (len(new_b) - len(old_b))
    return changed, grown


def changed_error(path: str, size: int, now: Optional[int], doing: str = "copied") -> EnvError:
    """The one error for a source file whose size is not the one the scan saw (a pip install running in it)."""
    got = "gone now" if now is None else f"{now} now"
    again = "pack" if doing == "packed" else "clone"
    return EnvError(
        f"{path} changed while it was {doing} ({size} bytes when the env was scanned, {got}); {again} again "
        f"when nothing writes to the source env (a running pip or conda install?)."
    )


def special_file_error(what: str, then: str, error=EnvError) -> Exception:
    """The one error for a device, socket or FIFO, which no environment holds."""
    return error(
        f"{what} is a device, socket, FIFO or other special file; environments never hold those: {then}."
    )


@contextlib.contextmanager
def helper_program(cmd: list, what: str, error=EnvError, hint: str = "", extracting: bool = False, **popen):
    """Run a helper program (cp, tar) beside the block, killed if the block fails or this process dies. Its failure
    is `error` naming its last message, or OSError ENOSPC on a full disk (the CLI prints that in one line). A
    user's TAR_OPTIONS never reaches it (`--absolute-names` or `--exclude` there would undo the kit's checks)."""
    popen["env"] = {k: v for k, v in popen.get("env", os.environ).items() if k != "TAR_OPTIONS"}
    with tempfile.TemporaryFile() as err:
        streams = dict(stdin=None, stdout=None, text=False, errors=None, bufsize=-1)
        proc = Proc(cmd, extracting=extracting, stderr=err, **{**streams, **popen})
        try:
            yield proc
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        text = err.read().decode("utf-8", "replace").strip()
    if code != 0:
        generic = ("Exiting with failure status", "Error is not recoverable", "Child returned status")
        lines = [line for line in text.splitlines() if not any(g in line for g in generic)]
        last = lines[-1] if lines else f"exit status {code}"
        if any("No space left" in line for line in lines):
            raise OSError(errno.ENOSPC, "No space left on device", last)
        raise error(f"{what} failed: {last}" + (f"; {hint}." if hint else ""))


def copy_tree(
    src: os.PathLike | str,
    dst: os.PathLike | str,
    new_prefix: str,
    progress=None,
    entries: Optional[list] = None,
    on_scanned: Optional[Callable[[list], object]] = None,
) -> dict:
    """Copy an env tree into the existing folder `dst` with GNU cp, rewriting `src` to `new_prefix` in text
    files and absolute links; every file must have the size the scan saw. The scan (unless `entries` is given)
    runs while cp copies, then on_scanned(entries), e.g. a space check that stops the copy."""
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    exe = gnu_program("cp")
    if exe is None:
        raise EnvError("GNU cp is needed to clone envs: install it (apt-get install coreutils).")
    cmd = [exe, "-R", "--no-dereference", "--preserve=mode,timestamps", "--", f"{src}/.", dst]
    with helper_program(cmd, f"copying {src}", stdout=subprocess.DEVNULL):
        if entries is None:  # the scan that would otherwise come first runs beside cp's copy
            entries = scan_tree(src)
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
                if 0 < st.st_size <= SCAN_LIMIT and holds_prefix(s, st.st_size, src.encode()):
                    texts.append(rel)
            elif stat.S_ISDIR(st.st_mode):
                continue
            else:  # a FIFO, socket or device: the error stops cp
                raise special_file_error(s, "remove it first")
            if progress:
                progress(1)
    for rel, s, st in entries:  # cp copied what it found: a file changed since the scan differs in size
        d = os.path.join(dst, rel)
        if stat.S_ISREG(st.st_mode):
            try:
                now: Optional[int] = os.lstat(d).st_size
            except FileNotFoundError:  # removed before the copier came to it
                now = None
            if now != st.st_size:
                raise changed_error(s, st.st_size, now)
        elif stat.S_ISLNK(st.st_mode):
            target = os.readlink(s)
            if os.path.isabs(target) and inside(src, target):
                os.unlink(d)
                os.symlink(new_prefix + target[len(src) :], d)
        elif st.st_mode & 0o700 != 0o700:  # a folder (anything else was refused above)
            os.chmod(d, stat.S_IMODE(st.st_mode) | 0o700)
    counts["rewritten"], grown = rewrite_prefix_files(dst, texts, src, new_prefix)
    counts["bytes"] += grown
    return counts


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
    """Run the env's own python (with `env` added, e.g. CANN's variables): its sys.prefix, version and each
    import ('ok', 'absent' or the error); torch_npu is imported in that child only."""
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


EDITABLE_HINT = (
    "their source trees live outside the env and are not shipped: pass ignore_editable=True "
    "(--ignore-editable-packages) to go without them and reinstall them after, or `pip install` them normally"
)


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
