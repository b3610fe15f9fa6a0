"""Notebook 03 on a tiny model: converts into the workspace, verifies, and writes its summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.convert.megatron_io import MegatronReader
from kit.core.workspace import repo_root

NB = repo_root() / "notebooks" / "03_weight_conversion.ipynb"


@pytest.mark.slow
@pytest.mark.dev_stack  # glue over kit.convert, which tests/test_convert*.py cover on every stack
def test_notebook_03_converts_and_verifies(run_notebook, tiny_llama_dir, tmp_path):
    _, summary = run_notebook("03_", SOURCE=str(tiny_llama_dir), TP=2, PP=2, LOGITS_TOKENS=8)
    assert summary is not None
    assert (summary["family"], summary["tp"], summary["pp"], summary["rank_files"]) == ("llama", 2, 2, 4)
    assert summary["verified"] and summary["round_trip_bit_exact"] and summary["verification"] == "done"
    assert summary["logits_max_abs_diff"] <= 1e-4
    target = Path(summary["target"])
    assert (
        target == tmp_path / "ws" / "processed_for_ma_input" / "demo" / "converted_weights" / "tp2pp2_local"
    )
    mr = MegatronReader(target)
    assert (mr.tp, mr.pp, mr.flavor) == (2, 2, "local")
    assert (target / "rank_file_sizes.png").stat().st_size > 1000
    assert {c["check"] for c in summary["checks"] if c["passed"]} == {c["check"] for c in summary["checks"]}
    assert not list((target.parent / ".verify").glob("hf_round_trip"))  # the round-trip copy was cleaned up


def test_notebook_03_parameters_default_to_the_workspace_and_the_demo_model():
    from kit.core.notebooks import parameters_of

    params = parameters_of(NB)
    # None: the project's model and workspace (kit.core.project), and the demo model as SOURCE
    assert params["WORKSPACE"] is None and params["MODEL"] is None and params["SOURCE"] is None
