"""kit.system.memory: the memory a process can still take, from its cgroup's limit (v2 and v1) and the host."""

from __future__ import annotations

from pathlib import Path

import psutil

from kit.system.memory import available_memory

MiB = 1 << 20


def _files(folder: Path, **files) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_cgroup_v2_limit_less_what_it_holds_page_cache_aside(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    stat = "anon 1000\nfile {}\nshmem {}\n"
    _files(
        tmp_path / "job",
        memory_max=str(64 * MiB),
        memory_current=str(40 * MiB),
        memory_stat=stat.format(30 * MiB, 2 * MiB),
    )
    _files(
        tmp_path / "job" / "kernel",
        memory_max="max",
        memory_current=str(10 * MiB),
        memory_stat=stat.format(0, 0),
    )
    have, why = available_memory("0::/job/kernel\n", tmp_path)
    # 64 MiB limit on the parent, 40 held of which 28 is page cache the kernel can drop (shmem it cannot)
    assert have == (64 - 40 + 28) * MiB
    assert why == f"memory limit 0.1 GiB of cgroup {tmp_path / 'job'}"


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    stat = "cache 0\ntotal_cache {}\ntotal_shmem 0\n"
    mem = tmp_path / "memory"
    _files(
        mem,
        memory_limit_in_bytes=str(9223372036854771712),
        memory_usage_in_bytes="0",
        memory_stat=stat.format(0),
    )
    _files(
        mem / "pod" / "box",
        memory_limit_in_bytes=str(100 * MiB),
        memory_usage_in_bytes=str(90 * MiB),
        memory_stat=stat.format(20 * MiB),
    )
    proc = "12:cpu,cpuacct:/pod/box\n4:memory:/pod/box\n0::/\n"
    assert available_memory(proc, tmp_path)[0] == 30 * MiB
    # in a cgroup namespace the process sees its own cgroup as the mount's root
    _files(mem, memory_limit_in_bytes=str(50 * MiB), memory_usage_in_bytes=str(45 * MiB))
    assert available_memory("4:memory:/elsewhere\n", tmp_path)[0] == 5 * MiB
    # no cgroup limit: the host's available memory
    host = psutil.virtual_memory().available
    have, why = available_memory("4:memory:/\n", tmp_path / "nothing")
    assert why == "the host's MemAvailable" and abs(have - host) < 256 * MiB


def test_this_process(tmp_path):
    have, why = available_memory()
    assert 0 < have <= psutil.virtual_memory().total and why
