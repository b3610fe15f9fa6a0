"""Launch settings from a ModelArts training job's environment, and which of the per-card boot processes launches.

Sources: Huawei Cloud docs "训练作业环境变量" (table "分布式训练作业环境变量") and "Managing Environment Variables of a
Training Container"; "Starting a Preset Image's Boot File" for the per-card boot of Ascend preset images.
"""

from __future__ import annotations

import socket
import time
from typing import Dict, Mapping, Optional, Tuple

from kit.errors import InputError

# ModelArts' variable -> the TrainConfig field it decides. MA_NUM_HOSTS and VC_WORKER_NUM both count the job's
# instances (nodes); VC_WORKER_HOSTS is the comma-separated DNS names of the nodes in task order, the first being
# node 0 (the docs' own example: MASTER_ADDR="${VC_WORKER_HOSTS%%,*}").
MODELARTS_VARS = {
    "MA_NUM_HOSTS": "nnodes",
    "VC_WORKER_NUM": "nnodes",
    "VC_TASK_INDEX": "node_rank",
    "VC_WORKER_HOSTS": "master_addr",
    "MA_NUM_GPUS": "nproc_per_node",
}
JOB_SOURCE = "environment {} (ModelArts training job)"
# Set by Ascend preset images, which run the boot command once per card
PER_CARD_VARS = ("ASCEND_DEVICE_ID", "RANK_ID")


def resolve_host(name: str, timeout_s: float = 60.0) -> str:
    """The IPv4 address of `name` (a job's node DNS names appear a little after the pods start: retry up to
    `timeout_s`); an error naming the host when it never resolves."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.gethostbyname(name)
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise InputError(
                    f"VC_WORKER_HOSTS names node 0 as {name!r}, which does not resolve ({exc}); "
                    f"check the job's network, or set MASTER_ADDR to node 0's IP address."
                ) from None
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))


def _int(environ: Mapping[str, str], key: str) -> int:
    raw = environ[key]
    try:
        return int(str(raw).strip())
    except ValueError:
        raise InputError(
            f"environment variable {key}={raw!r} (ModelArts training job) is not an integer."
        ) from None


def modelarts_env(
    environ: Mapping[str, str], resolve_timeout_s: float = 60.0
) -> Dict[str, Tuple[object, str]]:
    """The launch settings a ModelArts training job injects: {field: (value, source)}, only for variables that are
    set (non-empty); {} outside a job.

    nnodes <- MA_NUM_HOSTS (or VC_WORKER_NUM; both set and different is an error), node_rank <- VC_TASK_INDEX,
    master_addr <- the first name of VC_WORKER_HOSTS resolved to an IP address (`resolve_host`), nproc_per_node <-
    MA_NUM_GPUS. The source reads "environment KEY (ModelArts training job)". `kit.train.resolve.resolve` applies
    them with the environment's precedence (explicit > environment > manifest > default); an explicit value or a
    kit variable (NNODES, NODE_RANK, MASTER_ADDR, NPROC_PER_NODE) that differs from the job's is a contradiction.
    A per-node command therefore needs none of these settings: `python -m kit train launch --config <file>` on every
    node of the job reads them here.
    """
    got = {k: str(environ[k]).strip() for k in MODELARTS_VARS if str(environ.get(k) or "").strip()}
    out: Dict[str, Tuple[object, str]] = {}
    if "MA_NUM_HOSTS" in got and "VC_WORKER_NUM" in got:
        a, b = _int(environ, "MA_NUM_HOSTS"), _int(environ, "VC_WORKER_NUM")
        if a != b:
            raise InputError(
                f"the job environment contradicts itself: MA_NUM_HOSTS={a} but VC_WORKER_NUM={b} nodes."
            )
    for key in ("MA_NUM_HOSTS", "VC_WORKER_NUM"):
        if key in got:
            out["nnodes"] = (_int(environ, key), JOB_SOURCE.format(key))
            break
    if "VC_TASK_INDEX" in got:
        out["node_rank"] = (_int(environ, "VC_TASK_INDEX"), JOB_SOURCE.format("VC_TASK_INDEX"))
    if "MA_NUM_GPUS" in got:
        out["nproc_per_node"] = (_int(environ, "MA_NUM_GPUS"), JOB_SOURCE.format("MA_NUM_GPUS"))
    if "VC_WORKER_HOSTS" in got:
        hosts = [h.strip() for h in got["VC_WORKER_HOSTS"].split(",") if h.strip()]
        nnodes = out.get("nnodes", (len(hosts), ""))[0]
        if hosts and len(hosts) != nnodes:
            raise InputError(
                f"the job environment contradicts itself: VC_WORKER_HOSTS names {len(hosts)} node(s) but "
                f"{out['nnodes'][1].split()[1]}={nnodes}."
            )
        if hosts:
            out["master_addr"] = (
                resolve_host(hosts[0], resolve_timeout_s),
                JOB_SOURCE.format("VC_WORKER_HOSTS") + f" first host {hosts[0]}",
            )
    return out


def launching_card(environ: Mapping[str, str]) -> Optional[str]:
    """None when this process should start the node's launcher; else why not (one line).

    Ascend preset images run the boot command once per card, with ASCEND_DEVICE_ID (and RANK_ID) set. One launcher
    per node starts every rank of the node, so only the first card's process launches; the others exit 0 at once
    with this line (the launcher's ranks use their cards). First card: ASCEND_DEVICE_ID equal to the lowest of
    ASCEND_VISIBLE_DEVICES (0 when unset), else RANK_ID a multiple of MA_NUM_GPUS (1 when unset).
    """
    device = str(environ.get("ASCEND_DEVICE_ID") or "").strip()
    if device:
        visible = [v for v in str(environ.get("ASCEND_VISIBLE_DEVICES") or "").split(",") if v.strip()]
        first = min(int(v) for v in visible) if visible else 0
        if device.isdigit() and int(device) != first:
            return (
                f"ASCEND_DEVICE_ID={device}: the boot command runs once per card; the launcher of this node "
                f"starts on card {first} and runs every rank, so this process exits."
            )
        return None
    rank = str(environ.get("RANK_ID") or "").strip()
    per_node = str(environ.get("MA_NUM_GPUS") or "1").strip()
    if rank.isdigit() and per_node.isdigit() and int(per_node) > 0 and int(rank) % int(per_node):
        return (
            f"RANK_ID={rank}: the boot command runs once per card; the launcher of this node starts with "
            f"RANK_ID={int(rank) - int(rank) % int(per_node)} and runs every rank, so this process exits."
        )
    return None
