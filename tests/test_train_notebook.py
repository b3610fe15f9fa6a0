"""Notebook 04 end to end on a tiny model: in-kernel SFT, before/after generation, launched LoRA, Megatron plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kit.workspace import repo_root

NOTEBOOK = repo_root() / "notebooks" / "04_adapted_training.ipynb"


def test_notebook_is_committed_without_outputs():
    out = subprocess.run(
        [sys.executable, "-m", "nbstripout", "--verify", str(NOTEBOOK)],  # this interpreter's, in any venv
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


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
        MAX_NEW_TOKENS=8,
    )
    assert summary["status"] == "completed" and summary["iterations"] == 5
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
