"""kit.core.notebooks: the kernels it starts keep their stderr, less ipykernel's notice about plain TCP."""

from __future__ import annotations

import os

import pytest

from kit.core.notebooks import TCP_NOTICE, _pass_stderr, quiet_kernel_manager


def test_stderr_copy_leaves_out_only_the_tcp_notice(capfd):
    read_fd, write_fd = os.pipe()
    notice = b"[IPKernelApp] WARNING | " + TCP_NOTICE + b". All communication is sent in plain text.\n"
    kineto = b"USDT:2026-12-01 16:58:50 16697:16697 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    kept = b"W1201 profiler_start failed: USDT probe missing\n"  # says something: kept
    os.write(write_fd, b"before\n" + notice + kineto + kept + b"Traceback: a kernel's last words, no newline")
    os.close(write_fd)
    _pass_stderr(read_fd)
    assert (
        capfd.readouterr().err == "before\n" + kept.decode() + "Traceback: a kernel's last words, no newline"
    )


def _start_and_stop(manager_class) -> None:
    km = manager_class(kernel_name="python3")
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=300)
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
    for copier in getattr(km, "copiers", []):
        copier.join(timeout=10)


def test_a_kernel_started_by_the_kit_prints_no_tcp_notice(capfd):
    from jupyter_client import KernelManager

    _start_and_stop(KernelManager)
    if TCP_NOTICE.decode() not in capfd.readouterr().err:
        pytest.skip("this ipykernel prints no notice about TCP")
    _start_and_stop(quiet_kernel_manager(KernelManager))
    assert TCP_NOTICE.decode() not in capfd.readouterr().err


def test_a_summary_table_prints_as_aligned_lines():
    from kit.core.notebooks import table_lines

    rows = [
        {"load": "concurrency", "max_concurrency": 1.0, "request_rate": float("nan"), "p99_ttft_ms": 12.5},
        {"load": "poisson", "max_concurrency": None, "request_rate": 4.0, "p99_ttft_ms": 1000.25},
    ]
    lines = table_lines(rows)
    assert [ln.split() for ln in lines] == [
        ["load", "max_concurrency", "request_rate", "p99_ttft_ms"],
        ["concurrency", "1", "12.5"],
        ["poisson", "4", "1000.25"],
    ]
    assert len({len(ln) for ln in lines}) == 1 and table_lines(None) == [] and table_lines([1]) == []
