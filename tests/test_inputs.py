"""The one input finder: newest output of a kind (one definition of newest), and following a consumed input."""

from __future__ import annotations

import json
import os

from kit.core.inputs import Input, consumed, newest, outputs, run_outputs
from kit.core.manifest import (
    HF_MODEL,
    MANIFEST_NAME,
    PREPARED_DATA,
    TRAINING_RUN,
    read_manifest,
    write_manifest,
)


def _run(folder, created: str, mtime_ns: int, inputs=()):
    names = ("run_type", "config", "sources", "data", "model", "checkpoints", "hf", "metrics", "log")
    man = write_manifest(folder, TRAINING_RUN, dict.fromkeys(names), inputs)
    path = folder / MANIFEST_NAME
    record = json.loads(path.read_text())
    record["created"] = created
    path.write_text(json.dumps(record))
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return man


def test_newest_is_the_latest_created_then_the_latest_written(workspace):
    out = workspace.model_output
    _run(out / "sft", "2026-01-02T00:00:00+00:00", 1_000)
    _run(out / "lora", "2026-01-01T00:00:00+00:00", 9_000)  # written later, but finished a day earlier
    _run(out / "pretrain", "2026-01-02T00:00:00+00:00", 2_000)  # same second as sft: the later write wins
    found = newest(workspace, Input("RUN", TRAINING_RUN))
    assert found.folder == (out / "pretrain").resolve()
    assert found.why == (
        "RUN not given: the newest training-run in the workspace (made 2026-01-02T00:00:00+00:00; 2 older one(s) "
        "passed over)"
    )
    assert [m.folder.name for m in outputs(workspace, TRAINING_RUN)] == ["pretrain", "sft", "lora"]
    assert (
        newest(workspace, Input("RUN", TRAINING_RUN), lambda m: m.folder.name == "lora").folder.name == "lora"
    )
    assert newest(workspace, Input("DATA", PREPARED_DATA)) is None


def test_unfinished_damaged_and_profiled_outputs_are_no_candidates(workspace):
    out = workspace.model_output
    _run(out / "sft", "2026-01-01T00:00:00+00:00", 1_000)
    _run(out / ".partial-pretrain", "2026-02-01T00:00:00+00:00", 1_000)  # a temporary name: not finished
    _run(workspace.profiles / "cap" / "training" / "sft", "2026-02-01T00:00:00+00:00", 1_000)
    (out / "lora").mkdir(exist_ok=True)  # the workspace has the run folders
    (out / "lora" / MANIFEST_NAME).write_text('{"kind": "training-run", "fie')
    assert [m.folder.name for m in outputs(workspace, TRAINING_RUN)] == ["sft"]


def test_consumed_follows_a_recorded_input_of_a_kind(workspace, tmp_path):
    run = _run(workspace.model_output / "sft", "2026-01-01T00:00:00+00:00", 1_000)
    hf = write_manifest(tmp_path / "hf", HF_MODEL, {"family": "llama", "source": "x"}, [run.as_input()])
    assert consumed(hf, TRAINING_RUN).folder == run.folder
    assert consumed(hf, PREPARED_DATA) is None
    (run.folder / MANIFEST_NAME).unlink()  # the run folder is no longer a run: nothing to follow
    assert consumed(read_manifest(hf.folder), TRAINING_RUN) is None


def test_run_outputs_follow_a_runs_manifest_to_its_model_adapter_and_data(workspace, tmp_path):
    from kit.core.manifest import KINDS

    fields = dict.fromkeys(KINDS[PREPARED_DATA][1], None)
    data = write_manifest(tmp_path / "data", PREPARED_DATA, dict(fields, template="chatml"))
    (tmp_path / "adapter").mkdir()
    fields = dict.fromkeys(KINDS[TRAINING_RUN][1], None)
    made = dict(hf=str(tmp_path / "merged"), model=str(tmp_path / "base"), adapter=str(tmp_path / "adapter"))
    run = write_manifest(
        workspace.model_output / "lora", TRAINING_RUN, dict(fields, **made), [data.as_input()]
    )
    made = run_outputs(run.folder)
    assert (made.hf, made.base, made.adapter) == (
        tmp_path / "merged",
        tmp_path / "base",
        tmp_path / "adapter",
    )
    assert made.data.folder == data.folder and made.data.get("template") == "chatml"


def test_later_stages_take_the_named_run_never_the_newest(workspace):
    from kit.core.inputs import NAMED_RUN, name_run, named

    out = workspace.model_output
    sft = _run(out / "sft", "2026-01-01T00:00:00+00:00", 1_000)
    _run(out / "lora", "2026-01-02T00:00:00+00:00", 2_000)  # newer, but not named
    run_row = Input("RUN", TRAINING_RUN)
    assert named(workspace, run_row) is None  # nothing named: no guess
    line = name_run(workspace, sft.folder, "notebook 04 (its in-kernel sft run)")
    assert line == f"notebooks 05-07 take {sft.folder} (notebook 04 (its in-kernel sft run))"
    found = named(workspace, run_row)
    assert found.folder == sft.folder
    assert (
        found.why
        == f"RUN not given: the run named by notebook 04 (its in-kernel sft run) ({out / NAMED_RUN})"
    )
    (sft.folder / MANIFEST_NAME).unlink()  # the named run is gone: nothing is taken in its place
    assert named(workspace, run_row) is None
