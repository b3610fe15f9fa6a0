"""The processes of a launched job: stop them together (the ranks checkpoint first) and leave none behind.

torchrun starts each rank in a session of its own (torch 2.13 `elastic/multiprocessing/subprocess_handler`) and, when
it is signalled itself, kills its ranks after TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default), possibly in the middle
of a checkpoint. So the kit signals the ranks, waits for them (bounded), and then kills whatever of the job is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from typing import Iterator, Optional

STOP_GRACE_S = 600.0  # how long a stopped job's ranks may take to checkpoint and exit before they are killed


class Job:
    """A launched job's processes: the launcher child (its own session) and every process below it, remembered as
    they appear so that none outlives the kit's launcher (torchrun starts each rank in a session of its own)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.known: dict = {}

    def refresh(self) -> list:
        import psutil

        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.known.setdefault(p.pid, p)
        except psutil.Error:
            pass
        return [p for p in self.known.values() if _alive(p)]

    def ranks(self) -> list:
        """The processes that run `kit train run` (the ranks), not the launchers between."""
        out = []
        for p in self.refresh():
            try:
                argv = p.cmdline()
            except Exception:  # gone meanwhile
                continue
            if runs_kit_train(argv):
                out.append(p)
        return out

    def request_stop(self) -> str:
        """SIGTERM to every rank (they checkpoint together and exit), or to the launcher while no rank runs (it
        waits for its peers). Signalling torchrun itself would let it kill the ranks 30 s later, mid-checkpoint."""
        ranks = self.ranks()
        for p in ranks:
            _signal(p, signal.SIGTERM)
        if not ranks and self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGTERM)
        return f"{len(ranks)} rank(s)" if ranks else "the launcher (no rank had started)"

    def kill(self) -> None:
        """SIGKILL to whatever of the job is still alive: every process seen below it and its process group."""
        self.refresh()
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGKILL)
        for p in self.known.values():
            _signal(p, signal.SIGKILL)


def runs_kit_train(argv: list) -> bool:
    """A rank: Python running the module `kit train run` (torchrun's and DeepSpeed's own argv name it later)."""
    first = argv.index("-m") if "-m" in argv else -1
    return first > 0 and argv[first + 1 : first + 4] == ["kit", "train", "run"]


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != "zombie"
    except Exception:
        return False


def _signal(p, sig) -> None:
    try:
        p.send_signal(sig)  # psutil checks the pid still names the same process (no reuse)
    except Exception:
        pass


def _killpg(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int:
    """Ask the job to stop (SIGTERM to its ranks: they checkpoint and exit), then kill all of it after `grace_s`."""
    job = Job(proc)
    if proc.poll() is None:
        job.request_stop()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    job.kill()
    proc.wait()
    return proc.returncode


class Stopper:
    """What SIGTERM/SIGINT to the kit's launcher do while a job runs: the first asks the ranks to stop (`request_stop`)
    and kills the job `grace_s` later if it has not ended; a second kills it at once.

    Installed as the signal handler itself (not an exception in the reading loop), so a signal that lands anywhere
    in the launcher stops the job the same way. The handler only signals processes; what it has to say waits in
    `notes` for the loop (writing to a file the interrupted code may be writing to is not safe in a handler).
    """

    def __init__(self, job: Optional[Job], grace_s: float):
        self.job, self.grace_s = job, grace_s
        self.killer: Optional[threading.Timer] = None
        self.notes: list = []
        self.pending: Optional[int] = None  # a signal that came while the job was starting

    def attach(self, job: Job) -> Job:
        """The job started: a signal that came meanwhile acts on it now."""
        self.job = job
        if self.pending is not None:
            self(self.pending)
        return job

    @property
    def stopping(self) -> bool:
        return self.killer is not None

    def __call__(self, signum=None, _frame=None) -> None:
        name = signal.Signals(signum).name if signum else "interrupt"
        if self.job is None:
            self.pending = signum or signal.SIGINT
            return
        if self.killer is not None:
            self.notes.append(f"{name} again; killing the job")
            self.job.kill()
            return
        who = self.job.request_stop()
        self.notes.append(f"{name}: sent SIGTERM to {who} so the job checkpoints and exits")
        self.killer = threading.Timer(self.grace_s, self.job.kill)
        self.killer.daemon = True
        self.killer.start()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block (main thread only: elsewhere no signal arrives), SIGTERM and SIGINT call this."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.killer is not None:
                self.killer.cancel()
