"""Multi-node jobs rehearsed on one host: two `kit train launch` agents on loopback (torchrun, DeepSpeed), the
ModelArts job environment mapped to the launch settings, one launcher per node under a per-card boot."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import test_train_helpers as H

from kit.core.configs import save_config
from kit.core.manifest import read_manifest
from kit.core.workspace import repo_root
from kit.errors import InputError
from kit.system.procs import free_port, without_in_process_rendezvous
from kit.train import TrainConfig, train
from kit.train.jobenv import launching_card, modelarts_env
from kit.train.launch import hostfile_text, job_config, launch, launch_command
from kit.train.metrics import read_metrics
from kit.train.resolve import ConfigConflictError, resolve_values

COMMON = dict(train_iters=3, gbs=4, mbs=1, lr=3e-3, warmup_iters=0)
JOB_VARS = ("MA_NUM_HOSTS", "VC_WORKER_NUM", "VC_TASK_INDEX", "VC_WORKER_HOSTS", "MA_NUM_GPUS")
KIT_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")


def _clean_env(**extra) -> dict:
    # without the rendezvous of a training this pytest process ran in-process (another test's): its marker would
    # make the job ignore the MASTER_PORT given here and take 6000, which a job of a test on another worker may hold
    env = {
        k: v
        for k, v in without_in_process_rendezvous(dict(os.environ)).items()
        if k not in JOB_VARS + KIT_VARS
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root()), PYTHONFAULTHANDLER="1", **extra)
    return env


@pytest.fixture(scope="module")
def job_inputs(tmp_path_factory, tiny_llama_dir):
    """The data, and the losses of one process with the same global batch (the reference of every job here)."""
    root = tmp_path_factory.mktemp("multinode")
    data = H.make_pretrain(root / "p_hf", num_samples=16)
    single = train(H.tiny_config(tiny_llama_dir, data, root / "one", **COMMON), progress=False)
    assert single.status == "completed" and len(single.losses) == 3
    return root, data, single.losses


def _given(cfg: TrainConfig, path) -> str:
    """A config file with only the values set (as a user writes one): the rest come from each node's environment
    (a file that lists every field makes each explicit)."""
    from kit.core.configs import to_jsonable

    path.write_text(json.dumps({n: to_jsonable(getattr(cfg, n)) for n in cfg.given}), encoding="utf-8")
    return str(path)


def _agents(config_path, envs: list, launcher: str = "torchrun", timeout_s: float = 600) -> list:
    """Start one `python -m kit train launch` per node (its environment says which) and wait for all of them.

    Each node's output goes to a file (a pipe nobody reads while another node is waited for would fill and stop
    that node mid-job). Past `timeout_s` the failure shows every node's output and the processes still running.
    """
    import time

    import psutil

    cmd = [
        sys.executable,
        "-m",
        "kit",
        "train",
        "launch",
        "--config",
        str(config_path),
        "--launcher",
        launcher,
    ]
    logs = [Path(f"{config_path}.node{i}.out") for i in range(len(envs))]
    procs = []
    for env, log in zip(envs, logs):
        with open(log, "w", encoding="utf-8") as f:
            procs.append(
                subprocess.Popen(cmd, env=env, cwd=str(repo_root()), stdout=f, stderr=subprocess.STDOUT)
            )
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.5)
        running = [p for p in procs if p.poll() is None]
        if running:
            tree = []
            for p in running:
                try:  # one may end while it is listed
                    top = psutil.Process(p.pid)
                    tree += [c for c in [top, *top.children(recursive=True)]]
                except psutil.Error:
                    pass
            listed = [f"{c.pid} {' '.join(c.cmdline())}" for c in tree if c.is_running()]
            # where each process waits: SIGABRT makes faulthandler (PYTHONFAULTHANDLER, _clean_env) print every
            # thread's Python stack into its log; the ranks' go to the launcher logs
            # the leaves (the ranks) first, while their agents and launchers still copy what they print
            leaves = [c for c in tree if c.is_running() and not c.children()]
            for group in (leaves, [c for c in tree if c not in leaves]):
                for c in group:
                    try:
                        c.send_signal(signal.SIGABRT)
                    except psutil.Error:
                        pass
                time.sleep(3)
            launcher_logs = sorted(Path(config_path).parent.rglob("*.launcher*.log"))
            outs = "".join(f"--- node {i}:\n{log.read_text()}" for i, log in enumerate(logs))
            outs += "".join(f"--- {log.name}:\n{log.read_text()[-20000:]}" for log in launcher_logs)
            pytest.fail(
                f"the job did not end in {timeout_s:.0f} s; still running:\n"
                + "\n".join(listed)
                + "\n"
                + outs
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()  # the kit's launcher stops its job and leaves no process behind
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


@pytest.mark.slow
def test_two_node_job_from_the_modelarts_environment_matches_one_process(job_inputs, tiny_llama_dir):
    """Two torchrun agents on this host as nodes 0 and 1 of a ModelArts job (its injected variables only, hostnames
    that resolve to loopback): the losses of one process, per-node files, one manifest recording the whole job."""
    root, data, reference = job_inputs
    cfg = H.tiny_config(tiny_llama_dir, data, root / "two", **COMMON)
    config_path = _given(cfg, root / "two.json")
    port = str(free_port())
    job = dict(MA_NUM_HOSTS="2", VC_WORKER_HOSTS="localhost,localhost", MA_NUM_GPUS="1", MASTER_PORT=port)
    envs = [_clean_env(VC_TASK_INDEX=str(i), **job) for i in (0, 1)]
    results = _agents(config_path, envs)
    for rc, out in results:
        assert rc == 0, out
    out_dir = cfg.output_dir()
    losses = [r["loss"] for r in read_metrics(cfg.log_dir() / "pretrain.metrics.jsonl")]
    assert losses == pytest.approx(reference, rel=1e-4, abs=1e-5)
    # one launch config and one launcher log per node, each with its own node rank
    for i in (0, 1):
        launched = json.loads((out_dir / f"plan.node{i}.json").read_text())["cfg"]
        assert (
            launched["node_rank"] == i and launched["nnodes"] == 2 and launched["master_addr"] == "127.0.0.1"
        )
        assert launched["sources"]["nnodes"] == "environment MA_NUM_HOSTS (ModelArts training job)"
        log = (cfg.log_dir() / f"pretrain.launcher.node{i}.log").read_text()
        assert f"--node_rank={i}" in log and "a rehearsal" in log
    # the launchers' plans carry their node; plan.json is the plan global rank 0 trained
    assert sorted(p.name for p in out_dir.glob("plan*.json")) == [
        "plan.json",
        "plan.node0.json",
        "plan.node1.json",
    ]
    # the run's config and manifest are global rank 0's (node 0) and describe the job of 2 nodes
    man = read_manifest(out_dir)
    assert man["config"]["node_rank"] == 0 and man["config"]["nnodes"] == 2
    assert man["config"]["sources"]["node_rank"] == "environment VC_TASK_INDEX (ModelArts training job)"
    assert json.loads((out_dir / "config.json").read_text())["node_rank"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("nnodes", [1, 2])
def test_deepspeed_launcher_on_one_and_two_nodes_matches_one_process(job_inputs, tiny_llama_dir, nnodes):
    """The DeepSpeed launcher of this Python (not PATH's), --no_local_rank, the hostfile the kit writes."""
    from kit.train.launch import deepspeed_runs_one_node_per_launcher

    if not deepspeed_runs_one_node_per_launcher():
        pytest.skip(
            "DeepSpeed < 0.15: its launcher has no --no_ssh / --node_rank (refused in one line, tested)"
        )
    root, data, reference = job_inputs
    cfg = H.tiny_config(tiny_llama_dir, data, root / f"ds{nnodes}", **COMMON)
    config_path = _given(cfg, root / f"ds{nnodes}.json")
    job = dict(NNODES=str(nnodes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    envs = [_clean_env(NODE_RANK=str(i), PATH="/usr/bin:/bin", **job) for i in range(nnodes)]
    for rc, out in _agents(config_path, envs, launcher="deepspeed"):
        assert rc == 0, out
    losses = [r["loss"] for r in read_metrics(cfg.log_dir() / "pretrain.metrics.jsonl")]
    assert losses == pytest.approx(reference, rel=1e-4, abs=1e-5)
    suffix = ".node0" if nnodes > 1 else ""
    assert "-m deepspeed.launcher.runner" in (cfg.log_dir() / f"pretrain.launcher{suffix}.log").read_text()
    hostfile = cfg.output_dir() / f"plan{suffix}.json.hostfile"
    assert hostfile.read_text() == "".join(f"node-{i} slots=1\n" for i in range(nnodes))


def test_deepspeed_command_uses_this_python_and_a_hostfile(tmp_path):
    from kit.errors import InputError
    from kit.train.launch import deepspeed_runs_one_node_per_launcher

    cfg = TrainConfig(nnodes=2, node_rank=1, nproc_per_node=8, master_addr="10.0.0.1", master_port=6000)
    if not deepspeed_runs_one_node_per_launcher():  # DeepSpeed < 0.15 (the py39-torch21 stack): one line
        for nodes in (1, 2):
            with pytest.raises(InputError, match=r"no --no_ssh / --node_rank \(DeepSpeed 0\.15 has them\)"):
                launch_command(
                    dataclasses.replace(cfg, nnodes=nodes, node_rank=0), tmp_path / "c.json", "deepspeed"
                )
        return
    cmd = launch_command(cfg, tmp_path / "c.json", launcher="deepspeed")
    assert cmd[:3] == [sys.executable, "-m", "deepspeed.launcher.runner"]
    assert {"--no_ssh", "--no_local_rank", "--num_nodes=2", "--num_gpus=8", "--node_rank=1"} <= set(cmd)
    assert f"--hostfile={tmp_path / 'c.json'}.hostfile" in cmd
    assert hostfile_text(cfg) == "node-0 slots=8\nnode-1 slots=8\n"
    cards = launch_command(cfg, tmp_path / "c.json", launcher="deepspeed", visible_devices="4,5")
    assert "--include=node-0:4,5@node-1:4,5" in cards and not [a for a in cards if a.startswith("--num_")]
    assert hostfile_text(cfg, "4,5") == "node-0 slots=6\nnode-1 slots=6\n"


# ---- the ModelArts job environment (Huawei Cloud "训练作业环境变量") ------------------------------------------


def test_modelarts_variables_map_to_the_launch_settings():
    env = {
        "MA_NUM_HOSTS": "4",
        "VC_WORKER_NUM": "4",
        "VC_TASK_INDEX": "2",
        "VC_WORKER_HOSTS": "localhost,w-1.job,w-2.job,w-3.job",  # DNS names, first = node 0
        "MA_NUM_GPUS": "8",
        "MA_CURRENT_IP": "10.0.0.7",
    }
    got = modelarts_env(env, resolve_timeout_s=0)
    assert {k: v for k, (v, _) in got.items()} == {
        "nnodes": 4,
        "node_rank": 2,
        "master_addr": socket.gethostbyname("localhost"),  # resolved, not the name
        "nproc_per_node": 8,
    }
    assert (
        got["master_addr"][1] == "environment VC_WORKER_HOSTS (ModelArts training job) first host localhost"
    )
    assert modelarts_env({}) == {} and modelarts_env({"VC_WORKER_NUM": "3"})["nnodes"][0] == 3
    with pytest.raises(InputError, match=r"MA_NUM_HOSTS=2 but VC_WORKER_NUM=3"):
        modelarts_env({"MA_NUM_HOSTS": "2", "VC_WORKER_NUM": "3"})
    with pytest.raises(InputError, match=r"VC_WORKER_HOSTS names 1 node\(s\) but MA_NUM_HOSTS=2"):
        modelarts_env({"MA_NUM_HOSTS": "2", "VC_WORKER_HOSTS": "localhost"})
    with pytest.raises(InputError, match=r"'no-such-node\.invalid', which does not resolve"):
        modelarts_env({"VC_WORKER_HOSTS": "no-such-node.invalid"}, resolve_timeout_s=0)
    with pytest.raises(InputError, match=r"VC_TASK_INDEX='x' \(ModelArts training job\) is not an integer"):
        modelarts_env({"VC_TASK_INDEX": "x"})


def test_resolve_takes_the_job_environment_and_refuses_contradictions(tmp_path):
    job = {
        "MA_NUM_HOSTS": "2",
        "VC_TASK_INDEX": "1",
        "VC_WORKER_HOSTS": "localhost,localhost",
        "MA_NUM_GPUS": "1",
    }
    base = dict(
        run_type="retrain", work_dir=str(tmp_path)
    )  # retrain: resolves the launch settings, no inputs
    cfg = resolve_values(TrainConfig(**base), environ=job)
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node, cfg.master_addr) == (2, 1, 1, "127.0.0.1")
    assert cfg.sources["master_addr"].startswith("environment VC_WORKER_HOSTS (ModelArts training job)")
    # the kit's own variables and explicit values agreeing with the job are fine; the precedence stays
    same = resolve_values(
        TrainConfig(nnodes=2, master_addr="localhost", **base), environ=dict(job, NODE_RANK="1")
    )
    assert same.sources["nnodes"] == "explicit" and same.sources["node_rank"] == "environment NODE_RANK"
    with pytest.raises(ConfigConflictError, match=r"NNODES=4 \(explicit\) but 2 \(environment MA_NUM_HOSTS"):
        resolve_values(TrainConfig(nnodes=4, **base), environ=job)
    with pytest.raises(ConfigConflictError, match=r"NODE_RANK=0 \(environment NODE_RANK\) but 1"):
        resolve_values(TrainConfig(**base), environ=dict(job, NODE_RANK="0"))
    with pytest.raises(
        ConfigConflictError, match=r"MASTER_ADDR='10\.9\.9\.9' \(explicit\) but '127\.0\.0\.1'"
    ):
        resolve_values(TrainConfig(master_addr="10.9.9.9", **base), environ=job)
    # a config the kit wrote (a run's config.json) records its one-node launch settings as defaults: the job decides
    ran = TrainConfig(nnodes=1, node_rank=0, master_port=41234, sources={"nnodes": "default"}, **base)
    ran.sources.update(node_rank="default", master_port="default")
    job_run = resolve_values(ran, environ=job)
    assert (job_run.nnodes, job_run.node_rank, job_config(job_run).master_port) == (2, 1, 6000)
    # MASTER_PORT and NPROC_PER_NODE are read from the environment like the other launch variables
    kit = resolve_values(TrainConfig(**base), environ={"MASTER_PORT": "29511", "NPROC_PER_NODE": "4"})
    assert (kit.master_port, kit.nproc_per_node) == (29511, 4)
    assert kit.sources["master_port"] == "environment MASTER_PORT"
    # ... except the ones the kit wrote itself for a world of one in this process (a notebook that trained)
    kit_set = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "KIT_IN_PROCESS_LOCAL_SIZE": "29511"}
    own = resolve_values(TrainConfig(**base), environ=kit_set)
    assert own.master_port == 0 and own.sources["master_port"] == "default"
    assert without_in_process_rendezvous(dict(kit_set, PATH="/bin")) == {"PATH": "/bin"}
    # a port the user set since in that process (os.environ, `!MASTER_PORT=... python -m kit ...`) is the user's
    changed = dict(kit_set, MASTER_PORT="29600")
    mine = resolve_values(TrainConfig(**base), environ=changed)
    assert (mine.master_port, mine.sources["master_port"]) == (29600, "environment MASTER_PORT")
    assert mine.sources["master_addr"] == "default"  # still the kit's own 127.0.0.1
    assert without_in_process_rendezvous(changed) == {"MASTER_PORT": "29600"}


def test_loopback_master_is_a_rehearsal_not_an_error():
    assert not TrainConfig(nnodes=2, master_addr="127.0.0.1").problems()
    assert not TrainConfig(nnodes=2, master_addr="localhost").problems()
    assert any("MASTER_ADDR" in p for p in TrainConfig(nnodes=2, master_addr="").problems())


def test_one_launcher_per_node_when_the_boot_command_runs_once_per_card(tmp_path):
    assert launching_card({}) is None
    assert launching_card({"ASCEND_DEVICE_ID": "0"}) is None
    assert "ASCEND_DEVICE_ID=3" in launching_card({"ASCEND_DEVICE_ID": "3"})
    assert launching_card({"ASCEND_DEVICE_ID": "4", "ASCEND_VISIBLE_DEVICES": "4,5,6,7"}) is None
    assert launching_card({"RANK_ID": "8", "MA_NUM_GPUS": "8"}) is None
    assert "RANK_ID=9" in launching_card({"RANK_ID": "9", "MA_NUM_GPUS": "8"})
    # the other cards' boot processes exit 0 at once with the line, before any config is read
    cmd = [sys.executable, "-m", "kit", "train", "launch", "--config", str(tmp_path / "missing.json")]
    out = subprocess.run(
        cmd,
        env=_clean_env(ASCEND_DEVICE_ID="2"),
        cwd=str(repo_root()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "the boot command runs once per card" in out.stderr


def test_launch_refuses_a_job_that_contradicts_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MA_NUM_HOSTS", "2")
    monkeypatch.setenv("VC_TASK_INDEX", "0")
    with pytest.raises(ConfigConflictError, match=r"NNODES=4 \(explicit\)"):
        launch(TrainConfig(nnodes=4, work_dir=str(tmp_path)), progress=False)


def test_a_retrain_on_another_world_size_is_refused_before_anything_starts(tmp_path, monkeypatch):
    made = TrainConfig(run_type="pretrain", work_dir=str(tmp_path), model_name="m")
    save_config(made, made.output_dir())  # what a one-node run leaves (its config, a checkpoint folder)
    (made.output_dir() / "checkpoints" / "iter_0000002").mkdir(parents=True)
    monkeypatch.setenv("MA_NUM_HOSTS", "2")
    monkeypatch.setenv("VC_TASK_INDEX", "0")
    retrain = TrainConfig(run_type="retrain", work_dir=str(tmp_path), model_name="m")
    with pytest.raises(
        ConfigConflictError, match=r"NNODES=2 \(environment MA_NUM_HOSTS .*the run was made with 1"
    ):
        launch(retrain, progress=False)
    assert not list(made.output_dir().glob("plan*"))
