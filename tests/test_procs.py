"""The one process runner (kit.system.procs): SIGTERM or SIGINT to the kit's process leaves no process of the serving
engine, the preflight's ranks or the Megatron command behind (a training launch: tests/test_train_launch.py).

Each case runs its owner in a process of its own with a tiny stand-in for the slow child (an engine that only answers
/health, preflight ranks that wait, a Megatron command that sleeps), signals the owner once its child is up, and
checks that every process below the owner is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kit.system.procs import Proc, free_port, group_alive, running

SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])

# A Megatron command: like torchrun, it starts a process in a session of its own (the stop reaches it only through
# the runner's memory of what it saw below the child), says it is ready and waits
MEGATRON = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("ready", rank.pid, flush=True)
time.sleep(600)
"""

# The serving engine: answers GET /health until it is stopped
ENGINE = """
import http.server, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""

# A sitecustomize for the preflight's ranks: megatron-core's CPU patches replaced by a wait, announced by a file
RANKS_WAIT = """
import contextlib, os, sys, time, types
from pathlib import Path

@contextlib.contextmanager
def cpu_patched():
    Path(os.environ["READY_DIR"], "ready_" + os.environ["RANK"]).write_text("")
    time.sleep(600)
    yield

sys.modules["kit.train.preflight.cpu_patches"] = types.SimpleNamespace(cpu_patched=cpu_patched)
"""


def _start(code: str, tmp_path, **env) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (*env.pop("path", ()), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=str(tmp_path),
        env=dict(os.environ, PYTHONPATH=path, **env),
    )


def _stop_and_check(owner: subprocess.Popen, sig: int) -> str:
    """Signal `owner` with every process below it known; return its output once it has exited and none is left."""
    tree = psutil.Process(owner.pid).children(recursive=True)
    assert tree
    owner.send_signal(sig)
    try:
        out = owner.communicate(timeout=300)[0]  # a ceiling only
    finally:
        if owner.poll() is None:
            owner.kill()
    _, alive = psutil.wait_procs(tree, timeout=60)  # a ceiling only: killed leftovers are reaped by init
    assert alive == [], [p.cmdline() for p in alive]
    return out


@SIGNALS
def test_a_signal_to_the_megatron_commands_owner_leaves_no_process(tmp_path, sig):
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from kit.train.megatron import MegatronPlan, execute\n"
        f"plan = MegatronPlan([sys.executable, '-c', {MEGATRON!r}], {{}}, Path('.'), 'pretrain_gpt')\n"
        "print('exit', execute(plan, Path('megatron.log')), flush=True)\n"
    )
    owner = _start(code, tmp_path)
    first = owner.stdout.readline()
    assert first.startswith("ready "), first + owner.stdout.read()
    rank = psutil.Process(int(first.split()[1]))
    out = _stop_and_check(owner, sig)
    assert not rank.is_running()
    name = signal.Signals(sig).name
    assert f"kit: {name}: sent SIGTERM to its process group" in out
    assert f"exit {-signal.SIGTERM}" in out  # the command's own exit: it got the SIGTERM
    assert (tmp_path / "megatron.log").read_text().startswith("ready ")


@SIGNALS
def test_a_signal_to_the_serving_engines_owner_leaves_no_process(tmp_path, sig):
    port = free_port()
    code = (
        "import sys, time\n"
        "from kit.serve.server import Server\n"
        f"argv = [sys.executable, '-c', {ENGINE!r}, '{port}']\n"
        f"s = Server(argv, '127.0.0.1', {port}, 'model', 'engine.log', engine='stand-in').start(timeout=300)\n"
        "print('PID', s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = _start(code, tmp_path)
    first = owner.stdout.readline()
    assert first.startswith("PID "), first + owner.stdout.read()
    pid = int(first.split()[1])
    assert group_alive(pid)
    _stop_and_check(owner, sig)  # SIGTERM: the parent-death signal; SIGINT: the owner's atexit stops it
    assert not group_alive(pid)


@SIGNALS
def test_a_signal_to_the_preflights_owner_stops_its_ranks_and_leaves_no_process(tmp_path, sig):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RANKS_WAIT)
    out = tmp_path / "work"
    out.mkdir()
    code = (
        "from kit.train.preflight.run import launch\n"
        f"launch({{'out': {str(out)!r}, 'world': 2, 'timeout_s': 600}})\n"
    )
    owner = _start(code, tmp_path, path=[str(hook)], READY_DIR=str(out))
    deadline = time.monotonic() + 600  # a ceiling only: returns once both ranks wait
    while not ((out / "ready_0").is_file() and (out / "ready_1").is_file()):
        assert owner.poll() is None and time.monotonic() < deadline, owner.stdout.read()
        time.sleep(0.1)
    text = _stop_and_check(owner, sig)
    assert "KeyboardInterrupt: the preflight was stopped by " + signal.Signals(sig).name in text
    assert (
        f"kit: {signal.Signals(sig).name}: sent SIGTERM to its process group"
        in (out / "launcher.log").read_text()
    )


def test_a_stop_waits_its_grace_then_kills_what_ignores_sigterm(tmp_path):
    """Proc.stop: SIGTERM first; a process that ignores it is killed once the grace period is over."""
    proc = Proc(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('up', flush=True); time.sleep(600)",
        ]
    )
    assert next(line for line in proc.lines(lambda _: None) if line) == "up\n"
    assert proc.stop(grace_s=1.0) == -signal.SIGKILL
    assert not proc.alive()


def test_running_kills_what_is_left_when_its_block_ends():
    with running(["sh", "-c", "sleep 600 & echo $!; wait"]) as proc:
        holder = psutil.Process(int(next(line for line in proc.lines(lambda _: None) if line)))
    assert proc.returncode == -signal.SIGKILL
    assert psutil.wait_procs([holder], timeout=60)[1] == []  # a ceiling only
