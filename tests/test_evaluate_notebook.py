"""Notebook 06 headless on tiny models: a training run written as notebook 04 writes it, then the evaluation; and with
a DPO run started from that run, base / SFT / DPO side by side with their preference accuracy."""

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
    # no DPO run in the workspace: one sentence says so, the rest as before
    assert summary["dpo_run"] is None and "trained_preference_accuracy" not in summary
    assert [
        n for n in summary["notes"] if n.startswith("preference accuracy skipped: no DPO run started from")
    ]


@pytest.mark.slow
@pytest.mark.dev_stack  # glue over kit.evaluate; tests/test_evaluate_chain.py runs the real DPO chain on every stack
def test_notebook_06_shows_base_sft_and_dpo_preference_side_by_side(run_notebook, tiny_llama_dir, tmp_path):
    from fixtures.training_run import tiny_dpo_run, tiny_training_run

    ws_root = tmp_path / "ws"
    sft = tiny_training_run(ws_root, tiny_llama_dir, tmp_path / "sft")
    dpo = tiny_dpo_run(ws_root, sft, tmp_path / "dpo")
    executed, summary = run_notebook(
        "06", WORKSPACE=str(ws_root), MODEL="tiny", PARTS=["heldout", "preference"]
    )
    # the named run is the DPO run; its SFT run and base come through the manifests
    assert summary["dpo_run"] == str(dpo.resolve()) and summary["sft_run"] == str(sft.resolve())
    assert summary["models"] == {
        "base": str(tiny_llama_dir.resolve()),
        "sft": str((tmp_path / "sft").resolve()),
        "dpo": str((tmp_path / "dpo").resolve()),
    }
    for label in ("base", "sft", "dpo"):
        assert (
            0.0 <= summary[f"{label}_preference_accuracy"] <= 1.0
            and summary[f"{label}_preference_pairs"] == 8
        )
        assert summary[f"{label}_heldout_loss"] > 0  # the SFT run's held-out dialogs, next to the pairs
    assert isinstance(summary["dpo_reward_margin"], float) and summary["pairs_heldout"]["records"] == 8
    # the preference cell renders a table (HTML) with a row per model, after the sentence that sums it up
    cells = json.loads(Path(executed).read_text(encoding="utf-8"))["cells"]
    cell = next(c for c in cells if "result.preference" in "".join(c["source"]))
    html = "".join("".join(o["data"].get("text/html", "")) for o in cell["outputs"] if "data" in o)
    assert "<table" in html and "preference_accuracy" in html and ">dpo<" in html
    markdown = "".join("".join(o["data"].get("text/markdown", "")) for o in cell["outputs"] if "data" in o)
    assert markdown.startswith(
        "On 8 held-out pairs the chosen answer gets the higher log-probability under base"
    )
