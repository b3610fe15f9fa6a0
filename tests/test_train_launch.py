"""Launched training: 2-process data parallel (gloo) vs one process, SIGTERM checkpoint, CLI exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import test_train_helpers as H

from kit.core.configs import save_config
from kit.core.workspace import repo_root
from kit.errors import EXIT_PREEMPTED
from kit.storage.locks import LockedError
from kit.system.procs import Proc, runs_kit_train
from kit.train import TrainConfig, train
from kit.train.checkpoint import latest_iteration
from kit.train.launch import launch, launch_command, launch_env
from kit.train.metrics import read_metrics


@pytest.mark.slow
def test_two_process_data_parallel_matches_one_process(tmp_path, tiny_llama_dir, monkeypatch):
    """Also counts the dataset's opens: the launcher resolves (and checks the data) once, each rank loads it once
    from the plan the launcher wrote; 1 + W in all (tests/open_counter wraps datasets.load_from_disk)."""
    import collections
    import importlib.util

    import datasets

    from kit.core.configs import to_jsonable
    from kit.train.resolve import TrainPlan

    # 3 held-out rows over 2 ranks: rank 1 scores one row and a repeat with no targets
    held = H.make_sft(tmp_path / "p_heldout_hf", num_samples=3, max_length=32, seed=1)
    data = H.with_heldout(H.make_pretrain(tmp_path / "p_hf", num_samples=16), held, 3)
    common = dict(train_iters=4, gbs=4, mbs=1, lr=3e-3, eval_every=2)
    single = train(H.tiny_config(tiny_llama_dir, data, tmp_path / "one", **common), progress=False)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "two", nproc_per_node=2, **common)
    opens = tmp_path / "opens.log"
    counter = repo_root() / "tests" / "open_counter"
    monkeypatch.setenv("KIT_TEST_OPEN_LOG", str(opens))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(counter), os.environ.get("PYTHONPATH")]))
    )
    # the same wrapper as the ranks', for this process (the launcher's)
    spec = importlib.util.spec_from_file_location("open_counter", counter / "sitecustomize.py")
    wrapper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrapper)
    monkeypatch.setattr(datasets, "load_from_disk", wrapper.counted(datasets.load_from_disk))
    res = launch(cfg, progress=False)
    assert res.ok, "\n".join(res.tail)
    pids = collections.Counter(opens.read_text().split())
    # each rank opens its rows and the held-out rows
    assert pids[str(os.getpid())] == 1 and sorted(pids.values()) == [1, 2, 2], pids
    # the ranks trained the plan the launcher wrote, which rank 0 kept as the run's plan
    plan = TrainPlan.load(cfg.output_dir() / "plan.json")
    assert to_jsonable(plan.cfg) == json.loads((cfg.output_dir() / "config.json").read_text())
    assert plan.data["num_samples"] == 16 and not plan.resumed
    assert res.iterations == [1, 2, 3, 4]
    records = read_metrics(cfg.log_dir() / "pretrain.metrics.jsonl")
    two = [r["loss"] for r in records]
    assert two == pytest.approx(single.losses, rel=1e-4, abs=1e-5)
    held_out = {r["iteration"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert list(held_out) == [2, 4] and held_out == pytest.approx(single.eval_losses, rel=1e-4, abs=1e-5)
    assert records[0]["real_tokens"] == 4 * 32  # both ranks' tokens are counted once
    # tokens/s/p divides by the 2 cards
    r = records[-1]
    assert r["tokens_per_s_per_card"] == pytest.approx(4 * 32 / (2 * r["elapsed_ms"]) * 1000)
    assert latest_iteration(cfg.output_dir() / "checkpoints") == 4
    assert single.losses[-1] < single.losses[0]


def wait_for_metrics(path, lines: int, proc, output: list, ceiling_s: float = 900.0) -> None:
    """Return once `path` holds `lines` complete lines; fail clearly if the job exits first or the ceiling passes.

    Event-driven: on a quiet machine this returns within seconds; the ceiling only bounds a stuck job (a loaded
    2-core CI box can need minutes just to import torch, DeepSpeed and transformers in torchrun's worker).
    """
    deadline = time.monotonic() + ceiling_s
    while True:
        if path.is_file() and path.read_text().count("\n") >= lines:
            return
        if proc.poll() is not None:
            pytest.fail(
                f"the job exited ({proc.returncode}) before {lines} metrics lines:\n" + "".join(output)
            )
        if time.monotonic() > deadline:
            pytest.fail(
                f"no {lines} complete lines in {path} after {ceiling_s:.0f} s; the job is still running. "
                f"Its output so far:\n" + "".join(output[-50:])
            )
        time.sleep(0.2)


def test_wait_for_metrics_returns_on_the_lines_and_fails_clearly(tmp_path):
    path = tmp_path / "m.jsonl"
    writer = "import sys, time; time.sleep(0.5); open(sys.argv[1], 'w').write('{}\\n{}\\n'); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", writer, str(path)])
    try:
        wait_for_metrics(
            path, 2, proc, []
        )  # returns as soon as both lines are there, not after a fixed delay
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    quitter = subprocess.Popen([sys.executable, "-c", "print('boom')"])
    with pytest.raises(pytest.fail.Exception, match=r"exited \(0\) before 2 metrics lines:\nboom"):
        wait_for_metrics(tmp_path / "never.jsonl", 2, quitter, ["boom"])


def _alive(procs: list) -> list:
    return [p for p in procs if p.is_running() and p.status() != "zombie"]


# A sitecustomize for the launched processes: each rank holds after iteration 3 until its stop request has arrived,
# so the checkpoint's step is known (kit.train.trainer is wrapped as it is imported; the kit has no test hook).
HOLD_AT_3 = """
import importlib.machinery, sys, time


class HoldAt3:
    def find_spec(self, name, path=None, target=None):
        if name != "kit.train.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            init = module.Trainer.__init__

            def __init__(self, *args, **kwargs):
                init(self, *args, **kwargs)
                self.step_callbacks.append(lambda iteration: hold(self, iteration))

            module.Trainer.__init__ = __init__

        spec.loader.exec_module = exec_module
        return spec


def hold(trainer, iteration):
    while iteration == 3 and not trainer._stop_reason:
        time.sleep(0.05)


sys.meta_path.insert(0, HoldAt3())
"""


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_every_rank_and_leaves_no_process(tmp_path, tiny_llama_dir):
    """What a ModelArts job's main process gets on preemption: SIGTERM to `kit train launch` (2 ranks). The ranks
    hold at iteration 3 (HOLD_AT_3) until the stop arrives, so the checkpoint's step is known."""
    import psutil

    data = H.make_pretrain(tmp_path / "p_hf", num_samples=16)
    # far more steps than the run would make; it stops at 3
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", train_iters=1000, nproc_per_node=2, mbs=1)
    config_path = save_config(cfg, tmp_path, "job.json")
    hook = tmp_path / "hold_at_3"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_AT_3)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kit", "train", "launch", "--config", str(config_path)],
        env=env,
        cwd=str(repo_root()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    chunks: list = []  # drained by a thread so a chatty job can never block on a full pipe
    reader = threading.Thread(target=lambda: chunks.extend(proc.stdout), daemon=True)
    reader.start()
    metrics = cfg.log_dir() / "pretrain.metrics.jsonl"
    try:
        wait_for_metrics(metrics, 3, proc, chunks)
        # a second launch of the same run while it trains is refused, and touches none of its files
        plan_file = cfg.output_dir() / "plan.json"
        before = plan_file.read_bytes()
        with pytest.raises(LockedError, match="is being written by another run"):
            launch(cfg, progress=False)
        assert plan_file.read_bytes() == before
        tree = psutil.Process(proc.pid).children(recursive=True)  # torchrun and its ranks (own sessions)
        ranks = [p for p in tree if runs_kit_train(p.cmdline())]
        assert len(ranks) == 2, [p.cmdline() for p in tree]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=600)  # a ceiling only
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=60)
    output = "".join(chunks)
    assert rc == EXIT_PREEMPTED, output
    assert not _alive(tree), [p.cmdline() for p in _alive(tree)]  # nothing of the job survives the launcher
    ckpt_root = cfg.output_dir() / "checkpoints"
    assert latest_iteration(ckpt_root) == 3, output
    state = json.loads((ckpt_root / "iter_0000003" / "trainer_state.json").read_text())
    assert state["iteration"] == 3 and state["consumed_samples"] == 3 * cfg.gbs
    # both ranks stopped there; the output says so once and ends with it (torchrun's report: the launcher log only)
    log = (cfg.log_dir() / "pretrain.launcher.log").read_text(encoding="utf-8")
    assert log.count("kit train: preempted at iteration 3") == 2 and "kit FAILED" in log
    shown = [ln for ln in output.splitlines() if ln.strip()]
    assert output.count("kit train: preempted at iteration 3") == 1 and "kit FAILED" not in output, output
    assert "resume with RUN_TYPE=retrain" in shown[-1], "\n".join(shown[-8:])
    # and the job continues from there (the same 2 ranks)
    resumed = launch(
        TrainConfig(run_type="retrain", model_name="tiny", work_dir=str(tmp_path / "ws"), train_iters=5),
        progress=False,
    )
    assert resumed.ok and resumed.status == "completed", "\n".join(resumed.tail)
    assert resumed.iterations == [4, 5] and latest_iteration(ckpt_root) == 5


FAIL_IN_RANKS = """
import importlib.machinery, sys


class FailInRanks:
    def find_spec(self, name, path=None, target=None):
        if name != "kit.train.trainer":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)

            def fail(self, *args, **kwargs):
                from kit.errors import InputError

                raise InputError("row 7 of the dataset is damaged - prepare it again (notebook 02)")

            module.Trainer.train = fail

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, FailInRanks())
"""


def test_a_failed_rank_ends_the_launch_with_its_own_line_and_exit_code(tmp_path, tiny_llama_dir):
    """Both ranks fail with an expected error (exit 2): `kit train launch` prints the rank's `error:` line once, as
    its last line, and exits 2 (torchrun itself exits 1); torchrun's traceback and report go to the launcher log."""
    data = H.make_pretrain(tmp_path / "p_hf", num_samples=16)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", train_iters=4, nproc_per_node=2, mbs=1)
    config_path = save_config(cfg, tmp_path, "job.json")
    hook = tmp_path / "fail_in_ranks"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FAIL_IN_RANKS)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "kit", "train", "launch", "--config", str(config_path)],
        env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"),
        cwd=str(repo_root()),
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = "error: row 7 of the dataset is damaged - prepare it again (notebook 02)"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [line] and "Traceback" not in proc.stdout
    log = (cfg.log_dir() / "pretrain.launcher.log").read_text(encoding="utf-8")
    # each rank that got as far as its error printed it (torchrun may stop the second first, on a busy machine)
    assert log.count(line) >= 1 and "ChildFailedError" in log and "failed (exitcode: 2)" in log


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["sigint", "sigterm", "sigkill"]
)
def test_a_launcher_stopped_while_waiting_for_its_peers_leaves_no_process(tmp_path, tiny_llama_dir, sig):
    """Node 0 of a 2-node job whose node 1 never comes: Ctrl-C or SIGTERM ends it and its torchrun; so does killing
    the launcher (torchrun gets SIGTERM when its parent dies)."""
    import psutil

    from kit.system.procs import free_port, without_in_process_rendezvous

    data = H.make_pretrain(tmp_path / "p_hf", num_samples=16)
    cfg = H.tiny_config(tiny_llama_dir, data, tmp_path / "ws", nnodes=2, master_addr="127.0.0.1")
    config_path = save_config(cfg, tmp_path, "job.json")
    # without an earlier in-process training's rendezvous (its marker would make the job take port 6000, not this
    # free one, and a job of a test on another worker may hold 6000)
    env = dict(without_in_process_rendezvous(dict(os.environ)), MASTER_PORT=str(free_port()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kit", "train", "launch", "--config", str(config_path)],
        env=env,
        cwd=str(repo_root()),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = cfg.log_dir() / "pretrain.launcher.node0.log"
        deadline = time.monotonic() + 600  # a ceiling only: returns once torchrun has started
        while not (log.is_file() and psutil.Process(proc.pid).children()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        tree = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, EXIT_PREEMPTED), out  # nothing was trained
    if sig != signal.SIGKILL:
        assert "no rank had started" in out
    else:  # nobody is left to wait for torchrun: poll (a ceiling only)
        psutil.wait_procs(tree, timeout=120)
    assert not _alive(tree), [p.cmdline() for p in _alive(tree)]


def test_cli_run_reports_config_problems(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kit",
            "train",
            "run",
            "--run-type",
            "pretrain",
            "--gbs",
            "3",
            "--mbs",
            "2",
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=str(repo_root()),
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "GBS=3 is not divisible by MBS x DP = 2 x 1" in out.stderr
    assert "preparing" not in out.stdout and not list(
        tmp_path.rglob("*_hf")
    )  # checked before any data is made


def test_launch_command_and_environment_for_multi_node_npu(tmp_path, monkeypatch):
    from kit.train.launch import job_config

    monkeypatch.setenv("RANK", "0")  # left behind by an in-kernel run: must not reach the job
    cfg = job_config(
        TrainConfig(nnodes=2, node_rank=1, nproc_per_node=8, master_addr="10.0.0.1", work_dir=str(tmp_path))
    )
    assert cfg.master_port == 6000  # the same on every node
    cmd = launch_command(cfg, tmp_path / "c.json")
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert {
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=8",
        "--master_addr=10.0.0.1",
        "--master_port=6000",
    } <= set(cmd)
    assert cmd[cmd.index("-m", 3) :] == [
        "-m",
        "kit",
        "train",
        "run",
        "--plan",
        str(tmp_path / "c.json"),
        "--no-progress",
    ]
    from kit.train.launch import deepspeed_runs_one_node_per_launcher

    if (
        deepspeed_runs_one_node_per_launcher()
    ):  # older DeepSpeed refuses a multi-node launch (test_train_multinode)
        ds = launch_command(cfg, tmp_path / "c.json", launcher="deepspeed")
        assert (
            ds[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
            and "--num_gpus=8" in ds
            and "--module" in ds
        )
    env = launch_env(cfg, "npu", visible_devices="0,1,2,3,4,5,6,7")
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7" and "RANK" not in env
    assert (
        env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True" and env["HCCL_CONNECT_TIMEOUT"] == "3600"
    )
    assert str(repo_root()) in env["PYTHONPATH"].split(":")
    cpu = launch_env(TrainConfig(nproc_per_node=2), "cpu")
    assert int(cpu["OMP_NUM_THREADS"]) >= 1


def test_npu_jobs_get_task_queue_and_cpu_affinity_unless_set(tmp_path, tiny_llama_dir, monkeypatch):
    """Ascend's tuning guide: TASK_QUEUE_ENABLE=2 and CPU_AFFINITY_CONF=1 for training; a user's value wins."""
    cfg = H.tiny_config(tiny_llama_dir, tmp_path / "data", tmp_path / "ws")
    monkeypatch.delenv("TASK_QUEUE_ENABLE", raising=False)
    monkeypatch.setenv("CPU_AFFINITY_CONF", "2")
    env = launch_env(cfg, "npu")
    assert env["TASK_QUEUE_ENABLE"] == "2" and env["CPU_AFFINITY_CONF"] == "2"
    monkeypatch.delenv("CPU_AFFINITY_CONF")
    assert launch_env(cfg, "npu")["CPU_AFFINITY_CONF"] == "1"
    cpu = launch_env(cfg, "cpu")
    assert "TASK_QUEUE_ENABLE" not in cpu and "CPU_AFFINITY_CONF" not in cpu


def test_task_queue_zero_forced_by_torch_npu_in_a_kernel_is_not_inherited(
    tmp_path, tiny_llama_dir, monkeypatch
):
    """torch_npu sets TASK_QUEUE_ENABLE=0 when imported under IPython; the launched job gets 2 back."""
    import builtins

    from npu_standin import install

    install(monkeypatch)  # torch_npu (the stand-in) is imported in this process
    cfg = H.tiny_config(tiny_llama_dir, tmp_path / "data", tmp_path / "ws")
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "0")
    assert launch_env(cfg, "npu")["TASK_QUEUE_ENABLE"] == "0"  # a script: the 0 is the user's
    monkeypatch.setattr(builtins, "__IPYTHON__", True, raising=False)
    assert launch_env(cfg, "npu")["TASK_QUEUE_ENABLE"] == "2"


def test_a_signal_while_the_job_starts_stops_it_once_it_exists():
    """Ctrl-C between the launcher's start and its first line: the Stopper holds it, then stops the job it gets."""
    from kit.system.procs import Stopper

    stopper = Stopper(grace_s=60)
    stopper(signal.SIGINT)
    assert stopper.pending == signal.SIGINT and stopper.killer is None
    proc = Proc(["sleep", "60"], ranks=runs_kit_train)
    try:
        assert proc.notes == [] and proc.stopped_by is None
        stopper.attach(proc)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert stopper.killer is not None and proc.stopped_by == "SIGINT"
        assert proc.notes == [
            "SIGINT: sent SIGTERM to the launcher (no rank had started) so the job checkpoints and exits"
        ]
    finally:
        stopper.killer.cancel()
        proc.kill()
        proc.wait()


def test_output_is_read_until_the_launcher_exits_not_until_every_descendant_closes_it():
    """A process the launcher left behind keeps the pipe open: the reading ends `drain_s` after the launcher exited
    (with a note), having passed on every line; killing the leftovers is the caller's (Proc.kill)."""
    import psutil

    proc = Proc(["sh", "-c", "echo first; sleep 60 & echo $!; echo last"])
    notes, holder = [], None
    try:
        lines = []
        for line in proc.lines(notes.append, drain_s=1.0):
            if line and len(lines) == 1:
                holder = psutil.Process(int(line))
            lines += [line] if line else []
        assert lines[0] == "first\n" and lines[2] == "last\n" and len(lines) == 3 and proc.poll() == 0
        assert holder.name() == "sleep" and holder.is_running()  # it still holds the pipe: no EOF came
        assert notes == [
            "the launcher exited (0) but a process it started still holds its output 1 s later: killing what is "
            "left of the job"
        ]
        proc.kill()  # its process group: the leftover too
        assert psutil.wait_procs([holder], timeout=60)[1] == []
    finally:
        proc.kill()
        proc.wait()


def test_a_left_behind_process_that_keeps_writing_cannot_hold_the_launcher_either(tmp_path):
    """The drain is counted from the launcher's exit, not from the last quiet moment."""
    import psutil

    writer = "for i in $(seq 600); do echo more; sleep 0.1; done"  # 60 s at most, killed below
    pid_file = tmp_path / "writer.pid"  # not on the pipe: the writer may print before `echo $!` does
    proc = Proc(["sh", "-c", f"({writer}) & echo $! > {pid_file}"])
    notes = []
    try:
        lines = [line for line in proc.lines(notes.append, drain_s=1.0) if line]
        holder = psutil.Process(int(pid_file.read_text()))  # written before the launcher exited
        assert proc.poll() == 0 and holder.is_running() and set(lines) == {"more\n"}
        assert len(notes) == 1 and "still holds its output 1 s later" in notes[0]
    finally:
        proc.kill()  # the writer is in the launcher's process group
        proc.wait()


def test_a_rank_whose_obs_uploads_failed_decides_the_jobs_status(tmp_path):
    """Every rank prints how it ended; the local rank 0 whose OBS_HOME uploads failed says upload_failed, the
    others completed, in any order: the job is upload_failed, not ok."""
    import io

    from kit.train.launch import LaunchResult, _consume

    class Bar:
        n = 0

    failed = "kit train: upload_failed at iteration 2: trained 2 iterations; but an upload failed\n"
    done = "kit train: completed at iteration 2: trained 2 iterations\n"
    for lines in ((done, failed, done), (failed, done)):
        result = LaunchResult(2, tmp_path / "log", [])
        for line in lines:
            _consume(line, io.StringIO(), [], False, result, Bar())
        assert result.status == "upload_failed" and not result.ok
