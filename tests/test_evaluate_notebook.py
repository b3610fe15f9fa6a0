"""Notebook 06 headless on tiny models: a training run written as notebook 04 writes it, then the evaluation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kit.core.workspace import repo_root

NOTEBOOK = repo_root() / "notebooks" / "06_evaluate.ipynb"


@pytest.mark.slow
@pytest.mark.dev_stack  # glue over kit.evaluate; tests/test_evaluate*.py cover it (02 -> 04 -> 06 too) on every stack
def test_notebook_06_runs_on_tiny_models(run_notebook, tiny_llama_dir, tmp_path):
    from fixtures.training_run import tiny_training_run

    ws_root = tmp_path / "ws"
    run = tiny_training_run(ws_root, tiny_llama_dir, tmp_path / "trained")
    _, summary = run_notebook(
        "06",
        WORKSPACE=str(ws_root),
        MODEL="tiny",
        TASK_LIMIT=3,
        ENGINE="kit",
        MAX_NEW_TOKENS=4,
        BATCH_SIZES=[1, 2],
        PROMPT_LENGTHS=[8, 16],
        DECODE_TOKENS=2,
    )
    # the newest run of the workspace was found and read through its manifest
    assert summary["folder"] == str((run / "evaluation" / "eval").resolve())
    kinds = {c["kind"]: c["path"] for c in summary["consumed"]}
    assert kinds["training-run"] == str(run.resolve()) and "hf-model" in kinds and "prepared-data" in kinds
    assert summary["base_model"] == str(tiny_llama_dir.resolve())
    assert summary["trained_heldout_loss"] > 0 and summary["base_heldout_loss"] > 0
    assert summary["trained_heldout_perplexity"] == pytest.approx(math.exp(summary["trained_heldout_loss"]))
    for key in ("kit_mc_en_acc", "kit_mc_zh_acc", "decode_tokens_per_s", "ttft_ms"):
        assert f"base_{key}" in summary and f"trained_{key}" in summary
    assert Path(summary["speed_plot"]).stat().st_size > 1000
    results = json.loads(Path(summary["results_json"]).read_text())
    assert set(results["generations"]) == {"base", "trained"} and len(results["generations"]["base"]) == 2
