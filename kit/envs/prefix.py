"""What an environment folder is (conda or venv), its size, its python, and fixing its embedded prefix."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from kit.errors import KitError

DEFAULT_IMPORTS = ("torch", "torch_npu", "deepspeed")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SCAN_LIMIT = 2 << 20  # text files with a prefix are scripts and configs; bigger ones are binaries


class EnvError(KitError, ValueError):
    """A bad environment name, a missing source, a target that exists, no space: says what to do next."""


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


def walk_tree(root: os.PathLike | str) -> tuple[int, int]:
    """(number of files and links, total bytes) under `root`, links not followed."""
    count = size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            st = os.lstat(os.path.join(dirpath, name))
            count += 1
            size += st.st_size
    return count, size


def free_bytes(path: os.PathLike | str) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_space(target: os.PathLike | str, needed: int, what: str) -> None:
    """Raise EnvError before starting if the target filesystem cannot hold `needed` bytes (+5%, +64 MiB)."""
    want = int(needed * 1.05) + (64 << 20)
    free = free_bytes(target)
    if free < want:
        raise EnvError(
            f"not enough space for {what} at {str(target)!r}: about {want / 2**30:.2f} GiB needed, "
            f"{free / 2**30:.2f} GiB free; free space there or choose another target "
            f"(on ModelArts, /home/ma-user/work is the persistent one; EVS can be expanded)."
        )


def looks_text(data: bytes) -> bool:
    return b"\0" not in data[:8192]


def scan_prefix(data: bytes, old: bytes) -> bool:
    """True when `data` is text that mentions the old prefix (and so must be rewritten on relocation)."""
    return old in data and looks_text(data)


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


def _copy_file(s: str, d: str, old_b: bytes, new_b: bytes) -> tuple[int, bool]:
    """Copy one file, rewriting the prefix if it is text that holds it; return (size, rewritten)."""
    size = os.path.getsize(s)
    if size > SCAN_LIMIT:
        shutil.copy2(s, d)
        return size, False
    with open(s, "rb") as fh:
        data = fh.read()
    rewritten = scan_prefix(data, old_b)
    with open(d, "wb") as fh:
        fh.write(data.replace(old_b, new_b) if rewritten else data)
    shutil.copystat(s, d)
    return size, rewritten


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
    src: os.PathLike | str, dst: os.PathLike | str, new_prefix: str, progress=None, workers: int = 0
) -> dict:
    """Copy an env tree into the existing folder `dst`, rewriting `src` to `new_prefix` in text files.

    Symbolic links are copied as links; absolute ones into the source are re-pointed into the copy. On a
    network filesystem (SFS/NFS: every small file costs a round trip) files are copied on 8 threads; on a local
    disk one thread is faster (measured: threads lose to the GIL there).
    """
    from concurrent.futures import ThreadPoolExecutor

    src, dst = os.path.abspath(src), os.path.abspath(dst)
    old_b, new_b = src.encode(), new_prefix.encode()
    counts = {"files": 0, "links": 0, "rewritten": 0, "bytes": 0}
    jobs = []
    for dirpath, dirnames, filenames in os.walk(src):
        rel_dir = os.path.relpath(dirpath, src)
        out_dir = os.path.normpath(os.path.join(dst, rel_dir))
        os.makedirs(out_dir, exist_ok=True)
        shutil.copymode(dirpath, out_dir)
        linked_dirs = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in linked_dirs]
        for name in filenames + linked_dirs:
            s, d = os.path.join(dirpath, name), os.path.join(out_dir, name)
            if os.path.islink(s):
                target = os.readlink(s)
                if os.path.isabs(target) and (target == src or target.startswith(src + os.sep)):
                    target = new_prefix + target[len(src) :]
                os.symlink(target, d)
                counts["links"] += 1
                if progress:
                    progress(1)
            else:
                jobs.append((s, d))
    workers = workers or (8 if is_network_fs(dst) else 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for size, rewritten in pool.map(lambda job: _copy_file(*job, old_b, new_b), jobs, chunksize=64):
            counts["files"] += 1
            counts["bytes"] += size
            counts["rewritten"] += rewritten
            if progress:
                progress(1)
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
