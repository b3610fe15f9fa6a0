"""A completed run leaves a training-run manifest (resolved config with sources, consumed inputs, checkpoints,
metrics, log) and an hf-model manifest in its exported hf/ folder whose input is the run; a resumed run rewrites
both consistently."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_train_helpers as H

from kit.core.manifest import HF_MODEL, PREPARED_DATA, TRAINING_RUN, read_manifest
from kit.core.workspace import get_workspace
from kit.train import TrainConfig, from_manifest, train


@pytest.mark.slow
def test_training_run_and_hf_manifests_and_resume_keeps_them_consistent(tmp_path, tiny_llama_dir):
    ws = get_workspace(tmp_path / "ws", model="tiny")
    data = H.prepared(ws.data_finetune / "alpaca_hf", tiny_llama_dir, max_length=48)
    cfg = TrainConfig(run_type="sft", model_path=str(tiny_llama_dir), train_iters=2, mbs=2, gbs=4, lr=3e-3)
    result = train(cfg, ws, progress=False)
    assert result.status == "completed"
    run = read_manifest(result.output_dir, expect=TRAINING_RUN)
    assert run.folder == ws.output("sft").resolve() and run["run_type"] == "sft"
    assert run["data"] == str(data.resolve()) and run["model"] == str(Path(tiny_llama_dir).resolve())
    # 04 on its defaults found 02's folder in the workspace: no DATASET_PATH given, nothing re-prepared
    # ... and says which folder it took and why (kit.core.inputs)
    assert run["sources"]["dataset_path"].startswith(
        f"workspace {data.resolve()}: DATASET_PATH not given: the newest prepared-data of kind sft made with {Path(tiny_llama_dir).name}'s "
    )
    assert run["sources"]["seq_len"] == f"manifest {data.resolve()}" and run["config"]["seq_len"] == 48
    assert run["sources"]["lr"] == "explicit" and run["sources"]["work_dir"] == "workspace"
    assert [c.kind for c in run.inputs] == [PREPARED_DATA]
    assert run.inputs[0].manifest_sha256 == read_manifest(data).sha256
    assert run["checkpoints"] == [str(result.output_dir.resolve() / "checkpoints" / "iter_0000002")]
    assert Path(run["metrics"]).is_file() and Path(run["log"]).is_file()
    loaded = from_manifest(result.output_dir)
    assert loaded == result.config and loaded.sources == run["sources"]
    hf = read_manifest(result.hf_dir, expect=HF_MODEL)
    assert run["hf"] == str(hf.folder) and hf["family"] == "llama"
    assert hf["source"] == str(run.folder) and [c.__dict__ for c in hf.inputs] == [run.as_input().__dict__]
    summary = result.summary()
    assert summary["manifest_sha256"] == run.sha256 and summary["inputs"][0]["path"] == str(data.resolve())

    resumed = train(TrainConfig(run_type="retrain", resume_from="sft", train_iters=3), ws, progress=False)
    assert resumed.status == "completed" and resumed.iteration == 3
    again = read_manifest(result.output_dir, expect=TRAINING_RUN)
    assert again["checkpoints"][-1].endswith("iter_0000003") and again["iterations"] == 3
    assert (
        again["run_type"] == "sft"
        and again["config"]["train_iters"] == 3
        and again["config"]["seq_len"] == 48
    )
    hf_again = read_manifest(resumed.hf_dir, expect=HF_MODEL)
    assert hf_again.inputs[0].manifest_sha256 == again.sha256
