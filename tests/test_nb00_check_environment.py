"""Notebook 00 runs headless and writes the doctor's report."""

from __future__ import annotations

import json


def test_notebook_00_writes_report(run_notebook, tmp_path):
    _out, summary = run_notebook(
        "00", CHECK_DEEPSPEED=False, EXPLAIN_ERROR="EJ0001: Failed to initialize the HCCP process."
    )
    assert summary["ok"] is True and summary["device"] == "cpu" and summary["backend"] == "gloo"
    report = json.loads(open(summary["report"]).read())
    names = {c["name"] for c in report["checks"]}
    assert {"python", "torch", "torch_npu", "CANN", "device", "dtype"} <= names
    assert "deepspeed" not in names  # the parameter was honoured


def test_unknown_parameter_is_refused(run_notebook):
    import pytest

    with pytest.raises(ValueError, match="no parameter"):
        run_notebook("00", NOT_A_PARAMETER=1)
