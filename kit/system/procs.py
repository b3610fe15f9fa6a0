"""The one process runner for every child the kit starts: training launches, the serving engine, the preflight's
ranks, the Megatron command, and the stream children (cp, tar, the OBS uploader).

A child starts in a process group (session) of its own that dies with the kit (kit.system.lifetime), its output is read
with a bounded drain, and a stop asks (SIGTERM), waits a grace period and kills what is left, so that no process
outlives its runner. torchrun starts each rank in a session of its own (torch 2.13
`elastic/multiprocessing/subprocess_handler`) and, when it is signalled itself, kills its ranks after
TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default), possibly in the middle of a checkpoint. So a training job's stop
signals the ranks, waits for them (bounded), and then kills every process of the job seen below the child.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from kit.system.lifetime import dies_with_parent

STOP_GRACE_S = 600.0  # how long a stopped job's ranks may take to checkpoint and exit before they are killed
# the grace period the platform gives a stopped job (default STOP_GRACE_S, what `kit train launch` gives its ranks):
# a preempted run's checkpoint uploads end within it (kit.train.trainer)
PREEMPT_GRACE_VARIABLE = "KIT_PREEMPT_GRACE_S"
DRAIN_S = 10.0  # how long after the child exits its output may still come (from processes it left behind)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now on `host` (it may be taken again before use; its user then says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def torchrun_command(
    script: list,
    nproc_per_node: int,
    master_port: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
) -> list:
    """argv that runs `python <script...>` on `nproc_per_node` ranks of this node through this Python's torchrun."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc_per_node}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        *script,
    ]


def runs_kit_train(argv: list) -> bool:
    """A training rank: Python running the module `kit train run` (torchrun's and DeepSpeed's argv name it later)."""
    first = argv.index("-m") if "-m" in argv else -1
    return first > 0 and argv[first + 1 : first + 4] == ["kit", "train", "run"]


class Proc(subprocess.Popen):
    """A child in a session of its own that dies with its parent, and every process below it, remembered as they
    appear (a torchrun rank leaves the child's group). output: None, a pipe for `lines()`; a path, appended to.
    ranks: which descendants a stop signals (training ranks, so they checkpoint); None: the child's group."""

    def __init__(
        self,
        argv: list,
        env=None,
        cwd=None,
        output: Optional[Path] = None,
        ranks: Optional[Callable] = None,
        extracting: bool = False,
        **streams,
    ):
        """`streams`: Popen's stdin / stdout / stderr / text / bufsize where the child is a stream filter (tar, cp,
        the OBS uploader) rather than a job whose lines are read; `extracting`: see lifetime.dies_with_parent."""
        self.rank_test, self.known = ranks, {}
        self.notes: list = []  # what a stop had to say, for the reading loop (`lines`) to pass on
        self.stopped_by: Optional[str] = None  # the signal that stopped it (Stopper)
        log = open(output, "ab") if output is not None else None  # noqa: SIM115 - the child holds it
        settings = dict(
            stdin=subprocess.DEVNULL,
            stdout=log or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
        )
        settings.update(streams)
        try:
            super().__init__(
                list(argv),
                env=env,
                cwd=cwd,
                start_new_session=True,
                # its parent's death: SIGTERM, so torchrun stops its ranks and an engine its workers
                preexec_fn=dies_with_parent(signal.SIGTERM, extracting=extracting),
                **settings,
            )
        finally:
            if log is not None:
                log.close()

    def refresh(self) -> list:
        """The processes below the child that are alive; each is remembered from the first time it is seen."""
        import psutil

        try:
            for p in psutil.Process(self.pid).children(recursive=True):
                self.known.setdefault(p.pid, p)
        except psutil.Error:
            pass
        return [p for p in self.known.values() if _alive(p)]

    def alive(self) -> bool:
        """Whether any of it runs: the child, its process group, or a process seen below it."""
        return self.poll() is None or group_alive(self.pid) or bool(self.refresh())

    def request_stop(self) -> str:
        """SIGTERM to the ranks (they checkpoint together and exit), or to the child's group while no rank runs (a
        launcher then waits for its peers); says whom. Signalling torchrun would kill the ranks 30 s later."""
        ranks = [p for p in self.refresh() if self.rank_test and self.rank_test(_cmdline(p))]
        for p in ranks:
            _signal(p, signal.SIGTERM)
        if ranks:
            return f"{len(ranks)} rank(s) so the job checkpoints and exits"
        _killpg(self.pid, signal.SIGTERM)
        if self.rank_test:
            return "the launcher (no rank had started) so the job checkpoints and exits"
        return "its process group"

    def kill(self) -> None:
        """SIGKILL to whatever of it is alive: its process group and every process seen below it."""
        self.refresh()
        _killpg(self.pid, signal.SIGKILL)
        for p in self.known.values():
            _signal(p, signal.SIGKILL)

    def stop(self, grace_s: float = STOP_GRACE_S) -> int:
        """Ask it to stop, kill what is left after `grace_s`, and wait until none of it runs; its exit code."""
        if self.alive():
            self.request_stop()
            deadline = time.monotonic() + grace_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
        self.kill()
        code = self.wait()
        deadline = time.monotonic() + 5.0  # killed members of its group are reaped by init: bounded
        while group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return code

    def lines(self, note: Callable[[str], None], drain_s: float = DRAIN_S) -> Iterator[str]:
        """The child's output lines ("" every half second while it is quiet) until it has exited and its pipe is
        drained: at EOF, or `drain_s` after it exited while a process it started still holds the pipe (the caller
        then kills the rest). Reading until EOF alone would wait as long as any descendant lives. What a stop had
        to say goes to `note` on the way."""
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in iter(self.stdout.readline, ""):
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, name="kit-proc-output", daemon=True).start()
        exited_at = None
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                line = ""
            while self.notes:
                note(self.notes.pop(0))
            if line is None:
                return
            if self.poll() is None:
                self.refresh()  # every process it starts, known while they are its descendants
            yield line
            # counted from the exit, quiet or not: a leftover that writes cannot hold it
            if self.poll() is not None:
                exited_at = exited_at or time.monotonic()
                if time.monotonic() - exited_at > drain_s:
                    note(
                        f"the launcher exited ({self.returncode}) but a process it started still holds its output "
                        f"{drain_s:.0f} s later: killing what is left of the job"
                    )
                    return


def _cmdline(p) -> list:
    try:
        return p.cmdline()
    except Exception:  # gone meanwhile
        return []


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


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class Stopper:
    """SIGTERM/SIGINT to the kit's process while a child runs: the first asks it to stop (`request_stop`) and kills
    it `grace_s` later; a second kills it at once. The signal handler itself, so a signal that lands anywhere stops
    the child the same way; it only signals processes, and what it has to say waits in the child's `notes` for the
    reading loop (writing to a file the interrupted code may be writing to is not safe in a handler)."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.job: Optional[Proc] = None
        self.killer: Optional[threading.Timer] = None
        self.pending: Optional[int] = None  # a signal that came while the child was starting

    def attach(self, job: Proc) -> Proc:
        """The child started: a signal that came meanwhile acts on it now."""
        self.job = job
        if self.pending is not None:
            self(self.pending)
        return job

    def __call__(self, signum=None, _frame=None) -> None:
        name = signal.Signals(signum).name if signum else "interrupt"
        if self.job is None:
            self.pending = signum or signal.SIGINT
            return
        if self.killer is not None:
            self.job.notes.append(f"{name} again; killing the job")
            self.job.kill()
            return
        self.job.stopped_by = name
        who = self.job.request_stop()
        self.job.notes.append(f"{name}: sent SIGTERM to {who}")
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


@contextlib.contextmanager
def running(argv: list, grace_s: float = STOP_GRACE_S, **kwargs) -> Iterator[Proc]:
    """`Proc(argv, **kwargs)` while SIGTERM and SIGINT to this process stop it (Stopper); none of it outlives the
    block. The handlers are installed before the start: a signal that comes while it starts acts once it exists."""
    stopper = Stopper(grace_s)
    with stopper.installed():
        proc = stopper.attach(Proc(argv, **kwargs))
        try:
            yield proc
        finally:
            proc.kill()  # a no-op when all of it has exited
            proc.wait()


# Written by the kit itself for a process that trained without a launcher (kit.train.engine.init_distributed), with
# the port it chose; an environment variable, not a module flag, because the kernels and workers such a process
# starts inherit LOCAL_SIZE too and must not take it for a launcher's: the rendezvous variables that still hold the kit's values are not the user's settings (not read
# as MASTER_ADDR / MASTER_PORT when that process launches a job); one the user changed since is.
IN_PROCESS_MARKER = "KIT_IN_PROCESS_LOCAL_SIZE"


def in_process_env(port: str) -> dict:
    """What init_distributed sets for a world of one in an unlaunched process: LOCAL_SIZE for DeepSpeed (see
    kit.train.engine), and the marker recording the port."""
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        IN_PROCESS_MARKER: port,
    }


def in_process_rendezvous(environ: Mapping[str, str]) -> dict:
    """The variables of `environ` that still hold what init_distributed set for a world of one in this process
    (the marker included)."""
    port = environ.get(IN_PROCESS_MARKER)
    if not port:
        return {}
    return {k: v for k, v in in_process_env(port).items() if environ.get(k) == v}


def without_in_process_rendezvous(env: dict) -> dict:
    """`env` for a child process (a kernel, a server) without the rendezvous this process set for training in
    it: the child would take them for a launcher's, and MASTER_PORT is still held by this process. A variable the
    user set since is kept."""
    kit = in_process_rendezvous(env)
    return {k: v for k, v in env.items() if k not in kit}
