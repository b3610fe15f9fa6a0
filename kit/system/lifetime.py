"""Child processes that do not outlive the kit: Linux's parent-death signal (prctl(2) PR_SET_PDEATHSIG), set in one
place for every helper program and child the kit starts (cp and tar, the uploader, and through kit.system.procs the
launcher, the serving engine, the preflight's ranks and the Megatron command). Elsewhere these are no-ops, and each
caller keeps its own way to stop its children (a pipe's EOF, kit.system.procs' process group)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional

_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _CAP_MKNOD = 1, 24, 27


def _prctl() -> Optional[Callable[..., int]]:
    """libc's prctl, or None (not Linux, or no libc to load)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when the thread that started it ends, even by SIGKILL: for a
    Python child to call as it starts."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(sig))


def dies_with_parent(sig: int = signal.SIGKILL, extracting: bool = False) -> Optional[Callable[[], None]]:
    """A subprocess `preexec_fn` doing die_with_parent(sig) in the child, or None off Linux. prctl is looked up
    here, before the fork (nothing is loaded between fork and exec), and a child whose parent died before prctl
    took effect exits at once. extracting: also umask 0 (modes as archived) and no CAP_MKNOD (no device files)."""
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return None

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(1)
        if extracting:
            prctl(_PR_CAPBSET_DROP, _CAP_MKNOD)  # a no-op error where it is not held
            os.umask(0)

    return setup
