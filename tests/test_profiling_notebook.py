"""Notebook 05 runs headless on tiny parameters and writes its summary, advice files and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.slow
def test_notebook_05_profiles_and_advises(run_notebook):
    _out, summary = run_notebook(
        "05", MODEL="tiny", DEVICE="cpu", WAIT=0, WARMUP=1, ACTIVE=1, SEQ_LEN=16, TOP=5
    )
    assert summary["capture_kind"] == "cpu" and summary["capture_steps"] == 2
    assert len(summary["capture_traces"]) == 1 and Path(summary["capture_traces"][0]).exists()
    assert "aten::mm" in summary["capture_top_operators"]
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
    assert capture["git_commit"] == summary["capture_git_commit"] and capture["config"]["active"] == 1
