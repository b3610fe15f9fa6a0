"""A run is its folder: one writer per run, retrain of a copy continues the copy, a moved run resumes where it is,
settings that contradict the resumed run are an error, OVERWRITE keeps the old run until the new model loaded."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import test_train_helpers as H
from test_locks import held_elsewhere

from kit.storage.locks import LockedError
from kit.train import TrainConfig, train
from kit.train.checkpoint import latest_iteration
from kit.train.resolve import ConfigConflictError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def pretrain_data(tmp_path_factory):
    return H.make_pretrain(tmp_path_factory.mktemp("data") / "synthetic_pretrain_hf", num_samples=16)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama_dir, pretrain_data):
    """One finished 2-iteration run (workspace, its output root); tests copy it before changing anything."""
    ws = tmp_path_factory.mktemp("trained") / "ws"
    train(H.tiny_config(tiny_llama_dir, pretrain_data, ws, train_iters=2, save_interval=1), progress=False)
    return ws


def _copy(trained, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(trained, ws)
    return ws, ws / "saved_dir_for_ma_output"


def _digest(folder):
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


def _retrain(ws, model, **kw):
    return TrainConfig(run_type="retrain", model_name=model, work_dir=str(ws), **kw)


def test_retrain_of_a_copy_continues_the_copy_and_a_moved_run_resumes_where_it_is(tmp_path, trained):
    ws, out = _copy(trained, tmp_path)
    shutil.copytree(out / "tiny", out / "backup")
    before = _digest(out / "tiny")
    res = train(_retrain(ws, "backup", train_iters=3), progress=False)
    assert res.status == "completed" and res.output_dir == out / "backup" / "pretrain"
    assert latest_iteration(out / "backup" / "pretrain" / "checkpoints") == 3
    assert _digest(out / "tiny") == before  # the original is untouched
    (out / "tiny").rename(out / "moved")
    res = train(_retrain(ws, "moved", train_iters=3), progress=False)
    assert res.status == "completed" and latest_iteration(out / "moved" / "pretrain" / "checkpoints") == 3
    assert not (out / "tiny").exists()  # the old name is not recreated


def test_retrain_with_settings_that_contradict_the_run_is_an_error_listing_them(tmp_path, trained):
    ws, out = _copy(trained, tmp_path)
    with pytest.raises(ConfigConflictError) as err:
        train(_retrain(ws, "tiny", train_iters=3, lr=1.0, gbs=8, seed=1, dataset_path=str(tmp_path)))
    msg = str(err.value)
    for part in ("LR=1.0", "GBS=8", "SEED=1", "DATASET_PATH="):
        assert part in msg, msg
    assert "TRAIN_ITERS" in msg.split("only ")[1]  # what may change is named
    assert latest_iteration(out / "tiny" / "pretrain" / "checkpoints") == 2
    # the values the run was made with are no contradiction
    res = train(_retrain(ws, "tiny", train_iters=3, lr=3e-3, gbs=4, seed=7), progress=False)
    assert res.iteration == 3


def test_overwrite_with_a_bad_model_keeps_the_old_run(tmp_path, trained, tiny_llama_dir, pretrain_data):
    ws, out = _copy(trained, tmp_path)
    before = _digest(out / "tiny" / "pretrain")
    bad = tmp_path / "bad_model"
    shutil.copytree(tiny_llama_dir, bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    with pytest.raises(Exception, match="header"):  # safetensors' own error (unexpected: exit 1)
        train(H.tiny_config(bad, pretrain_data, ws, train_iters=2, overwrite=True), progress=False)
    assert _digest(out / "tiny" / "pretrain") == before  # checkpoints, config.json and manifest all kept


def test_two_runs_of_one_model_name_the_second_is_refused(tmp_path, trained, tiny_llama_dir, pretrain_data):
    ws, out = _copy(trained, tmp_path)
    before = _digest(out / "tiny" / "pretrain")
    with held_elsewhere(out / "tiny" / "pretrain") as other:
        with pytest.raises(LockedError, match=f"PID {other.pid} "):
            train(H.tiny_config(tiny_llama_dir, pretrain_data, ws, train_iters=2, overwrite=True))
        with pytest.raises(LockedError):
            train(_retrain(ws, "tiny", train_iters=3))
    assert _digest(out / "tiny" / "pretrain") == before
