"""Notebook 05 runs headless on tiny parameters: it profiles the workspace's training run, or configures one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kit.profiling as kp
from kit.core.manifest import PROFILE_CAPTURE, TRAINING_RUN, read_manifest

TINY = dict(MODEL="tiny", DEVICE="cpu", WAIT=0, WARMUP=1, ACTIVE=2, TOP=5)


def _check_capture(summary: dict, same_ops_per_step: bool = True) -> None:
    """What the capture recorded (two active steps of a tiny Llama), never how fast operators ranked.

    Packed SFT samples hold a different number of dialogs per step, so only pretraining steps (same_ops_per_step)
    make the same calls of every operator; the linear layers' matmuls are the same in every step either way.
    """
    assert summary["capture_kind"] == "cpu" and summary["capture_steps"] == 3
    assert len(summary["capture_traces"]) == 1 and Path(summary["capture_traces"][0]).exists()
    data = kp.load(summary["capture_folder"])
    table = kp.operator_table(data)
    assert {"aten::mm", "aten::addmm"} & set(table["type"])  # the linear layers were captured
    assert summary["capture_top_operators"] == list(table["type"].head(5))  # the notebook's top table
    assert len(summary["capture_top_operators"]) == 5 and table["total_us"].is_monotonic_decreasing
    steps = sorted(data.kernels["step"].dropna().unique())
    assert len(steps) == 2  # the two active steps
    per_step = data.kernels.groupby(["step", "type"]).size().unstack(fill_value=0)
    assert per_step.loc[steps[0], "aten::mm"] == per_step.loc[steps[1], "aten::mm"]
    if same_ops_per_step:
        assert (per_step.loc[steps[0]] == per_step.loc[steps[1]]).all()
    mm = table.set_index("type").loc["aten::mm", "calls"]
    assert mm == 2 * per_step.loc[steps[0], "aten::mm"] and mm > 0
    assert summary["capture_problems"] == [] and summary["train_status"] == "completed"
    capture = json.loads((Path(summary["capture_folder"]) / "capture.json").read_text(encoding="utf-8"))
    assert capture["git_commit"] == summary["capture_git_commit"] and capture["config"]["active"] == 2
    assert Path(summary["capture_plot"]).read_bytes()[:4] == b"\x89PNG"


def _check_sample(summary: dict, ws_root: Path) -> None:
    sample = summary["sample"]
    assert sample["problems"] == ["cast", "aicpu", "low_ratio", "block_dim"]
    assert sample["problem_operators"] == {
        "cast": ["Cast"],
        "aicpu": ["NonZero"],
        "low_ratio": ["BatchMatMulV2"],
        "block_dim": ["Transpose"],
    }
    advice = json.loads(Path(sample["json_file"]).read_text(encoding="utf-8"))
    assert advice["problems"] == sample["problems"]
    for name in ("05_sample_top_operators.png", "05_sample_steps.png"):
        assert (ws_root / "reports" / name).read_bytes()[:4] == b"\x89PNG"
    assert summary["compare_step_change_pct"] < -40  # the clean sample has none of the planted costs


@pytest.mark.slow
@pytest.mark.dev_stack  # glue over kit.profiling; tests/test_profiling_*.py capture and read real runs on every stack
def test_notebook_05_profiles_the_workspace_training_run(run_notebook, tmp_path, tiny_llama_dir):
    """Notebook 04's run (its manifest) in the workspace: 05 profiles THAT run and links the capture to it."""
    from test_profiling_training_run import _prepared, _train_config, _training_run

    from kit.core.workspace import get_workspace

    ws = get_workspace(tmp_path / "ws", model="tiny")
    data = _prepared(ws, tiny_llama_dir)
    run_dir = _training_run(ws.output("pretrain"), _train_config(ws, tiny_llama_dir, data))
    run_m = read_manifest(run_dir, expect=TRAINING_RUN)
    from kit.core.inputs import name_run

    name_run(ws, run_dir, "notebook 04")

    _out, summary = run_notebook("05", WORKSPACE=str(ws.root), **TINY)
    _check_capture(summary)
    _check_sample(summary, ws.root)
    assert summary["training_run"] == str(run_m.folder) and summary["configured_here"] == ""
    assert summary["training_run_manifest_sha256"] == run_m.sha256
    cap_m = read_manifest(summary["capture_folder"], expect=PROFILE_CAPTURE)
    assert [(c.kind, c.path, c.manifest_sha256) for c in cap_m.inputs] == [
        (TRAINING_RUN, str(run_m.folder), run_m.sha256)
    ]
    assert summary["profiled_model_path"] == str(tiny_llama_dir) and summary["profiled_dataset_path"] == str(
        data
    )
    assert summary["profiled_run_type"] == "pretrain" and summary["profiled_train_iters"] == 3


@pytest.mark.slow
@pytest.mark.dev_stack  # glue over kit.profiling; tests/test_profiling_*.py capture and read real runs on every stack
def test_notebook_05_alone_configures_a_run(run_notebook, tiny_llama_dir):
    """No training run in the workspace: 05 trains notebook 04's defaults on MODEL_PATH and says so."""
    out, summary = run_notebook("05", MODEL_PATH=str(tiny_llama_dir), SEQ_LEN=32, **TINY)
    _check_capture(summary, same_ops_per_step=False)
    assert summary["training_run"] is None and summary["configured_here"].startswith(
        "no training run named in"
    )
    assert summary["profiled_model_path"] == str(tiny_llama_dir) and summary["profiled_run_type"] == "sft"
    cells = json.loads(Path(out).read_text(encoding="utf-8"))["cells"]
    printed = "".join(
        "".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
    )
    assert printed.count(summary["configured_here"]) == 1  # said once, in one line
