"""Env clone / pack / unpack on an env of realistic shape, against cp -a, tar czf and tar xzf on the same disk.

The env: a virtualenv holding copies of torch, transformers, deepspeed and pandas from this checkout's .venv
(about 1 GB, over 20 000 files). Every figure is printed as a ratio against its baseline measured in this run.
Run: .venv/bin/python benchmarks/bench_envs.py [--packages torch,transformers] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kit.envs as envs
from kit.envs.prefix import walk_tree


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def build_env(root: Path, packages: list) -> Path:
    """A venv whose site-packages holds copies of `packages` from this interpreter's site-packages."""
    src_site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    prefix = envs.create_venv(root / "src-env", inherit=False)
    site = next(prefix.glob("lib/python3*/site-packages"))
    for name in packages:
        for path in sorted(src_site.glob(f"{name}")) + sorted(src_site.glob(f"{name}-*.dist-info")):
            sh("cp", "-a", str(path), str(site))
    return prefix


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--packages", default="torch,transformers,deepspeed,pandas")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp folder on this disk)")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-envs-", dir=args.dir))
    try:
        prefix = build_env(scratch, args.packages.split(","))
        files, size = walk_tree(prefix)
        print(f"env: {prefix} — {files} files, {size / 2**30:.2f} GiB; {os.cpu_count()} cores")
        sh("tar", "cf", "/dev/null", "-C", str(prefix), ".")  # warm the page cache for every contender

        rows = []
        t_cp, _ = timed(sh, "cp", "-a", str(prefix), str(scratch / "cp-copy"))
        t_clone, _ = timed(envs.clone, prefix, target=scratch / "kit-clone", verify_imports=None)
        rows.append(("clone", "cp -a", t_cp, None, "kit clone (copy + prefix rewrite)", t_clone, None))
        shutil.rmtree(scratch / "cp-copy")
        shutil.rmtree(scratch / "kit-clone")

        tgz = scratch / "baseline.tar.gz"
        t_tar, _ = timed(sh, "tar", "czf", str(tgz), "-C", str(prefix), ".")
        for fmt, threads, level, label in (
            ("tar.zst", 0, 3, "kit pack tar.zst (zstd -3, all cores)"),
            ("tar.gz", 0, 3, "kit pack tar.gz (parallel gzip -3)"),
            ("tar.gz", 1, 4, "kit pack tar.gz (1 thread, = conda-pack default)"),
        ):
            out = scratch / f"kit-{threads}.{fmt}"
            t, res = timed(envs.pack, prefix, out, fmt=fmt, level=level, threads=threads)
            rows.append(("pack", "tar czf", t_tar, tgz.stat().st_size, label, t, res["archive_bytes"]))

        (scratch / "tar-x").mkdir()
        t_untar, _ = timed(sh, "tar", "xzf", str(tgz), "-C", str(scratch / "tar-x"))
        t_unpack, res = timed(
            envs.unpack, scratch / "kit-0.tar.zst", scratch / "kit-unpacked", verify_imports=None
        )
        rows.append(
            ("unpack", "tar xzf", t_untar, None, "kit unpack tar.zst (safe + prefix fix)", t_unpack, None)
        )

        print(
            f"\n{'step':7} {'baseline':9} {'s':>7} {'MiB':>7} | {'kit':45} {'s':>7} {'MiB':>7} {'speed-up':>9} "
            f"{'size':>6}"
        )
        for step, base, tb, sb, label, tk, sk in rows:
            size_ratio = f"{sk / sb:6.2f}" if sb and sk else "      "
            print(
                f"{step:7} {base:9} {tb:7.1f} {(sb or 0) / 2**20:7.0f} | {label:45} {tk:7.1f} {(sk or 0) / 2**20:7.0f}"
                f" {tb / tk:8.2f}x {size_ratio}"
            )
        print(
            "\nspeed-up = baseline seconds / kit seconds (same run, same disk); size = kit archive / tar czf archive"
        )
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
