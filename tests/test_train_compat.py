"""Training on the older stacks: what torch 2.1's gloo cannot do is refused in one line, not mid-step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from kit.errors import DeviceError
from kit.train.engine import _check_zero3_collectives, free_port


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


def test_in_process_world_tells_deepspeed_its_local_size(monkeypatch):
    """DeepSpeed 0.15's CPU accelerator runs `numactl` unless LOCAL_SIZE is set (ZeRO-3 asks for it)."""
    from kit.device import detect
    from kit.train.engine import init_distributed

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "KIT_IN_PROCESS_LOCAL_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    try:
        assert init_distributed(detect())[:2] == (0, 1)
        assert os.environ["LOCAL_SIZE"] == "1"
    finally:
        dist.destroy_process_group()
    # a second in-process run is not mistaken for a launched one (it gets a fresh port again)
    port = os.environ["MASTER_PORT"]
    try:
        init_distributed(detect())
        assert os.environ["MASTER_PORT"] != port
    finally:
        dist.destroy_process_group()
