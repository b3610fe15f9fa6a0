"""Env pack / unpack / clone against the commands users run instead, on a virtualenv of realistic shape.

Baselines (measured in the same run, in the same folder, alternating with the kit, the minimum of the repeats):
  pack    `tar -I 'zstd -T0' -cf env.tar.zst -C ENV .`   vs kit.envs.pack(ENV, 'env.tar.zst')  (zstd -3, all cores)
  unpack  `tar -I zstd -xf env.tar.zst -C DIR`          vs kit.envs.unpack(archive, DIR, verify_imports=None)
  clone   `cp -a ENV DIR`                               vs kit.envs.clone(ENV, target=DIR, verify_imports=None)
The kit does more than each baseline (a member list with sizes and hashes, every member verified on unpack,
prefixes rewritten in scripts, the archive fsync'ed and renamed when complete); the ratios include that work.
GNU tar writes the env's members from the kit's name list into a pipe; the kit hashes every file in that stream and
compresses it with python-zstandard (libzstd's worker threads, same level); it unpacks with GNU tar (running
`zstd -d`, as the baseline does) and hashes every file back against the member list; clone is GNU cp plus the kit's
prefix fix-ups.
Goals: each at least 0.8x its baseline (the kit may be slower by what its checks cost, no more), and kit/envs at
most MAX_LINES lines of Python.
The env: a virtualenv holding copies of torch, transformers, deepspeed and pandas from this checkout's .venv
(about 1 GB, 25 000 files); --quick uses transformers, deepspeed and pandas (about 0.25 GB) for `make bench`.
Ratio = baseline seconds / kit seconds (above 1: the kit is faster). Each figure prints one line
`envs | <figure> | <ratio>x | goal <goal> | MET/MISSED`, which benchmarks/run_all.py collects.
Run: .venv/bin/python benchmarks/bench_envs.py [--quick] [--repeats 5] [--packages torch,pandas] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars would only add noise to the timings

import kit.envs as envs  # noqa: E402
from kit.envs.prefix import scan_tree, tree_totals  # noqa: E402

MAX_LINES = 2500  # kit/envs: glue over conda-pack, tarfile, GNU tar and python-zstandard, not a tar library
FULL = "torch,transformers,deepspeed,pandas"
QUICK = "transformers,deepspeed,pandas"
# figure -> (baseline command shown next to it, goal as kit speed / baseline speed)
GOALS = {
    "pack": ("tar -I 'zstd -T0' -cf", 0.8),
    "unpack": ("tar -I zstd -xf", 0.8),
    "clone": ("cp -a", 0.8),
}


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def build_env(root: Path, packages: list) -> Path:
    """A venv whose site-packages holds copies of `packages` from this interpreter's site-packages."""
    sites = [
        Path(p) for p in sys.path if p.endswith("site-packages")
    ]  # a worktree's venv may sit on another's
    prefix = envs.create_venv(root / "src-env", inherit=False)
    site = next(prefix.glob("lib/python3*/site-packages"))
    for name in packages:
        src_site = next((s for s in sites if (s / name).exists()), sites[0])
        found = sorted(src_site.glob(name)) + sorted(src_site.glob(f"{name}-*.dist-info"))
        if not found:
            raise SystemExit(f"package {name!r} is not installed in {', '.join(map(str, sites))}")
        for path in found:
            sh("cp", "-a", str(path), str(site))
    return prefix


def _scratch_root():
    """/dev/shm when it has room for the env and its copies: on a disk, file creation after mass deletions can cost
    ext4 a millisecond per file (its inode allocator skips recently deleted inodes; seen here with perf as
    `recently_deleted` under `__ext4_new_inode`), which swamps both sides with the disk's state, not their work.
    In memory both sides do the same system calls and the ratio measures what each program adds."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize > 8 * 2**30 else None


def _clear(*paths: Path) -> None:
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
        side = p.with_name(p.name + ".json")
        if side.exists():
            side.unlink()


def _cpu() -> float:
    """CPU seconds of this process (all its threads: the kit) plus its finished children (the baselines)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn) -> tuple:
    """(wall seconds, CPU seconds) of fn()."""
    cpu, start = _cpu(), time.perf_counter()
    fn()
    return time.perf_counter() - start, _cpu() - cpu


def measure(prefix: Path, scratch: Path, repeats: int) -> dict:
    """{figure: (baseline [(wall, cpu)], kit [(wall, cpu)])}; baseline and kit alternate which goes first.

    `sync` runs between steps (outside the clock, it also counts as a child: the CPU clock is read after it).
    What a step wrote is removed as soon as both sides ran (pack's archives after unpack, which reads them), so
    every step starts with only the env and the archives in the scratch folder. Two clones left in /dev/shm
    until the next round made whichever unpack ran second in a round 0.2-0.6 s slower (seen here: 1.01/0.71,
    0.99/0.59, 0.53/0.94 s), so the ratio measured which side went second, not either side's work."""
    base_zst, kit_zst = scratch / "base.tar.zst", scratch / "kit.tar.zst"
    base_x, kit_x = scratch / "base-x", scratch / "kit-x"
    base_cp, kit_cp = scratch / "base-cp", scratch / "kit-cp"
    runs = {
        "pack": (
            lambda: sh("tar", "-I", "zstd -T0", "-cf", str(base_zst), "-C", str(prefix), "."),
            lambda: envs.pack(prefix, kit_zst, fmt="tar.zst", level=3, threads=0),
            lambda: None,  # unpack reads the archives, then removes them
        ),
        "unpack": (
            lambda: (base_x.mkdir(), sh("tar", "-I", "zstd", "-xf", str(base_zst), "-C", str(base_x))),
            lambda: envs.unpack(kit_zst, kit_x, verify_imports=None),
            lambda: _clear(base_x, kit_x, base_zst, kit_zst),
        ),
        "clone": (
            lambda: sh("cp", "-a", str(prefix), str(base_cp)),
            lambda: envs.clone(prefix, target=kit_cp, verify_imports=None),
            lambda: _clear(base_cp, kit_cp),
        ),
    }
    times: dict = {name: ([], []) for name in runs}
    for r in range(repeats):
        for name, (base, kit, clear) in runs.items():
            order = [(0, base), (1, kit)] if r % 2 == 0 else [(1, kit), (0, base)]
            for which, fn in order:
                sh("sync")  # dirty pages of the previous step are written back before the clock starts
                times[name][which].append(_timed(fn))
            clear()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"short configuration for make bench ({QUICK})")
    ap.add_argument("--packages", default=None, help=f"packages copied into the env (default {FULL})")
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="alternated repeats; the minimum counts (>= 3: one repeat of 1 s varies by 10-20 %% here)",
    )
    ap.add_argument(
        "--dir",
        default=None,
        help="scratch folder (default: /dev/shm when it has room, else the system temp folder)",
    )
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    packages = (args.packages or (QUICK if args.quick else FULL)).split(",")
    scratch = Path(tempfile.mkdtemp(prefix="bench-envs-", dir=args.dir or _scratch_root()))
    try:
        prefix = build_env(scratch, packages)
        files, size = tree_totals(scan_tree(prefix))
        print(
            f"env: {files} files, {size / 2**30:.2f} GiB ({', '.join(packages)}) in {scratch.parent}; "
            f"{os.cpu_count()} cores; "
            f"load average {os.getloadavg()[0]:.2f}; min of {args.repeats} alternated repeats",
            flush=True,
        )
        sh("tar", "cf", "/dev/null", "-C", str(prefix), ".")  # warm the page cache for every contender
        times = measure(prefix, scratch, max(1, args.repeats))
        print(
            f"\n{'step':7} {'baseline':26} {'base s':>7} {'kit s':>7} {'base cpu':>8} {'kit cpu':>8}"
            f"   (wall of every repeat: baseline / kit)"
        )
        for name, (base, kit) in times.items():
            detail = ", ".join(f"{b[0]:.2f}/{k[0]:.2f}" for b, k in zip(base, kit))
            print(
                f"{name:7} {GOALS[name][0]:26} {min(b[0] for b in base):7.2f} {min(k[0] for k in kit):7.2f} "
                f"{min(b[1] for b in base):8.2f} {min(k[1] for k in kit):8.2f}   {detail}"
            )
        print(
            "cpu = CPU seconds of all threads and processes of each side (min of the repeats); on a busy machine "
            "the wall ratio also measures the scheduler's share, the CPU ratio only the work.\n"
        )
        for name, (base, kit) in times.items():
            command, goal = GOALS[name]
            ratio = min(b[0] for b in base) / min(k[0] for k in kit)
            label = f"{name} vs `{command}`" + (" (tar.zst, level 3)" if name == "pack" else "")
            print(f"envs | {label} | {ratio:.2f}x | goal >= {goal}x | {'MET' if ratio >= goal else 'MISSED'}")
        lines = sum(len(p.read_text().splitlines()) for p in Path(envs.__file__).parent.glob("*.py"))
        print(
            f"envs | kit/envs size, lines of Python | {lines} | goal <= {MAX_LINES} | "
            f"{'MET' if lines <= MAX_LINES else 'MISSED'}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
