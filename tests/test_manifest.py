"""Stage manifests: written by the stage that made a folder, read with the kind checked, damage detected."""

from __future__ import annotations

import json

import pytest

from kit.core.manifest import (
    CONVERTED_CHECKPOINT,
    MANIFEST_NAME,
    PREPARED_DATA,
    TRAINING_RUN,
    read_manifest,
    tokenizer_sha256,
    write_manifest,
)
from kit.errors import InputError, IntegrityError, MissingInputError

DATA_FIELDS = dict(
    data_kind="sft",
    max_length=256,
    tokenizer="/tok",
    tokenizer_sha256="ab",
    eos_token_id=2,
    pad_token_id=0,
    counts={"records_read": 3},
    template="telechat",
    pack=True,
    vocab_size=100,
    hf_path="/d",
    megatron_prefix=None,
    megatron_flags=[],
    heldout=None,
)


def test_round_trip_records_inputs_and_hash(tmp_path):
    (tmp_path / "d").mkdir()
    data = write_manifest(tmp_path / "d", PREPARED_DATA, DATA_FIELDS)
    assert data.kind == PREPARED_DATA and data["max_length"] == 256 and len(data.sha256) == 64
    (tmp_path / "run").mkdir()
    run = write_manifest(
        tmp_path / "run",
        TRAINING_RUN,
        dict(
            run_type="sft",
            config={"seq_len": 256},
            sources={"seq_len": "manifest"},
            data=str(data.folder),
            model="/m",
            checkpoints=[],
            hf=None,
            metrics="m.jsonl",
            log="x.log",
        ),
        inputs=[data.as_input()],
    )
    again = read_manifest(tmp_path / "run", expect=TRAINING_RUN)
    assert again.consumed(PREPARED_DATA)[0].manifest_sha256 == data.sha256
    assert again.consumed(PREPARED_DATA)[0].path == str(data.folder)
    assert again.sha256 == run.sha256


def test_missing_wrong_kind_and_damaged_are_one_line_errors(tmp_path):
    with pytest.raises(MissingInputError, match="does not exist; expected a prepared-data folder"):
        read_manifest(tmp_path / "nope", expect=PREPARED_DATA)
    (tmp_path / "plain").mkdir()
    with pytest.raises(InputError, match=f"has no {MANIFEST_NAME}.*made by notebook 02"):
        read_manifest(tmp_path / "plain", expect=PREPARED_DATA)
    (tmp_path / "d").mkdir()
    write_manifest(tmp_path / "d", PREPARED_DATA, DATA_FIELDS)
    with pytest.raises(
        InputError, match="is a prepared-data folder .*notebook 02.*expected a converted-checkpoint"
    ):
        read_manifest(tmp_path / "d", expect=CONVERTED_CHECKPOINT)
    path = tmp_path / "d" / MANIFEST_NAME
    path.write_text(path.read_text()[:40])
    with pytest.raises(IntegrityError, match="is damaged"):
        read_manifest(tmp_path / "d")
    record = {"kind": PREPARED_DATA, "fields": {"data_kind": "sft"}}
    path.write_text(json.dumps(record))
    with pytest.raises(IntegrityError, match="lacks"):
        read_manifest(tmp_path / "d")


def test_tokenizer_hash_follows_the_defining_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text("{}")
    first = tokenizer_sha256(tmp_path)
    (tmp_path / "config.json").write_text('{"x": 1}')  # not a tokenizer file
    assert tokenizer_sha256(tmp_path) == first
    (tmp_path / "tokenizer.json").write_text('{"v": 2}')
    assert tokenizer_sha256(tmp_path) != first
    with pytest.raises(MissingInputError):
        tokenizer_sha256(tmp_path / "config.json")


def test_handover_lines_follow_the_chain(tmp_path):
    data_dir = tmp_path / "processed" / "alpaca_hf"
    data_dir.mkdir(parents=True)
    data = write_manifest(data_dir, PREPARED_DATA, DATA_FIELDS)
    (tmp_path / ".x.partial-1").mkdir()
    write_manifest(tmp_path / ".x.partial-1", PREPARED_DATA, DATA_FIELDS)  # unfinished: not listed
    from kit.core.manifest import handover_lines

    lines = handover_lines(tmp_path)
    assert lines == ["prepared-data         processed/alpaca_hf  <- -"]
    run_dir = tmp_path / "saved" / "sft"
    run_dir.mkdir(parents=True)
    fields = dict(
        run_type="sft", config={}, sources={}, data=str(data_dir), model="/m", checkpoints=[], hf=None
    )
    write_manifest(run_dir, TRAINING_RUN, dict(fields, metrics="m", log="l"), inputs=[data.as_input()])
    assert handover_lines(tmp_path)[-1] == (
        f"training-run          saved/sft  <- prepared-data processed/alpaca_hf ({data.sha256[:8]})"
    )
