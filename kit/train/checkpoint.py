"""Atomic DeepSpeed checkpoints with the trainer's position and RNG, Megatron-style `latest` markers.

Layout under `<output>/checkpoints/`: `iter_0000010/` (DeepSpeed model/optimizer/scheduler files,
`rng_state_rank<r>.pt`, `trainer_state.json`), `latest` (DeepSpeed's tag file) and
`latest_checkpointed_iteration.txt` (Megatron's). A checkpoint is written as `.partial-iter_*` and renamed only
when every rank has finished, so an interrupted save never looks like a finished one.

Before the rename every file is hashed and fsynced and `checksums.json` (size and CRC-32 of each file) is written
into the folder, then the folder, its parent and last the `latest` markers: after a power cut a marker never points
at empty files. `torch.load` does not check the zip CRCs of a `.pt`, so `load()` verifies the hashes first; a
damaged or truncated checkpoint is named and the newest older checkpoint that verifies is resumed instead.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

from kit.errors import InputError, IntegrityError, MissingInputError, writing
from kit.storage.atomic import atomic_write_text
from kit.storage.hashes import crc32_file

LATEST = "latest"
MEGATRON_LATEST = "latest_checkpointed_iteration.txt"
CHECKSUMS = "checksums.json"


def tag_of(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def latest_iteration(ckpt_root: Path) -> Optional[int]:
    """The iteration recorded in `latest_checkpointed_iteration.txt` if its folder exists; else (no marker, an
    unreadable one, or one naming a missing folder) the newest `iter_*` folder; None when there is none."""
    marker = Path(ckpt_root) / MEGATRON_LATEST
    try:
        iteration = int(marker.read_text().strip())
    except (OSError, ValueError):
        iteration = None
    if iteration is not None and (Path(ckpt_root) / tag_of(iteration)).is_dir():
        return iteration
    found = iterations(ckpt_root)
    return found[0] if found else None


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
    partial, final = ckpt_root / partial_tag, ckpt_root / tag_of(iteration)
    try:
        # disk full / read-only inside DeepSpeed's or torch's writer: one line naming the checkpoint
        with writing(final):
            engine.save_checkpoint(str(ckpt_root), tag=partial_tag, save_latest=False)
            torch.save(_rng_state(), partial / f"rng_state_rank{rank}.pt")
        _barrier()
        if rank == 0:
            with writing(final):
                atomic_write_text(partial / "trainer_state.json", json.dumps(trainer_state, indent=2) + "\n")
                sums = json.dumps(seal(partial), indent=1, sort_keys=True) + "\n"
                atomic_write_text(partial / CHECKSUMS, sums)
                _fsync_dir(partial)
    except BaseException:
        # a failed or interrupted save leaves nothing behind (what a SIGKILL leaves is reported by the next run)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if rank == 0:
        if final.exists():
            old = ckpt_root / f".old-{tag_of(iteration)}-{os.getpid()}"
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        _fsync_dir(ckpt_root)  # the rename is durable before a marker names it
        with writing(ckpt_root / LATEST):
            atomic_write_text(ckpt_root / LATEST, tag_of(iteration))
            atomic_write_text(ckpt_root / MEGATRON_LATEST, str(iteration))
        _fsync_dir(ckpt_root)
    _barrier()
    _finish_on_this_node(ckpt_root, iteration, rank)
    return final


def _finish_on_this_node(ckpt_root: Path, iteration: int, rank: int) -> None:
    """On a node without the shared disk of rank 0 (each node its own work dir, OBS_HOME) rank 0's rename did not
    happen here: the node's local rank 0 renames the node's part, so it neither piles up as `.partial-*` nor is
    reported as a killed run's leftover. A shared disk is recognised by the `latest` marker rank 0 wrote before
    the last barrier; there nothing happens. Files are moved, never a folder removed (an existing folder of the
    same iteration, from an earlier run on this node, gets this save's files)."""
    if rank == 0 or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    tag = tag_of(iteration)
    try:
        if (ckpt_root / LATEST).read_text().strip() == tag:
            return  # rank 0's rename is visible here: a shared disk
    except OSError:
        pass
    partial, final = ckpt_root / f".partial-{tag}", ckpt_root / tag
    if not partial.is_dir():
        return
    if not final.exists():
        os.replace(partial, final)
    else:
        for rel in _files(partial):
            (final / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial / rel, final / rel)
        shutil.rmtree(partial, ignore_errors=True)
    _fsync_dir(ckpt_root)


def _files(folder: Path) -> list:
    """The checkpoint's files (relative names, sorted), its checksum list and atomic temporaries left out."""
    out = []
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel != CHECKSUMS and ".partial-" not in name:
                out.append(rel)
    return sorted(out)


def seal(folder: Path) -> dict:
    """Hash and fsync every file of a written checkpoint folder: {"files": {relative name: {"bytes", "crc32"}}}.

    The files are read back once, from the page cache they were just written to, while their fsyncs (disk writes)
    run beside the hashing (CPU) in threads (zlib and fsync release the GIL). Hashing through torch.save instead
    was measured no faster here: writing 384 MB through a CRC-computing file object took as long as writing it and
    reading it back (and would mean replacing DeepSpeed's checkpoint engine).
    """
    from concurrent.futures import ThreadPoolExecutor

    folder = Path(folder)
    names = _files(folder)
    subdirs = {folder / sub for rel in names for sub in Path(rel).parents if str(sub) != "."}
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) + 1)) as pool:
        syncs = [pool.submit(_fsync_file, folder / rel) for rel in names]
        hashes = [pool.submit(crc32_file, folder / rel) for rel in names]
        sums = {rel: h.result() for rel, h in zip(names, hashes)}
        for done in syncs:
            done.result()  # an fsync error (EIO, ENOSPC on NFS) fails the save
    for sub in sorted(subdirs):
        _fsync_dir(sub)
    return {"files": sums}


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(folder: Path) -> Optional[str]:
    """None when every file of the checkpoint matches `checksums.json`, else what is wrong (naming the file).

    A checkpoint without `checksums.json` (written by an older kit) is accepted unverified: "unverified".
    """
    folder = Path(folder)
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return "unverified"
    try:
        expected = json.loads(listing.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{listing} is damaged ({type(exc).__name__})"
    missing = [rel for rel in expected if not (folder / rel).is_file()]
    if missing:
        return f"{folder / missing[0]} is missing"
    for rel, want in sorted(expected.items()):
        path = folder / rel
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{path} has {size} bytes, {want['bytes']} were written (truncated or replaced)"
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(expected)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # zlib releases the GIL
        got = list(pool.map(lambda rel: crc32_file(folder / rel), names))
    for rel, sums in zip(names, got):
        if sums["crc32"] != expected[rel].get("crc32"):
            return f"{folder / rel} does not match its CRC-32 in {CHECKSUMS} (damaged)"
    return None


def _fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and new names inside it survive a power cut (POSIX only)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # Windows, or a filesystem that cannot open directories: nothing more to do
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; the files themselves were fsynced
    finally:
        os.close(fd)


def iterations(ckpt_root: Path) -> list:
    """The iterations of the finished `iter_*` folders under `ckpt_root`, newest first."""
    found = []
    for p in Path(ckpt_root).glob("iter_*"):
        suffix = p.name[len("iter_") :]
        if p.is_dir() and suffix.isdigit():
            found.append(int(suffix))
    return sorted(found, reverse=True)


def choose(ckpt_root: Path) -> tuple:
    """(the iteration to resume: the newest checkpoint that verifies, at or before the `latest` marker; notes).

    The notes say which checkpoints were damaged and skipped; IntegrityError when none verifies.
    """
    ckpt_root = Path(ckpt_root)
    marked = latest_iteration(ckpt_root)
    candidates = [i for i in iterations(ckpt_root) if marked is None or i <= marked]
    if not candidates:
        raise MissingInputError(
            f"no checkpoint to resume in {ckpt_root}; train with RUN_TYPE=pretrain/sft/lora first."
        )
    notes, damaged = [], []
    for it in candidates:
        problem = verify(ckpt_root / tag_of(it))
        if problem is None or problem == "unverified":
            if problem:
                notes.append(f"{ckpt_root / tag_of(it)} has no {CHECKSUMS} (older kit): resumed unverified")
            if damaged:
                notes.insert(
                    0,
                    f"checkpoint damaged: {'; '.join(damaged)}; resuming from {tag_of(it)}, the newest "
                    f"complete, verified checkpoint",
                )
            return it, notes
        damaged.append(problem)
    raise IntegrityError(
        f"every checkpoint in {ckpt_root} is damaged: {'; '.join(damaged)}; start over with OVERWRITE=True "
        f"or restore the folder from a copy."
    )


def load(engine, ckpt_root: Path, iteration: Optional[int] = None, notes: Optional[list] = None) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG; return the trainer state saved with them.

    Without `iteration`: the newest checkpoint that verifies (choose(); rank 0 decides, every rank loads the same);
    what was skipped is appended to `notes`."""
    import torch
    import torch.distributed as dist

    ckpt_root = Path(ckpt_root)
    if iteration is None:
        iteration = _agreed(ckpt_root, notes if notes is not None else [])
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


def _agreed(ckpt_root: Path, notes: list) -> Optional[int]:
    """choose() on rank 0, broadcast to the other ranks (an error on rank 0 is raised there; the others stop)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        it, found = choose(ckpt_root)
        notes.extend(found)
        return it
    chosen, error = -1, None
    if dist.get_rank() == 0:
        try:
            chosen, found = choose(ckpt_root)
            notes.extend(found)
        except (IntegrityError, MissingInputError) as exc:
            error = exc
    from deepspeed.accelerator import get_accelerator

    device = "cpu" if dist.get_backend() == "gloo" else get_accelerator().current_device_name()
    t = torch.tensor([chosen], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    if error is not None:
        raise error
    if int(t.item()) < 0:
        raise IntegrityError(f"rank 0 found no checkpoint to resume in {ckpt_root} (see its log)")
    return int(t.item())


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
