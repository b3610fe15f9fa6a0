"""Atomic DeepSpeed checkpoints with the trainer's position and RNG, Megatron-style `latest` markers.

Layout under `<output>/checkpoints/`: `iter_0000010/` (DeepSpeed model/optimizer/scheduler files,
`rng_state_rank<r>.pt`, `trainer_state.json`), `latest` (DeepSpeed's tag file) and
`latest_checkpointed_iteration.txt` (Megatron's). A checkpoint is written as `.partial-iter_*` and renamed only
when every rank has finished, so an interrupted save never looks like a finished one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

from kit.atomic import atomic_write_text
from kit.errors import InputError, MissingInputError

LATEST = "latest"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"


def tag_of(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def latest_iteration(ckpt_root: Path) -> Optional[int]:
    """The iteration recorded in `latest_checkpointed_iteration.txt` if its folder exists, else None."""
    marker = Path(ckpt_root) / MEGATRON_LATEST
    if not marker.is_file():
        return None
    iteration = int(marker.read_text().strip())
    return iteration if (Path(ckpt_root) / tag_of(iteration)).is_dir() else None


def _rng_state() -> dict:
    import torch
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if accel.device_name() != "cpu":
        state["device"] = accel.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import torch
    from deepspeed.accelerator import get_accelerator

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "device" in state:
        get_accelerator().set_rng_state(state["device"])


def save(engine, ckpt_root: Path, iteration: int, trainer_state: dict) -> Path:
    """Save model, optimizer, scheduler, RNG and position at `iteration` (all ranks call this); return its folder."""
    import torch
    import torch.distributed as dist

    ckpt_root = Path(ckpt_root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    partial_tag = f".partial-{tag_of(iteration)}"
    if rank == 0:
        shutil.rmtree(ckpt_root / partial_tag, ignore_errors=True)  # left by a crash during an earlier save
        ckpt_root.mkdir(parents=True, exist_ok=True)
    _barrier()
    engine.save_checkpoint(str(ckpt_root), tag=partial_tag, save_latest=False)
    torch.save(_rng_state(), ckpt_root / partial_tag / f"rng_state_rank{rank}.pt")
    _barrier()
    final = ckpt_root / tag_of(iteration)
    if rank == 0:
        atomic_write_text(
            ckpt_root / partial_tag / "trainer_state.json", json.dumps(trainer_state, indent=2) + "\n"
        )
        if final.exists():
            old = ckpt_root / f".old-{tag_of(iteration)}-{os.getpid()}"
            os.replace(final, old)
            os.replace(ckpt_root / partial_tag, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(ckpt_root / partial_tag, final)
        atomic_write_text(ckpt_root / LATEST, tag_of(iteration))
        atomic_write_text(ckpt_root / MEGATRON_LATEST, str(iteration))
    _barrier()
    return final


def load(engine, ckpt_root: Path, iteration: Optional[int] = None) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG; return the trainer state saved with them."""
    import torch
    import torch.distributed as dist

    ckpt_root = Path(ckpt_root)
    iteration = latest_iteration(ckpt_root) if iteration is None else iteration
    if iteration is None or not (ckpt_root / tag_of(iteration)).is_dir():
        raise MissingInputError(
            f"no checkpoint to resume in {ckpt_root} (iteration {iteration}); "
            f"train with RUN_TYPE=pretrain/sft/lora first."
        )
    folder = ckpt_root / tag_of(iteration)
    path, _ = engine.load_checkpoint(
        str(ckpt_root), tag=tag_of(iteration), load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise InputError(
            f"DeepSpeed could not load {folder}; it may be from another ZeRO stage or world size."
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = folder / f"rng_state_rank{rank}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than saved: data order stays exact, RNG not
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
