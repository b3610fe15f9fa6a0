"""Readers and bad input: each problem names file and line and the fix; on_error='skip' counts instead."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kit.data import DataConfig, DataInputError, load_prepared, prepare
from kit.data.readers import iter_records
from kit.storage.atomic import OutputExistsError

FIX = Path(__file__).parent / "fixtures" / "data"


def _sft(tmp_path, inputs, **kw):
    cfg = DataConfig(
        kind="sft",
        inputs=[str(p) for p in inputs],
        max_length=32,
        out_dir=str(tmp_path / "out"),
        megatron=kw.pop("megatron", True),
        **kw,
    )
    return prepare(cfg, progress=False)


@pytest.mark.parametrize(
    "name,line,words",
    [
        ("malformed.jsonl", 3, "malformed JSON"),
        ("missing_field.jsonl", 2, "missing field 'output'"),
        ("non_string.jsonl", 2, "is a int, not a string"),
        ("gbk.jsonl", 2, "not valid UTF-8"),
        ("empty.jsonl", 0, "the file is empty"),
    ],
)
def test_bad_input_names_file_line_and_fix(tmp_path, name, line, words):
    with pytest.raises(DataInputError) as info:
        _sft(tmp_path, [FIX / name])
    msg = str(info.value)
    where = f"{FIX / name}:{line}" if line else str(FIX / name)
    assert msg.startswith(where + ":") and words in msg and "Fix:" in msg and "on_error='skip'" in msg
    # nothing that looks finished is left behind, and no partial files either
    out = tmp_path / "out"
    assert not out.exists() or [p.name for p in out.iterdir()] == []


def test_skip_counts_every_reason(tmp_path):
    files = [
        FIX / n
        for n in (
            "malformed.jsonl",
            "missing_field.jsonl",
            "non_string.jsonl",
            "gbk.jsonl",
            "empty.jsonl",
            "empty_answer.jsonl",
        )
    ]
    res = _sft(tmp_path, files, on_error="skip")
    rep = res.report
    # one bad line each; the non-UTF-8 line alone is skipped, the rest of its file is kept
    assert rep.dropped == {
        "bad_type": 1,
        "empty_answer": 1,
        "encoding": 1,
        "malformed": 1,
        "missing_field": 1,
    }
    assert rep.as_dict()["files_skipped"] == {"empty_file": 1}
    # good records: 3 + 1 + 1 + 1 (gbk line 1) + 1 (empty_answer line 2); every record read is accounted for
    assert rep.records_written == 7 and rep.records_read == 12
    assert rep.records_read == rep.records_written + rep.records_dropped
    assert any("malformed.jsonl:3" in p for p in rep.problems)
    assert any("gbk.jsonl:2" in p for p in rep.problems)
    assert len(load_prepared(res.hf_dir).to_dict()["seq_lens"]) == rep.samples


def test_non_utf8_line_in_the_middle_is_skipped_alone(tmp_path):
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"one\n" + "二\n".encode("gbk") + b"three\n")
    res = prepare(
        DataConfig(
            kind="pretrain", inputs=[str(path)], max_length=8, on_error="skip", out_dir=str(tmp_path / "o")
        ),
        progress=False,
    )
    assert res.report.records_written == 2 and res.report.dropped == {"encoding": 1}


def test_existing_output_not_overwritten(tmp_path):
    src = FIX / "empty_answer.jsonl"
    first = _sft(tmp_path, [src])
    before = (first.hf_dir / "kit_manifest.json").read_bytes()
    with pytest.raises(OutputExistsError, match="overwrite"):
        _sft(tmp_path, [src], max_records=1)
    assert (first.hf_dir / "kit_manifest.json").read_bytes() == before
    again = _sft(tmp_path, [src], overwrite=True, system="S")
    assert json.loads((again.hf_dir / "config.json").read_text())["system"] == "S"


def test_formats_and_field_mapping(tmp_path):
    rows = [{"q": "hello", "a": "hi"}, {"q": "name?", "a": "kit"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "x.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "x.csv", index=False)
    (tmp_path / "x.json").write_text(json.dumps([{"instruction": r["q"], "output": r["a"]} for r in rows]))
    sharegpt = [
        {"conversations": [{"from": "human", "value": r["q"]}, {"from": "gpt", "value": r["a"]}]}
        for r in rows
    ]
    (tmp_path / "s.jsonl").write_text("\n".join(json.dumps(x) for x in sharegpt))
    openai = [
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": r["q"]},
                {"role": "assistant", "content": r["a"]},
            ]
        }
        for r in rows
    ]
    (tmp_path / "o.jsonl").write_text("\n".join(json.dumps(x) for x in openai))
    results = {}
    for name, kw in [
        ("x.parquet", {"columns": {"instruction": "q", "output": "a"}}),
        ("x.csv", {"columns": {"instruction": "q", "output": "a"}}),
        ("x.json", {}),
        ("s.jsonl", {}),
        ("o.jsonl", {"template": "chatml"}),
    ]:
        res = _sft(tmp_path / f"o_{name}", [tmp_path / name], megatron=False, **kw)
        ds = load_prepared(res.hf_dir)
        results[name] = ds[0]["input_ids"]
        assert res.report.records_written == 2
    assert results["x.parquet"] == results["x.csv"] == results["x.json"] == results["s.jsonl"]
    from transformers import AutoTokenizer

    from kit.core.samples import sample_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(sample_tokenizer_dir()))
    assert tok.decode([t for t in results["o.jsonl"] if t != 3]).startswith("<|im_start|>system\nS<|im_end|>")


def test_bad_roles_and_unknown_columns(tmp_path):
    (tmp_path / "r.jsonl").write_text(
        json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n"
    )
    with pytest.raises(DataInputError, match="r.jsonl:1: roles"):
        _sft(tmp_path, [tmp_path / "r.jsonl"])
    with pytest.raises(ValueError, match="are not kit fields"):
        _sft(tmp_path, [FIX / "empty_answer.jsonl"], columns={"answer": "output"})


def test_readers_stream_folders_in_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("two\n\nthree\n")
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n')
    recs = list(iter_records([str(tmp_path)]))
    assert [(Path(r.source).name, r.line, r.data["text"]) for r in recs] == [
        ("a.jsonl", 1, "one"),
        ("2.txt", 1, "two"),
        ("2.txt", 2, ""),
        ("2.txt", 3, "three"),
    ]
    with pytest.raises(ValueError, match="unsupported file type"):
        list(iter_records([str(FIX.parent.parent / "conftest.py")]))


def test_config_lists_every_problem():
    from kit.core.configs import ConfigError, check

    with pytest.raises(ConfigError) as info:
        check(
            DataConfig(
                kind="x",
                max_length=2,
                template="nope",
                on_error="ignore",
                num_workers=0,
                inputs=["/no/such/file"],
            )
        )
    assert len(info.value.problems) == 6
