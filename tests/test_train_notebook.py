"""Notebook 04 end to end on a tiny model: in-kernel SFT, before/after generation, launched LoRA, Megatron plan."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kit.core.inputs import consumed
from kit.core.manifest import read_manifest
from kit.core.workspace import repo_root
from kit.train.dpo import METRICS

NOTEBOOK = repo_root() / "notebooks" / "04_adapted_training.ipynb"


@pytest.mark.slow
def test_notebook_04_runs_on_a_tiny_model(run_notebook, tiny_llama_dir, tmp_path):
    _, summary = run_notebook(
        "04",
        MODEL="tiny",
        MODEL_PATH=str(tiny_llama_dir),
        TRAIN_ITERS=5,
        MBS=2,
        GBS=4,
        SEQ_LEN=64,
        LR=3e-3,
        LAUNCH_ITERS=2,
        DPO_ITERS=2,
        MAX_NEW_TOKENS=8,
    )
    assert summary["status"] == "completed" and summary["iterations"] == 5
    # run alone: the sample was prepared for this model at SEQ_LEN (typed, so explicit)
    assert summary["sources"]["dataset_path"] == "prepared now from the shipped sft sample"
    assert summary["sources"]["seq_len"] == "explicit" and summary["seq_len"] == 64
    assert summary["last_loss"] < summary["first_loss"] - 0.3, summary["losses"]
    for key in ("checkpoint", "hf_dir", "log", "metrics", "plot"):
        assert Path(summary[key]).exists(), key
    assert (Path(summary["hf_dir"]) / "config.json").is_file()
    assert summary["tokens_per_s_per_card"] > 0
    assert isinstance(summary["before"], str) and isinstance(summary["after"], str)
    assert summary["launched_status"] == "completed" and summary["launched_iterations"] == [1, 2]
    assert (Path(summary["lora_merged"]) / "config.json").is_file()
    assert summary["megatron_command"].startswith("cd ") and "MODEL_TYPE=tiny" in summary["megatron_command"]
    assert any("AscendCloud" in p for p in summary["megatron_problems"])  # no code package on this machine
    # the DPO section: from the in-kernel SFT run (through its manifest) on the pairs prepared now, TRL's metrics
    dpo = read_manifest(summary["dpo_run"], expect="training-run")
    assert (
        summary["dpo_status"] == "completed" and summary["dpo_iterations"] == 2 and dpo["run_type"] == "dpo"
    )
    started = consumed(consumed(dpo, "hf-model"), "training-run")
    assert started.folder == Path(summary["output_dir"]).resolve() and started["run_type"] == "sft"
    assert dpo["dpo"]["reference"] == "adapters_off" and set(summary["dpo_metrics"]) == set(METRICS)
    steps = [json.loads(line) for line in Path(dpo["metrics"]).read_text().splitlines()]
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # step 1: the model against itself
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # 05-07 still take the SFT run: the DPO run named itself when it finished, the notebook named its own run after
    named = json.loads((tmp_path / "ws" / "saved_dir_for_ma_output" / "tiny" / "named_run.json").read_text())
    assert Path(named["run"]) == Path(summary["output_dir"]).resolve()
    # the last section's dry run: a 2-node ModelArts job of this run, its inputs from the workspace's manifests
    job = json.loads(
        (tmp_path / "ws" / "reports" / "04_training_job.summary.json").read_text(encoding="utf-8")
    )
    assert job["node_count"] == 2 and job["flavor"] == "modelarts.pool.visual.8xlarge"
    assert job["command"].startswith("python -m kit train launch ") and "--train-iters 5" in job["command"]
    data = next(c for c in summary["inputs"] if c["kind"] == "prepared-data")
    assert job["inputs"]["data_url"] == f"obs://my-bucket/kit-jobs/data/{Path(data['path']).name}/"
    assert job["uploads"][0]["manifest_sha256"] == data["manifest_sha256"]
    assert any("POOL_ID" in p for p in job["problems"])  # the notebook's defaults name no pool


@pytest.mark.slow
@pytest.mark.dev_stack  # manifest inheritance: plain Python, tests/test_train_config.py covers it on every stack
def test_notebook_04_trains_on_what_notebook_02_wrote(run_notebook, tiny_llama_dir, tmp_path):
    """02's output in the workspace (its defaults, this model's tokenizer): 04 on its defaults trains on exactly
    that folder, inherits its length, and prepares nothing."""
    from kit.core.manifest import read_manifest
    from kit.core.workspace import get_workspace
    from kit.data import DataConfig, prepare

    ws = get_workspace(tmp_path / "ws", model="tiny")
    data_cfg = DataConfig(
        kind="sft",
        name="alpaca",
        tokenizer=str(tiny_llama_dir),
        max_length=96,
        template="tokenizer",
        heldout_records=4,
    )
    prepared = Path(prepare(data_cfg, ws, progress=False).hf_dir)
    before = sorted(p.name for p in ws.data_finetune.iterdir())
    _, summary = run_notebook(
        "04", MODEL="tiny", MODEL_PATH=str(tiny_llama_dir), TRAIN_ITERS=2, MBS=2, GBS=4, LAUNCH_ITERS=0, DPO_ITERS=0,
        MAX_NEW_TOKENS=4,
    )  # fmt: skip
    assert summary["status"] == "completed" and summary["iterations"] == 2
    assert summary["eval_loss"] > 0  # EVAL_EVERY: the held-out loss of 02's split
    assert summary["dataset_path"] == str(prepared)
    assert summary["sources"]["dataset_path"].startswith(
        f"workspace {prepared.resolve()}: DATASET_PATH not given: the newest prepared-data "
    )
    assert summary["seq_len"] == 96 and summary["sources"]["seq_len"] == f"manifest {prepared.resolve()}"
    assert summary["inputs"][0]["manifest_sha256"] == read_manifest(prepared).sha256
    assert sorted(p.name for p in ws.data_finetune.iterdir()) == before  # nothing re-prepared
    run = read_manifest(summary["output_dir"], expect="training-run")
    assert run.sha256 == summary["manifest_sha256"] and run["hf"] == str(Path(summary["hf_dir"]).resolve())
