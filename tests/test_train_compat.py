"""Training on the older stacks: what torch 2.1's gloo cannot do is refused in one line, not mid-step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kit.errors import DeviceError
from kit.system.procs import free_port
from kit.train.engine import _check_zero3_collectives


def test_zero3_on_gloo_is_checked_before_training():
    created = not dist.is_initialized()
    if created:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        if dist.get_backend() != "gloo":
            pytest.skip("a non-gloo process group is already initialised in this process")
        if torch.__version__ < "2.2":
            with pytest.raises(DeviceError, match="ZERO_STAGE=3 on CPU"):
                _check_zero3_collectives()
        else:
            _check_zero3_collectives()  # the all-gather ZeRO-3 needs works
    finally:
        if created:
            dist.destroy_process_group()


def test_in_process_world_tells_deepspeed_its_local_size():
    """DeepSpeed 0.15's CPU accelerator runs `numactl` unless LOCAL_SIZE is set (ZeRO-3 asks for it)."""
    code = (
        "import os, json, torch.distributed as dist\n"
        "from kit.system.device import detect\n"
        "from kit.train.engine import init_distributed, shm_buffer_path\n"
        "out = []\n"
        "for _ in range(2):\n"
        "    rank_world = init_distributed(detect())[:2]\n"
        "    left = os.path.exists(shm_buffer_path(0))\n"
        "    out.append([list(rank_world), os.environ['LOCAL_SIZE'], os.environ['MASTER_PORT'], left])\n"
        "    dist.destroy_process_group()\n"
        "print(json.dumps(out))\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "RANK", "WORLD_SIZE")
    }
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    # a leftover without RANK / MASTER_PORT is no launch (else DeepSpeed would look for MPI)
    env["LOCAL_WORLD_SIZE"] = "2"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first[:2] == [[0, 1], "1"] and second[:2] == [[0, 1], "1"]
    assert first[2] != second[2]  # the second in-process run is not taken for a launched one: a fresh port
    assert first[3] is False and second[3] is False  # no DeepSpeed shm buffer left in /dev/shm


def test_deepspeeds_cpu_shm_buffer_is_released_once_mapped():
    """DeepSpeed's CPU allreduce creates /dev/shm/deepspeed_allreduce_buffer_* and never unlinks it (66 MB a run)."""
    code = (
        "import os, json, deepspeed\n"
        "from kit.train.engine import release_shm_buffer, shm_buffer_path\n"
        "from kit.system.procs import free_port\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', LOCAL_SIZE='1', MASTER_ADDR='127.0.0.1',\n"
        "                  MASTER_PORT=str(free_port()))\n"
        "deepspeed.init_distributed(dist_backend='gloo', verbose=False)\n"
        "path = shm_buffer_path(0)\n"
        "made = os.path.exists(path) and os.path.getsize(path)\n"
        "print(json.dumps([made, release_shm_buffer(0, 1), os.path.exists(path)]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    made, released, left = json.loads(proc.stdout.strip().splitlines()[-1])
    if not made:
        pytest.skip("this DeepSpeed build has no CPU shm allreduce (no buffer to release)")
    assert made > 1 << 20 and released is True and left is False
