"""Notebook 07 headless on a tiny training run: served, talked to, load-tested at two concurrency levels, packaged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kit.core.workspace import repo_root

NOTEBOOK = repo_root() / "notebooks" / "07_serve.ipynb"


@pytest.mark.slow
@pytest.mark.dev_stack  # glue over kit.serve; tests/test_serve.py covers it on every stack that can serve
def test_notebook_07_serves_a_tiny_run(run_notebook, tiny_llama_dir, tmp_path):
    pytest.importorskip("fastapi", reason="needs the serve extra (pip install -e .[serve])")
    from fixtures.training_run import tiny_training_run

    from kit.core.manifest import read_manifest

    ws_root = tmp_path / "ws"
    run = tiny_training_run(ws_root, tiny_llama_dir, tmp_path / "trained")
    _, summary = run_notebook(
        "07",
        WORKSPACE=str(ws_root),
        MODEL="tiny",
        MAX_TOKENS=4,
        LMEVAL_LIMIT=2,
        REQUEST_RATES=[],
        PROMPT_LENGTHS=[16],
        OUTPUT_LENGTHS=[4],
        NUM_PROMPTS=2,
        WARMUP=1,
    )
    assert summary["server"]["model_path"] == read_manifest(run)["hf"]
    assert summary["lm_eval"] == {"model_type": "local-chat-completions", "task": "kit_gen_en", "equal": True}
    assert [row["max_concurrency"] for row in summary["table"]] == [1, 2]
    assert all(row["completed"] == 2 and row["median_ttft_ms"] > 0 for row in summary["table"])
    points = json.loads(Path(summary["results_json"]).read_text())["points"]
    assert [p["output_lens"] for p in points] == [[4, 4], [4, 4]]
    assert summary["package_health"] == 200 and (Path(summary["package"]) / "run.sh").is_file()
    assert read_manifest(summary["package"], expect="serving-package")["port"] == 8080
