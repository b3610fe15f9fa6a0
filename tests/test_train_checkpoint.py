"""Training checkpoints and exports under damage, full disks and signals (issue 30, items 5, 6, 8).

One tiny run (4 iterations, a checkpoint at each, an HF export) is trained once per module; the tests copy and damage
it. Disk full is a real small tmpfs (skipped with the reason where mounting is not allowed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_train_helpers as H

from kit.core.manifest import MANIFEST_NAME, read_manifest
from kit.errors import IntegrityError, OutputError
from kit.train import TrainConfig, train
from kit.train import checkpoint as ck
from kit.train.resolve import resolve

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pretrain_data(tmp_path_factory):
    return H.make_pretrain(tmp_path_factory.mktemp("data") / "synthetic_pretrain_hf")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama_dir, pretrain_data):
    """(result, events): a 4-iteration run checkpointing every iteration, with every fsync and rename it did."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst, **kw)

    work = tmp_path_factory.mktemp("run") / "ws"
    cfg = H.tiny_config(tiny_llama_dir, pretrain_data, work, train_iters=4, save_interval=1, save_hf=True)
    with pytest.MonkeyPatch.context() as mp:
        if Path("/proc/self/fd").is_dir():
            mp.setattr(os, "fsync", fsync)
            mp.setattr(os, "replace", replace)
        result = train(cfg, progress=False)
    assert result.status == "completed" and len(result.losses) == 4
    return result, events


def _copy_run(result, dest: Path) -> Path:
    """A copy of the run's workspace (checkpoints, config, logs); returns the copy's work_dir."""
    work = Path(result.config.work_dir)
    shutil.copytree(work, dest)
    return dest


def test_every_checkpoint_file_is_hashed_and_fsynced_before_the_latest_marker(run):
    result, events = run
    if not events:
        pytest.skip("needs /proc/self/fd to tell which file an fsync was for")
    root = result.output_dir / "checkpoints"
    listed = json.loads((root / "iter_0000004" / ck.CHECKSUMS).read_text())["files"]
    names = set(listed)
    assert {"mp_rank_00_model_states.pt", "rng_state_rank0.pt", "trainer_state.json"} <= names
    assert (
        len(names) == len([p for p in (root / "iter_0000004").rglob("*") if p.is_file()]) - 1
    )  # all but itself
    assert all(ck.verify(root / ck.tag_of(i)) is None for i in (1, 2, 3, 4))
    marker = max(i for i, e in enumerate(events) if e == ("replace", str(root / ck.LATEST)))
    fsynced = {path for kind, path in events[:marker] if kind == "fsync"}
    partial = root / ".partial-iter_0000004"
    assert {str(partial / n) for n in names} <= fsynced  # the files, through the name they were written under
    renamed = max(i for i, e in enumerate(events) if e == ("replace", str(root / "iter_0000004")))
    assert ("fsync", str(root)) in events[renamed:marker]  # the rename is durable before the marker


@pytest.mark.parametrize("damage", ["flipped bit", "0 bytes", "truncated"])
def test_damage_names_the_file_and_falls_back_to_the_newest_verified_checkpoint(run, tmp_path, damage):
    result, _ = run
    root = tmp_path / "checkpoints"
    shutil.copytree(result.output_dir / "checkpoints", root)
    target = root / "iter_0000004" / "mp_rank_00_model_states.pt"
    data = bytearray(target.read_bytes())
    if damage == "flipped bit":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) // 2] if damage == "truncated" else bytearray()
    target.write_bytes(bytes(data))
    iteration, notes = ck.choose(root)
    assert iteration == 3
    assert str(target) in notes[0] and "resuming from iter_0000003" in notes[0], notes
    (root / ck.MEGATRON_LATEST).write_text("\0\0\0")  # a marker a power cut emptied: the folders still count
    assert ck.latest_iteration(root) == 4 and ck.choose(root)[0] == 3

    for i in (1, 2, 3):
        (root / ck.tag_of(i) / "rng_state_rank0.pt").write_bytes(b"")
    with pytest.raises(IntegrityError, match="every checkpoint .* is damaged"):
        ck.choose(root)


AGREE = """
import json, sys
import torch.distributed as dist
from kit.train import checkpoint as ck
rank, port, root = int(sys.argv[1]), sys.argv[2], ck.Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

def agreed():
    notes = []
    try:
        return {"iteration": ck._agreed(root, notes), "notes": notes}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}

out = [agreed()]
dist.barrier()
if rank == 0:  # now damage the others too: nothing verifies
    for i in (1, 2, 3):
        (root / ck.tag_of(i) / "trainer_state.json").unlink()
dist.barrier()
out.append(agreed())
print(json.dumps(out))
dist.destroy_process_group()
"""


def test_every_rank_resumes_the_checkpoint_rank_0_verified(run, tmp_path):
    """`_agreed` on each rank of a real 2-process gloo group: rank 0 verifies and decides, every rank loads it."""
    from kit.system.procs import free_port

    result, _ = run
    root = tmp_path / "checkpoints"
    shutil.copytree(result.output_dir / "checkpoints", root)
    (root / "iter_0000004" / "trainer_state.json").write_text("{}")  # damaged (same name, other bytes)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AGREE, str(r), port, str(root)],
            cwd=str(ROOT),
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    (first, first_none), (second, second_none) = [
        json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs
    ]
    assert first["iteration"] == second["iteration"] == 3
    assert "iter_0000004" in first["notes"][0] and second["notes"] == []  # rank 0 decides and says so
    # nothing verifies: an error on every rank, no rank left waiting
    assert first_none["error"] == second_none["error"] == "IntegrityError"
    assert (
        "every checkpoint" in first_none["message"] and "rank 0 found no checkpoint" in second_none["message"]
    )


def test_resume_from_a_damaged_checkpoint_continues_from_the_previous_one_and_reports_leftovers(
    run, tmp_path
):
    result, _ = run
    work = _copy_run(result, tmp_path / "ws")
    out = work / result.output_dir.relative_to(result.config.work_dir)
    model = out / "checkpoints" / "iter_0000004" / "mp_rank_00_model_states.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: torch.load does not check the zip CRCs and would load it
    model.write_bytes(bytes(data))
    leftover = out / "checkpoints" / ".partial-iter_0000005"  # what a SIGKILL during a save leaves
    leftover.mkdir()
    (leftover / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 4096)

    resumed = train(
        TrainConfig(run_type="retrain", model_name="tiny", work_dir=str(work), train_iters=4), progress=False
    )
    assert resumed.status == "completed" and resumed.iteration == 4
    assert resumed.losses == result.losses[3:]  # step 4 again, from iter_0000003: the same loss, bit for bit
    log = resumed.log_path.read_text()
    assert f"checkpoint damaged: {model} does not match its CRC-32" in log
    assert "resuming from iter_0000003" in log and "resumed from" in log
    assert f"leftover partial output(s) of interrupted runs (0.0 MiB): {leftover}" in log
    assert leftover.is_dir()  # reported, not removed without CLEAN_PARTIAL
    assert ck.verify(out / "checkpoints" / "iter_0000004") is None  # the rewritten checkpoint is whole


def test_clean_partial_removes_training_leftovers(run, tmp_path):
    from kit.train.trainer import Trainer

    result, _ = run
    work = _copy_run(result, tmp_path / "ws")
    out = work / result.output_dir.relative_to(result.config.work_dir)
    leftovers = [out / "checkpoints" / ".partial-iter_0000009", out / ".hf.partial-0123456789ab"]
    for p in leftovers:
        p.mkdir()
    trainer = Trainer(
        resolve(
            TrainConfig(
                run_type="retrain", model_name="tiny", work_dir=str(work), train_iters=4, clean_partial=True
            )
        ),
        progress=False,
        echo=False,
    )
    trainer.out, trainer.ckpt_root = out, out / "checkpoints"  # what _setup sets before it looks
    from kit.train.metrics import MetricsWriter

    trainer.writer = MetricsWriter(tmp_path / "logs", "tiny", 4, echo=False)
    trainer._leftovers()
    assert not any(p.exists() for p in leftovers)
    assert all(
        f"removed leftover partial output {p}" in trainer.writer.log_path.read_text() for p in leftovers
    )


def test_the_export_manifest_is_written_before_the_run_manifest(run, tmp_path, monkeypatch):
    import dataclasses

    from kit.train import run_manifest

    result, _ = run
    hf_man = read_manifest(result.hf_dir)
    run_man = read_manifest(result.output_dir)
    assert hf_man.inputs == [run_man.as_input()]  # hf/ records the run manifest as written, hash included

    work = _copy_run(result, tmp_path / "ws")
    out = work / result.output_dir.relative_to(result.config.work_dir)
    (out / MANIFEST_NAME).unlink()
    (out / "hf" / MANIFEST_NAME).unlink()
    copy = dataclasses.replace(result, output_dir=out, hf_dir=out / "hf")
    calls = []
    real = run_manifest.write_manifest

    def fail_second(folder, *a, **kw):
        calls.append(Path(folder))
        if len(calls) == 2:
            raise OutputError(28, f"cannot write {str(folder)!r}: the disk is full")
        return real(folder, *a, **kw)

    monkeypatch.setattr(run_manifest, "write_manifest", fail_second)
    with pytest.raises(OutputError):
        run_manifest.write_run_manifests(copy, out / "checkpoints")
    # a failure between the two never leaves a "complete" run whose hf/ has no manifest
    assert not (out / MANIFEST_NAME).exists() and (out / "hf" / MANIFEST_NAME).exists()


def test_disk_full_at_a_checkpoint_is_one_line_naming_it_and_leaves_nothing(
    small_disk, tiny_llama_dir, pretrain_data
):
    from kit.errors import user_message

    cfg = H.tiny_config(tiny_llama_dir, pretrain_data, small_disk / "ws", train_iters=2, save_interval=1)
    with pytest.raises(OutputError) as err:
        train(cfg, progress=False)
    ckpts = cfg.output_dir() / "checkpoints"
    assert user_message(err.value) == f"cannot write {str(ckpts / 'iter_0000001')!r}: " + (
        "the disk is full; free space or choose an output folder on a larger volume"
    )
    assert [p.name for p in ckpts.iterdir()] == []  # no .partial-iter_0000001 left behind


def test_disk_full_in_the_hf_export_is_one_line_naming_the_folder(small_disk, tiny_llama_dir):
    from kit.system.hf_compat import load_causal_lm
    from kit.train.export import export_hf

    model = load_causal_lm(tiny_llama_dir)
    out = small_disk / "hf"
    with pytest.raises(OutputError, match=f"cannot write {str(out)!r}: the disk is full"):
        export_hf(model, out, tiny_llama_dir)
    assert list(small_disk.iterdir()) == []  # the temporary folder went away


def test_a_preempted_training_exits_with_its_own_code_and_says_how_to_resume(
    tiny_llama_dir, pretrain_data, tmp_path
):
    from kit.errors import EXIT_PREEMPTED

    work = tmp_path / "ws"
    cmd = [
        sys.executable, "-m", "kit", "train", "run", "--no-progress", "--run-type", "pretrain", "--model-name", "tiny",
        "--model-path", str(tiny_llama_dir), "--dataset-path", str(pretrain_data), "--work-dir", str(work),
        "--train-iters", "100000", "--mbs", "2", "--gbs", "4", "--no-save-hf",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and not any(m.read_text().strip() for m in work.rglob("*.metrics.jsonl")):
        assert time.monotonic() < deadline, "training never logged its first step"
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)  # what ModelArts sends before it takes the node
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_PREEMPTED, (out, err)
    assert "kit train: preempted at iteration" in out and "(SIGTERM); checkpointed to " in out
    assert "resume with RUN_TYPE=retrain" in out
    ckpts = list((work).rglob("iter_*"))
    assert len(ckpts) == 1 and ck.verify(ckpts[0]) is None
