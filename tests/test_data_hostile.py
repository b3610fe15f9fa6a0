"""Hostile and damaged inputs to the data stage: each gives a one-line error naming file:line, or is handled as
documented (BOM accepted, formats detected per record, special-token strings kept as text), and nothing that
looks complete is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kit.__main__ import main
from kit.data import DataConfig, DataInputError, IndexedReader, load_prepared, prepare

FIX = Path(__file__).parent / "fixtures" / "data"
ROOT = Path(__file__).resolve().parent.parent


def _sft(out, inputs, **kw):
    cfg = DataConfig(kind="sft", inputs=[str(p) for p in inputs], max_length=32, out_dir=str(out), **kw)
    return prepare(cfg, progress=False)


def _pretrain(out, inputs, **kw):
    cfg = DataConfig(kind="pretrain", inputs=[str(p) for p in inputs], max_length=8, out_dir=str(out), **kw)
    return prepare(cfg, progress=False)


@pytest.fixture(scope="module")
def tok():
    from kit.data.tokenizing import load_tokenizer

    return load_tokenizer()


def test_utf8_bom_is_accepted_in_jsonl_json_array_and_csv(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": "d"}\n')
    want = load_prepared(_sft(tmp_path / "plain", [plain]).hf_dir)["input_ids"]
    for name in ("bom.jsonl", "bom_array.json", "bom.csv"):
        res = _sft(tmp_path / name, [FIX / name])
        assert res.report.records_written == 2 and res.report.records_dropped == 0, name
        assert load_prepared(res.hf_dir)["input_ids"] == want, name


def test_utf16_file_is_refused_with_its_own_fix(tmp_path):
    with pytest.raises(DataInputError, match=r"utf16.jsonl: the file is UTF-16 .*iconv -f UTF-16"):
        _sft(tmp_path / "o", [FIX / "utf16.jsonl"])


def test_nothing_usable_with_skip_is_an_error_and_writes_nothing(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(DataInputError) as info:
        _sft(out, [FIX / "nothing_usable.jsonl"], on_error="skip")
    msg = str(info.value)
    assert "no usable record (4 read" in msg and "missing_field 1" in msg and "empty_answer 1" in msg
    assert "on_error='skip'" not in msg  # skipping is what led here; the hint would be wrong
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []
    # pretraining text with only blank documents: the same
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n \t\n")
    with pytest.raises(DataInputError, match="no usable record"):
        _pretrain(out, [blank])
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []
    # text, but fewer tokens than one sample: no dataset of 0 rows is published (nor its Megatron files)
    short = tmp_path / "short.txt"
    short.write_text("hi\n\nyo\n")
    with pytest.raises(DataInputError, match=r"no sample: \d+ tokens in 2 records .* max_length=\d+"):
        _pretrain(out, [short])
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def test_cli_nothing_usable_exits_2_with_one_line(tmp_path, capsys):
    out = tmp_path / "o"
    code = main(
        ["data", "sft", str(FIX / "nothing_usable.jsonl"), "--on-error", "skip", "--out-dir", str(out)]
    )
    err = [
        ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "records [" not in ln
    ]  # no bar
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "no usable record" in err[0]
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def test_json_array_errors_give_the_line_and_the_item(tmp_path):
    path = FIX / "array_bad_item.json"
    with pytest.raises(DataInputError) as info:
        _sft(tmp_path / "o", [path])
    assert str(info.value).startswith(f"{path}:10 (item 3): field 'output' is a int")
    broken = FIX / "array_broken.json"
    with pytest.raises(DataInputError) as info:
        _sft(tmp_path / "o", [broken])
    assert str(info.value).startswith(f"{broken}:5 (item 2): malformed JSON (Expecting ',' delimiter")
    # skipped records keep their positions in the report
    res = _sft(tmp_path / "s", [path], on_error="skip")
    assert res.report.records_written == 2 and res.report.dropped == {"bad_type": 1}
    assert res.report.problems[0].startswith(f"{path}:10 (item 3):")


def test_json_array_non_object_item_and_empty_array(tmp_path):
    arr = tmp_path / "a.json"
    arr.write_text('[\n  {"instruction": "a", "output": "b"},\n  [1, 2]\n]\n')
    with pytest.raises(DataInputError, match=r"a.json:3 \(item 2\): item 2 is a list"):
        _sft(tmp_path / "o", [arr])
    empty = tmp_path / "e.json"
    empty.write_text(" [ ] \n")
    with pytest.raises(DataInputError, match="e.json: the JSON array is empty"):
        _sft(tmp_path / "o", [empty])
    tail = tmp_path / "t.json"
    tail.write_text('[{"instruction": "a", "output": "b"}] x\n')
    with pytest.raises(DataInputError, match=r"t.json:1: malformed JSON \(text after the closing"):
        _sft(tmp_path / "o", [tail])


def test_mixed_sharegpt_and_openai_records_are_all_used(tmp_path):
    res = _sft(tmp_path / "o", [FIX / "mixed_dialogs.jsonl"], template="chatml", pack=False)
    rep = res.report
    assert rep.records_written == 4 and rep.records_dropped == 0
    assert rep.formats == {"openai": 2, "sharegpt": 2}
    assert rep.table().loc["format: sharegpt", "value"] == 2
    rows = load_prepared(res.hf_dir)["input_ids"]
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2]


def test_unknown_record_format_names_its_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"prompt": "c", "completion": "d"}\n')
    with pytest.raises(DataInputError, match=r"m.jsonl:2: cannot tell the dialog format .*'completion'"):
        _sft(tmp_path / "o", [path])
    res = _sft(tmp_path / "s", [path], on_error="skip")
    assert res.report.records_written == 1 and res.report.dropped == {"unknown_format": 1}


def test_special_token_strings_in_raw_text_are_text_by_default(tmp_path, tok):
    path = FIX / "special_tokens.txt"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eos = tok.eos_token_id
    assert tok.eos_token == "</s>"  # the fixture spells the sample tokenizer's EOS twice
    res = _pretrain(tmp_path / "t", [path])
    doc = IndexedReader(res.megatron_prefix)[0].tolist()
    assert im_end not in doc and doc.count(eos) == 1 and doc[-1] == eos  # only the appended end marker
    lines = path.read_text().splitlines()
    plain = tok(lines[0], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert doc == plain + [eos]
    counts = {"<|im_end|>": 1, "</s>": 2}
    assert res.report.special_strings == counts
    assert res.report.table().loc["special-token string in text: </s>", "value"] == 2  # notebook 02 shows it
    assert any("tokenized as plain text" in w and "'</s>' x2" in w for w in res.report.warnings)
    kept = _pretrain(tmp_path / "k", [path], keep_special_tokens=True)
    doc = IndexedReader(kept.megatron_prefix)[0].tolist()
    assert im_end in doc and doc.count(eos) == 3
    assert kept.report.special_strings == counts
    assert any("became control tokens" in w for w in kept.report.warnings)
    # the same with worker processes
    two = _pretrain(tmp_path / "w", [path], num_workers=2)
    assert two.report.special_strings == counts
    assert Path(two.megatron_prefix + ".bin").read_bytes() == Path(res.megatron_prefix + ".bin").read_bytes()


def test_special_token_switch_on_the_command_line(tmp_path, capsys):
    out = tmp_path / "o"
    args = ["data", "pretrain", str(FIX / "special_tokens.txt"), "--max-length", "8", "--out-dir", str(out)]
    assert main(args + ["--keep-special-tokens"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["records_written"] == 2  # stdout stays one JSON document
    assert "became control tokens" in captured.err
    cfg = json.loads((out / "corpus_hf" / "config.json").read_text())
    assert cfg["keep_special_tokens"] is True


@pytest.mark.parametrize(
    "args,words",
    [
        (["data", "sft", "/no/such/file.jsonl"], "input '/no/such/file.jsonl' does not exist"),
        (["data", "sft", "--template", "nope"], "template='nope'"),
        (["data", "check", "/no/such/folder"], "expected a prepared-data folder (made by notebook 02"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, args, words):
    code = main(args + (["--out-dir", str(tmp_path / "o")] if args[1] != "check" else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_cli_columns_that_are_not_json(tmp_path, capsys):
    """A malformed JSON mapping is refused by the option's parser (argparse: usage, then the error; exit 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["data", "pretrain", "--columns", "{text: 1}", "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        exc.value.code == 2
        and "argument --columns: --columns '{text: 1}': Expecting property name" in err[-1]
    )
    assert not (tmp_path / "o").exists()


def test_cli_damaged_prepared_folder_and_long_names(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["data", "sft", "--max-records", "4", "--max-length", "64", "--out-dir", str(out)]) == 0
    capsys.readouterr()
    manifest = out / "alpaca_hf" / "kit_manifest.json"
    record = json.loads(manifest.read_text())
    record["fields"]["num_samples"] = 999
    manifest.write_text(json.dumps(record))
    assert main(["data", "check", str(out / "alpaca_hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "rows but the manifest says 999" in err[0]
    # a folder name longer than the filesystem allows: one line from kit.errors, nothing written
    long_out = tmp_path / ("x" * 300)
    assert main(["data", "sft", "--max-records", "4", "--out-dir", str(long_out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "file name is too long" in err[0]


def test_help_imports_only_light_modules():
    code = (
        "import sys\n"
        "from kit.__main__ import main\n"
        "try:\n"
        "    main(['data', 'sft', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('numpy', 'pandas', 'pyarrow', 'datasets', 'transformers', 'torch', 'tokenizers')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_lazy_package_still_exports_everything():
    import kit.data

    for name in kit.data.__all__:
        assert getattr(kit.data, name) is not None
    with pytest.raises(AttributeError):
        kit.data.no_such_name  # noqa: B018
    assert isinstance(np.int32(1), np.int32)  # numpy stays importable next to the lazy package


def test_parquet_text_nulls_wrong_types_and_damage(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document number {i}" for i in range(3000)]
    texts[2100] = None
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=1000)
    with pytest.raises(DataInputError, match=r"nulls.parquet:2101: missing field 'text'"):
        _pretrain(tmp_path / "o", [path])
    res = _pretrain(tmp_path / "s", [path], on_error="skip")
    assert res.report.records_read == 3000 and res.report.records_written == 2999
    assert res.report.dropped == {"missing_field": 1}
    capped = _pretrain(tmp_path / "m", [path], max_records=1500)  # max_records inside a bulk batch
    assert capped.report.records_read == 1500 == capped.report.records_written
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": list(range(5))}), numbers)
    with pytest.raises(DataInputError, match=r"numbers.parquet:1: field 'text' is a int"):
        _pretrain(tmp_path / "o", [numbers])
    # the same bytes with the middle overwritten: an error naming the file, not a pyarrow traceback
    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": texts[:2000]}), damaged, row_group_size=500, compression="snappy")
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 2000] = b"\xff" * 2000
    damaged.write_bytes(bytes(raw))
    with pytest.raises(DataInputError, match=r"damaged.parquet"):
        _pretrain(tmp_path / "o", [damaged])
    assert not (tmp_path / "o").exists() or sorted(p.name for p in (tmp_path / "o").iterdir()) == []


def test_parquet_dialogs_with_a_partial_column_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"instruction": ["hello", "name?"], "response": ["hi", "kit"]}), path)
    res = _sft(tmp_path / "o", [path], columns={"output": "response"})
    assert res.report.records_written == 2 and res.report.records_dropped == 0


def test_special_string_counts_are_the_leftmost_longest_matches(tok):
    """The counter skips special strings whose first character is absent; its counts must equal one regex pass
    over all of them (leftmost-longest, no overlaps), on texts built from the strings and their pieces."""
    import collections
    import random
    import re

    from kit.data.tokenizing import special_string_counter, special_strings

    strings = special_strings(tok)
    assert len(strings) > 3
    full = re.compile("|".join(re.escape(s) for s in strings))
    count = special_string_counter(tok)
    rng = random.Random(0)
    pieces = strings + ["a", "<", "[", "|", " ", "x", strings[0][:3], strings[-1][1:]]
    for _ in range(300):
        texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 20))) for _ in range(3)]
        want = dict(collections.Counter(full.findall("\x00".join(texts))))
        assert count(texts) == want
    assert count([f"{strings[0]} and {strings[0]}", "", strings[0]]) == {strings[0]: 3}
    assert count(["1 2 3"]) == {}
