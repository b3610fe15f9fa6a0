"""Notebook 05 runs headless on tiny parameters and writes its summary, advice files and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kit.profiling as kp


@pytest.mark.slow
def test_notebook_05_profiles_and_advises(run_notebook):
    _out, summary = run_notebook(
        "05", MODEL="tiny", DEVICE="cpu", WAIT=0, WARMUP=1, ACTIVE=2, SEQ_LEN=16, TOP=5
    )
    assert summary["capture_kind"] == "cpu" and summary["capture_steps"] == 3
    assert len(summary["capture_traces"]) == 1 and Path(summary["capture_traces"][0]).exists()
    # what the run produced, never how fast operators ranked (a loaded machine reorders them)
    data = kp.load(summary["capture_folder"])
    table = kp.operator_table(data)
    assert {"aten::mm", "aten::addmm"} & set(table["type"])  # the linear layers were captured
    assert summary["capture_top_operators"] == list(table["type"].head(5))  # the notebook's top table
    assert len(summary["capture_top_operators"]) == 5 and table["total_us"].is_monotonic_decreasing
    steps = sorted(data.kernels["step"].dropna().unique())
    assert len(steps) == 2  # the two active steps, each with the same operator calls
    per_step = data.kernels.groupby(["step", "type"]).size().unstack(fill_value=0)
    assert (per_step.loc[steps[0]] == per_step.loc[steps[1]]).all()
    mm = table.set_index("type").loc["aten::mm", "calls"]
    assert mm == 2 * per_step.loc[steps[0], "aten::mm"] and mm > 0
    assert summary["capture_problems"] == []
    assert summary["sample_problems"] == ["cast", "aicpu", "low_ratio", "block_dim"]
    assert summary["sample_problem_operators"] == {
        "cast": ["Cast"],
        "aicpu": ["NonZero"],
        "low_ratio": ["BatchMatMulV2"],
        "block_dim": ["Transpose"],
    }
    advice = json.loads(Path(summary["sample_advice"]).read_text(encoding="utf-8"))
    assert advice["problems"] == summary["sample_problems"]
    for png in [summary["capture_plot"], *summary["sample_plots"]]:
        assert Path(png).read_bytes()[:4] == b"\x89PNG"
    assert summary["compare_step_change_pct"] < -40  # the clean sample has none of the planted costs
    capture = json.loads((Path(summary["capture_folder"]) / "capture.json").read_text(encoding="utf-8"))
    assert capture["git_commit"] == summary["capture_git_commit"] and capture["config"]["active"] == 2
