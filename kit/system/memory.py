"""How much memory this process can still take: the host's MemAvailable, and its cgroup's limit (v2 or v1)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional, Tuple

CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def _number(path: Path) -> Optional[int]:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def _reclaimable(path: Path, cache: str, shmem: str) -> int:
    """Page cache the kernel can drop to make room (memory.stat's file cache less shared memory, which it cannot)."""
    try:
        stat = dict(line.split()[:2] for line in path.read_text().splitlines() if len(line.split()) >= 2)
    except OSError:
        return 0
    return max(0, int(stat.get(cache, 0)) - int(stat.get(shmem, 0)))


def _cgroup_dirs(proc_cgroup: str, root: Path):
    """(folder, limit file, usage file, cache and shmem fields of memory.stat) of this process's memory cgroup and
    its ancestors."""
    for line in proc_cgroup.splitlines():
        if line.count(":") < 2:
            continue
        _, controllers, rel = line.split(":", 2)
        if controllers == "" and (root / "cgroup.controllers").is_file():
            base, files = root, ("memory.max", "memory.current", "file", "shmem")
        elif "memory" in controllers.split(","):
            base, files = (
                root / "memory",
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache", "total_shmem"),
            )
        else:
            continue
        here = base / rel.lstrip("/")
        if not here.is_dir():  # a cgroup namespace shows its own cgroup as the mount's root
            here = base
        while True:
            yield (here, *files)
            if here == base:
                break
            here = here.parent


def available_memory(proc_cgroup: Optional[str] = None, root: Path = CGROUP_ROOT) -> Tuple[int, str]:
    """(bytes this process can still allocate, what limits it): the least of MemAvailable and, for each memory
    cgroup above the process with a limit, that limit less what it holds (page cache the kernel can drop aside)."""
    import psutil

    best, why = int(psutil.virtual_memory().available), "the host's MemAvailable"
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return best, why
    for folder, limit_file, usage_file, cache, shmem in _cgroup_dirs(proc_cgroup, root):
        limit = _number(folder / limit_file)
        if limit is None or limit >= _UNLIMITED:
            continue
        used = (_number(folder / usage_file) or 0) - _reclaimable(folder / "memory.stat", cache, shmem)
        if limit - used < best:
            best, why = max(0, limit - used), f"memory limit {limit / 2**30:.1f} GiB of cgroup {folder}"
    return best, why


@functools.cache
def _malloc_trim():
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's, in the process already
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def give_back_freed() -> None:
    """Return memory the process has freed to the system. glibc keeps freed blocks below its mmap threshold (up to
    32 MiB) in its heap, where later allocations do not always fit: reading a model one layer at a time otherwise
    grew the process by a few MB a layer (half the model's fp32 size over 48 layers, measured). No-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def peak_memory(device) -> Tuple[int, str]:
    """(bytes, what they are) of this process's memory on `device`: the allocator's peak on an NPU / CUDA card
    (max_memory_allocated), the process's resident set on a CPU."""
    import torch

    kind = getattr(device, "type", str(device))
    if kind in ("cuda", "npu"):
        return int(getattr(torch, kind).max_memory_allocated(device)), "max allocated"
    import psutil

    return int(psutil.Process().memory_info().rss), "process RSS"
