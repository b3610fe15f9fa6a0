"""Run training as a subprocess (torchrun or the DeepSpeed launcher), streaming progress back to the notebook.

Why a subprocess: importing torch_npu inside IPython forces TASK_QUEUE_ENABLE=0 (slower), and a launched job can
use every card and every node (the MindSpeed-LLM example scripts launch with torchrun the same way).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from kit.core.i18n import t
from kit.core.workspace import repo_root
from kit.errors import ERROR_PREFIX, InputError
from kit.system.procs import STOP_GRACE_S, free_port, running, runs_kit_train, torchrun_command
from kit.train.config import TrainConfig
from kit.train.jobenv import modelarts_env  # noqa: F401  (the ModelArts job mapping; kit.train.job builds on it)
from kit.train.resolve import TrainPlan

# Environment the MindSpeed-LLM scripts set for NPU jobs; user values win. TASK_QUEUE_ENABLE=2 (level-2 task
# queue: operator dispatch split across two threads) and CPU_AFFINITY_CONF=1 (bind each rank's threads to the
# cores of its NPU's NUMA node) are what Ascend's PyTorch performance-tuning guide recommends for training. Both
# are read when torch_npu starts, so they go into the child's environment (torch_npu 2.13.0
# `_init/core/optional_features.py` even forces TASK_QUEUE_ENABLE=0 inside an interactive session).
NPU_ENV = {
    "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
    "HCCL_CONNECT_TIMEOUT": "3600",
    "HCCL_EXEC_TIMEOUT": "3600",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "TASK_QUEUE_ENABLE": "2",
    "CPU_AFFINITY_CONF": "1",
}


ERROR_PREFIXES = tuple(ERROR_PREFIX.values())  # a rank's one-line error, in any language of the kit
STATUS_PREFIX = (
    "kit train: "  # what `python -m kit train run` prints last: "kit train: <status> at iteration N"
)


def job_config(cfg: TrainConfig) -> TrainConfig:
    """The config a launched job runs, with its rendezvous port fixed now.

    One node: a free port. Several nodes: every node must use the same one, so MASTER_PORT or 6000 (the port the
    MindSpeed-LLM scripts use).
    """
    # a port an earlier launch picked is recorded as the default (a config the kit wrote): picked again now
    given = cfg.master_port if not cfg.sources.get("master_port", "").startswith("default") else 0
    port = given or (6000 if cfg.nnodes > 1 else free_port())
    return dataclasses.replace(cfg, master_port=port)


def node_suffix(cfg: TrainConfig) -> str:
    """What names this node's own files in a folder every node shares: "" on one node, ".node<NODE_RANK>" else."""
    return f".node{cfg.node_rank}" if cfg.nnodes > 1 else ""


def hostfile_text(cfg: TrainConfig, visible_devices: Optional[str] = None) -> str:
    """The DeepSpeed launcher's hostfile for the job: one line per node, `node-<i> slots=<cards>`.

    With --no_ssh each node's launcher starts only its own ranks and reads the hostfile for the job's shape (host
    names are labels then). Without one it forces MASTER_ADDR to 127.0.0.1 and refuses NUM_NODES > 1 (DeepSpeed
    0.19 `launcher/runner.py` main).
    """
    ids = [int(v) for v in (visible_devices or "").split(",") if v.strip()]
    slots = max(ids) + 1 if ids else cfg.nproc_per_node
    return "".join(f"node-{i} slots={slots}\n" for i in range(cfg.nnodes))


def deepspeed_runs_one_node_per_launcher() -> bool:
    """Whether this DeepSpeed's launcher takes --no_ssh and --node_rank (each node starts its own ranks): 0.15.4 does,
    0.14.4 does not (its runner.py knows only --no_ssh_check)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("deepspeed")) >= Version("0.15")


def launch_command(
    cfg: TrainConfig, plan_path: Path, launcher: str = "torchrun", visible_devices: Optional[str] = None
) -> list:
    """argv that runs `python -m kit train run --plan <file>` on NPROC_PER_NODE processes of this node.

    DeepSpeed: this Python's own launcher (`-m deepspeed.launcher.runner`, whatever PATH says), --no_ssh with the
    hostfile written beside the plan (`<plan>.hostfile`), --no_local_rank (ranks read LOCAL_RANK).
    """
    script = ["-m", "kit", "train", "run", "--plan", str(plan_path), "--no-progress"]
    if launcher == "torchrun":
        return torchrun_command(
            script, cfg.nproc_per_node, cfg.master_port, cfg.nnodes, cfg.node_rank, cfg.master_addr
        )
    if launcher == "deepspeed":
        # The DeepSpeed launcher passes ASCEND_RT_VISIBLE_DEVICES on NPU (accelerator.visible_devices_envs()).
        ids = [v.strip() for v in (visible_devices or "").split(",") if v.strip()]
        if ids:  # these cards on every node (--include cannot go with --num_nodes / --num_gpus)
            shape = ["--include=" + "@".join(f"node-{i}:{','.join(ids)}" for i in range(cfg.nnodes))]
        else:
            shape = [f"--num_nodes={cfg.nnodes}", f"--num_gpus={cfg.nproc_per_node}"]
        if not deepspeed_runs_one_node_per_launcher():
            raise InputError(
                "this DeepSpeed's launcher has no --no_ssh / --node_rank (DeepSpeed 0.15 has them): it would ssh "
                "to the hostfile's nodes or count CPU devices with numactl; use LAUNCHER=torchrun or a newer "
                "DeepSpeed."
            )
        return [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            f"--hostfile={hostfile_path(plan_path)}",
            *shape,
            f"--node_rank={cfg.node_rank}",
            f"--master_addr={cfg.master_addr}",
            f"--master_port={cfg.master_port}",
            "--no_ssh",
            "--no_local_rank",
            "--module",
            *script[1:],
        ]
    raise ValueError(f"launcher {launcher!r} is not one of torchrun, deepspeed.")


def hostfile_path(plan_path: Path) -> Path:
    return Path(str(plan_path) + ".hostfile")


def launch_env(cfg: TrainConfig, kind: str, visible_devices: Optional[str] = None) -> dict:
    """The child's environment: kit importable, unbuffered output, the device's visible-cards variable, NPU env."""
    from kit.system.device import VISIBLE_DEVICES_ENV

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    from kit.system.procs import in_process_env

    for key in in_process_env(""):
        env.pop(key, None)  # a notebook that trained in-process has set these for a world of one
    for key in ("ASCEND_DEVICE_ID", "RANK_ID", "RANK_SIZE"):
        env.pop(
            key, None
        )  # a per-card boot's (kit.train.jobenv.launching_card): the ranks bind by LOCAL_RANK
    # torchrun gives its ranks this long to exit after it is signalled itself (default 30 s): a checkpoint of a
    # big model takes longer (torch 2.13's launcher/api.py reads it; older ones keep 30 s)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(STOP_GRACE_S)))
    var = VISIBLE_DEVICES_ENV.get(kind)
    if var and visible_devices is not None:
        env[var] = visible_devices
    if kind == "npu":
        if _task_queue_forced_off(env):
            env.pop(
                "TASK_QUEUE_ENABLE"
            )  # torch_npu's value for this kernel, not the user's: the job is not interactive
        for key, value in NPU_ENV.items():
            env.setdefault(key, value)
    if kind == "cpu":
        # Each process would otherwise start one thread per core and the processes fight over them.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.nproc_per_node)))
    return env


def _task_queue_forced_off(env: dict) -> bool:
    """True when TASK_QUEUE_ENABLE=0 was written by torch_npu itself in this interactive process.

    torch_npu (2.13.0 `_init/core/optional_features.py`) overwrites TASK_QUEUE_ENABLE with 0 at import when it
    runs under IPython/Jupyter or a `>>>` prompt, whatever the user had set; a launched job would inherit that.
    """
    if env.get("TASK_QUEUE_ENABLE") != "0" or "torch_npu" not in sys.modules:
        return False
    import builtins

    return hasattr(sys, "ps1") or hasattr(builtins, "__IPYTHON__")


@dataclass
class LaunchResult:
    """How a launched job ended: return code, its log, the last lines, the iterations seen."""

    returncode: int
    log_path: Path
    command: list
    tail: list = field(default_factory=list)
    iterations: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    stopped: bool = False
    status: str = (
        ""  # the trainer's verdict: completed | preempted | nan | upload_failed ("" if it never said)
    )
    seconds: float = 0.0
    rank_exit: Optional[int] = None  # the exit code of the first rank that failed (torchrun itself exits 1)
    rank_lines: list = field(default_factory=list)  # the ranks' `error:` and status lines, each shown once
    launcher_report: bool = False  # torchrun reported a failed rank: its report went to the launcher log only

    @property
    def ok(self) -> bool:
        """Finished, or stopped on request with a checkpoint (its ranks exit EXIT_PREEMPTED, which torchrun reports
        as 1 like it does when it is signalled itself)."""
        if self.status == "preempted":
            return True
        return self.status == "completed" and (self.returncode == 0 or self.stopped)


def launch(
    run: Union[TrainConfig, TrainPlan],
    launcher: str = "torchrun",
    progress: bool = True,
    tail_lines: int = 8,
    visible_devices: Optional[str] = None,
    echo: bool = False,
    ws: Any = None,
    grace_s: float = STOP_GRACE_S,
    force: bool = False,
) -> LaunchResult:
    """Resolve `run` once (a TrainPlan is taken as it is), write the plan its ranks read, start the job and stream
    it: a progress bar, the log tail, a clean stop.

    Interrupting the cell (Ctrl-C / the stop button; SIGTERM or SIGINT to this process) sends SIGTERM to the ranks,
    which save a checkpoint and exit (kit.system.procs.Stopper); what is still alive `grace_s` later is killed, and
    nothing the job started outlives this call. Several nodes: this node's config and launcher log carry
    `.node<NODE_RANK>`.

    A run the planner (kit.plan) says does not fit this node's cards is refused before anything starts, in one
    line (InputError) naming its largest term and the nearest plan that fits; `force=True` launches it anyway.
    """
    from kit.system.device import detect
    from kit.system.progress import bar as progress_bar
    from kit.system.progress import in_kernel
    from kit.train.live import RunView
    from kit.train.resolve import resolve

    plan = run if isinstance(run, TrainPlan) else resolve(run, ws)
    plan = dataclasses.replace(plan, cfg=job_config(plan.cfg))
    cfg, out = plan.cfg, plan.folder
    if not force:
        from kit.plan.report import local_refusal

        refusal = local_refusal(plan)
        if refusal:
            raise InputError(t("train.refused_does_not_fit", refusal=refusal))
    if cfg.node_rank == 0:  # its rank 0 will hold the run's lock: a run already training there is not touched
        from kit.storage.locks import check_free

        check_free(out, "training run")
    out.mkdir(parents=True, exist_ok=True)
    plan_path = plan.save(out / f"plan{node_suffix(cfg)}.json")
    if launcher == "deepspeed":
        hostfile_path(plan_path).write_text(hostfile_text(cfg, visible_devices), encoding="utf-8")
    cmd = launch_command(cfg, plan_path, launcher, visible_devices)
    log_path = cfg.log_dir() / f"{out.name}.launcher{node_suffix(cfg)}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = launch_env(cfg, detect().kind, visible_devices)
    t0 = time.time()
    result = LaunchResult(returncode=-1, log_path=log_path, command=cmd)
    tail = collections.deque(maxlen=tail_lines)
    # in a notebook the live view from rank 0's log lines (kit.train.live), elsewhere tqdm's bar
    view = (
        RunView(cfg.train_iters, title=f"{cfg.run_type} ({out.name}, launched)")
        if progress and in_kernel()
        else None
    )
    bar = progress_bar(
        total=cfg.train_iters, desc=f"{cfg.run_type} (launched)", disable=not progress or view is not None
    )
    with open(log_path, "a", encoding="utf-8") as log:

        def note(text: str) -> None:
            log.write(f"kit: {text}\n")
            log.flush()
            tail.append(f"kit: {text}")
            if echo:
                print(f"kit: {text}", flush=True)

        log.write(f"$ {' '.join(cmd)}\n")
        if cfg.nnodes > 1 and is_loopback(cfg.master_addr):
            note(f"MASTER_ADDR={cfg.master_addr}: all {cfg.nnodes} nodes run on this host (a rehearsal)")
        # SIGTERM/SIGINT to this process: SIGTERM to the ranks, which checkpoint and exit; nothing of the job
        # survives the block
        with running(cmd, grace_s, env=env, cwd=str(repo_root()), ranks=runs_kit_train) as job:
            try:
                for line in job.lines(note):
                    if line:
                        _consume(line, log, tail, echo, result, bar, view)
            finally:
                bar.close()
        while job.notes:
            note(job.notes.pop(0))
    result.stopped = job.stopped_by is not None
    result.returncode = job.returncode
    result.tail = list(tail)
    result.seconds = time.time() - t0
    if view is not None:
        view.close(result.rank_lines[-1] if result.rank_lines else f"launched run ended: {result.status}")
    return result


def is_loopback(addr: str) -> bool:
    """True for localhost and any 127.x / ::1 address (every node of the job then runs on this host)."""
    import ipaddress

    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


# torchrun's line when a rank fails (torch/distributed/elastic/multiprocessing/api.py); what follows it is torchrun's
# own traceback and failure report, which the launcher log keeps and the user's output does not repeat
_RANK_FAILED = re.compile(r"\] failed \(exitcode: (-?\d+)\) local_rank: \d+")
# torchrun's own log lines (its elastic agent, glog style: W1205 00:26:30.858000 PID .../elastic/...): the log only
_AGENT_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/")


def _consume(line: str, log, tail, echo: bool, result: LaunchResult, bar, view=None) -> None:
    """One line of the job's output: to the log, the tail, the status and the progress bar. A rank's `error:` and
    status lines are shown once however many ranks print them, and torchrun's report of a failed rank only in the
    log, so a failed launch ends with the rank's own line."""
    from kit.train.logs import parse_line

    log.write(line)
    line = line.rstrip("\n")
    failed = _RANK_FAILED.search(line)
    if failed and result.rank_exit is None:
        result.rank_exit, result.launcher_report = int(failed.group(1)), True
    if result.launcher_report or _AGENT_LINE.match(line):
        return
    if line.startswith(ERROR_PREFIXES) or line.startswith(STATUS_PREFIX):
        if line in result.rank_lines:
            return  # the same line from another rank
        result.rank_lines.append(line)
    tail.append(line)
    if echo:
        print(line, file=sys.stderr if line.startswith(ERROR_PREFIXES) else sys.stdout, flush=True)
    if line.startswith(STATUS_PREFIX) and result.status in ("", "completed"):
        # every rank says how it ended; one whose OBS uploads failed says so, the others "completed"
        result.status = line[len(STATUS_PREFIX) :].split(" ", 1)[0]
    rec = parse_line(line)
    if rec and "loss" in rec:
        result.iterations.append(rec["iteration"])
        result.losses.append(rec["loss"])
        bar.n = rec["iteration"]
        bar.set_postfix(loss=f"{rec['loss']:.4f}")
        bar.refresh()
        if view is not None:
            view.update(rec)
