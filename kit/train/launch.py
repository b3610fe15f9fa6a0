"""Run training as a subprocess (torchrun or the DeepSpeed launcher), streaming progress back to the notebook.

Why a subprocess: importing torch_npu inside IPython forces TASK_QUEUE_ENABLE=0 (slower), and a launched job can
use every card and every node (the MindSpeed-LLM example scripts launch with torchrun the same way).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kit.configs import check, save_config
from kit.train.config import TrainConfig
from kit.train.jobenv import modelarts_env  # noqa: F401  (the ModelArts job mapping; kit.job builds on it)
from kit.workspace import repo_root

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


STATUS_PREFIX = (
    "kit train: "  # what `python -m kit train run` prints last: "kit train: <status> at iteration N"
)


def job_config(cfg: TrainConfig) -> TrainConfig:
    """The config a launched job runs, with its rendezvous port fixed now.

    One node: a free port. Several nodes: every node must use the same one, so MASTER_PORT or 6000 (the port the
    MindSpeed-LLM scripts use).
    """
    from kit.train.engine import free_port

    port = cfg.master_port or (6000 if cfg.nnodes > 1 else free_port())
    return dataclasses.replace(cfg, master_port=port)


def launch_command(cfg: TrainConfig, config_path: Path, launcher: str = "torchrun") -> list:
    """argv that runs `python -m kit train run --config <file>` on NPROC_PER_NODE processes of this node."""
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={cfg.nnodes}",
            f"--node_rank={cfg.node_rank}",
            f"--nproc_per_node={cfg.nproc_per_node}",
            f"--master_addr={cfg.master_addr}",
            f"--master_port={cfg.master_port}",
            "-m",
            "kit",
            "train",
            "run",
            "--config",
            str(config_path),
            "--no-progress",
        ]
    if launcher == "deepspeed":
        # The DeepSpeed launcher passes ASCEND_RT_VISIBLE_DEVICES on NPU (accelerator.visible_devices_envs()).
        return [
            "deepspeed",
            f"--num_nodes={cfg.nnodes}",
            f"--node_rank={cfg.node_rank}",
            f"--num_gpus={cfg.nproc_per_node}",
            f"--master_addr={cfg.master_addr}",
            f"--master_port={cfg.master_port}",
            "--no_ssh",
            "--module",
            "kit",
            "train",
            "run",
            "--config",
            str(config_path),
            "--no-progress",
        ]
    raise ValueError(f"launcher {launcher!r} is not one of torchrun, deepspeed.")


def launch_env(cfg: TrainConfig, kind: str, visible_devices: Optional[str] = None) -> dict:
    """The child's environment: kit importable, unbuffered output, the device's visible-cards variable, NPU env."""
    from kit.device import VISIBLE_DEVICES_ENV

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo_root()), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a notebook that trained in-process has set these for a world of one
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
    status: str = ""  # the trainer's own verdict: completed | preempted | nan ("" if it never said)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Finished, or stopped on request with a checkpoint (its ranks exit EXIT_PREEMPTED, which torchrun reports
        as 1 like it does when it is signalled itself)."""
        if self.status == "preempted":
            return True
        return self.status == "completed" and (self.returncode == 0 or self.stopped)


def stop(proc: subprocess.Popen, grace_s: float = 120.0) -> int:
    """Ask the job to stop (SIGTERM to its process group: ranks checkpoint and exit), then kill after `grace_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def launch(
    cfg: TrainConfig,
    launcher: str = "torchrun",
    progress: bool = True,
    tail_lines: int = 8,
    visible_devices: Optional[str] = None,
    echo: bool = False,
    ws: Any = None,
) -> LaunchResult:
    """Validate, write the job config, start the job and stream it: a progress bar, the log tail, a clean stop.

    Interrupting the cell (Ctrl-C / the stop button) sends SIGTERM to the job, which saves a checkpoint first.
    """
    from tqdm.auto import tqdm

    from kit.device import detect
    from kit.train.config import check_settings
    from kit.train.logs import parse_line
    from kit.train.resolve import resolve

    check_settings(cfg)  # what is wrong without the inputs, before any data is found or prepared
    cfg = job_config(check(resolve(cfg, ws), "training config"))
    out = cfg.output_dir()
    out.mkdir(parents=True, exist_ok=True)
    config_path = save_config(cfg, out, "launch_config.json")
    cmd = launch_command(cfg, config_path, launcher)
    log_path = cfg.log_dir() / f"{out.name}.launcher.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = launch_env(cfg, detect().kind, visible_devices)
    t0 = time.time()
    result = LaunchResult(returncode=-1, log_path=log_path, command=cmd)
    tail = collections.deque(maxlen=tail_lines)
    bar = tqdm(total=cfg.train_iters, desc=f"{cfg.run_type} (launched)", disable=not progress)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=str(repo_root()),
            start_new_session=True,
            bufsize=1,
        )
        try:
            for line in proc.stdout:
                log.write(line)
                line = line.rstrip("\n")
                tail.append(line)
                if echo:
                    print(line, flush=True)
                if line.startswith(STATUS_PREFIX):
                    result.status = line[len(STATUS_PREFIX) :].split(" ", 1)[0]
                rec = parse_line(line)
                if rec and "loss" in rec:
                    result.iterations.append(rec["iteration"])
                    result.losses.append(rec["loss"])
                    bar.n = rec["iteration"]
                    bar.set_postfix(loss=f"{rec['loss']:.4f}")
                    bar.refresh()
            proc.wait()
        except KeyboardInterrupt:
            result.stopped = True
            log.write("kit: interrupted; sending SIGTERM so the job checkpoints and exits\n")
            stop(proc)
        finally:
            bar.close()
    result.returncode = proc.returncode
    result.tail = list(tail)
    result.seconds = time.time() - t0
    return result
