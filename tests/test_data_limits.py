"""Bounded input: a record over `max_record_bytes`, JSON nested too deep or an integer with too many digits is one
record's problem (its position in the error, a counted drop with on_error='skip'), in every reader; a 224 MB
single-line record leaves the data stage's peak memory flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kit.data import DataConfig, DataInputError, prepare

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 4096  # bytes: small, so that the test records stay small


def _prep(tmp_path, kind, inputs, **kw):
    kw.setdefault("max_record_bytes", LIMIT)
    cfg = DataConfig(
        kind=kind,
        inputs=[str(p) for p in inputs],
        max_length=128 if kind == "sft" else 8,  # pretraining: the two short texts must make one sample
        out_dir=str(tmp_path / f"out_{kind}_{Path(inputs[0]).name}"),
        **kw,
    )
    return prepare(cfg, progress=False)


def _dialog(answer: str = "fine") -> dict:
    return {"instruction": "how are you", "output": answer}


def _inputs(tmp_path: Path) -> dict:
    """One file per reader, each with a too-large record at a known position (line 2 / item 2 / row 2)."""
    big = "x" * (LIMIT + 10)
    out = {}
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in (_dialog(), _dialog(big), _dialog())) + "\n")
    out["jsonl"] = (p, "d.jsonl:2", "sft")
    p = tmp_path / "d.json"
    p.write_text(json.dumps([_dialog(), _dialog(big), _dialog()], indent=1))
    out["json"] = (p, "d.json:6 (item 2)", "sft")
    p = tmp_path / "d.csv"
    p.write_text(f"instruction,output\nhi,there\nhi,{big}\nhi,again\n")
    out["csv"] = (p, "d.csv:3", "sft")
    p = tmp_path / "d.txt"
    p.write_text(f"a line of text\n{big}\nanother line\n")
    out["txt"] = (p, "d.txt:2", "pretrain")
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["some text", big, "more text"]}), p)
    out["parquet"] = (p, "d.parquet:2", "pretrain")
    return out


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "txt", "parquet"])
def test_too_large_record_is_an_error_with_position_or_a_counted_skip(tmp_path, fmt):
    path, where, kind = _inputs(tmp_path)[fmt]
    with pytest.raises(DataInputError, match=r"over max_record_bytes=4,096") as info:
        _prep(tmp_path, kind, [path])
    assert where in str(info.value)
    res = _prep(tmp_path, kind, [path], on_error="skip", overwrite=True)
    assert res.report.dropped == {"too_large": 1}
    assert res.report.records_read == 3 and res.report.records_written == 2


def test_deep_nesting_and_huge_integers_are_per_record_problems(tmp_path):
    deep = '{"instruction": "a", "output": "b", "x": ' + "[" * 10000 + "]" * 10000 + "}"
    huge = '{"instruction": "a", "output": "b", "n": ' + "7" * 100000 + "}"
    p = tmp_path / "hostile.jsonl"
    p.write_text("\n".join([json.dumps(_dialog()), deep, huge, json.dumps(_dialog())]) + "\n")
    cfg = dict(max_record_bytes=1 << 20)
    with pytest.raises(DataInputError, match=r"hostile.jsonl:2: JSON nested deeper"):
        _prep(tmp_path, "sft", [p], **cfg)
    res = _prep(tmp_path, "sft", [p], on_error="skip", overwrite=True, **cfg)
    # Pythons without int's digit limit (before 3.10.7 / 3.11) parse any number of digits: the record is usable
    digit_limit = hasattr(sys, "get_int_max_str_digits")
    assert res.report.dropped == {"malformed": 1 + digit_limit}
    assert res.report.records_written == 3 - digit_limit
    if digit_limit:
        assert any("hostile.jsonl:3: a JSON number" in m for m in res.report.problems)
    # in a JSON array an item the parser cannot finish ends the file, named with its line and item
    arr = tmp_path / "hostile.json"
    arr.write_text("[\n" + json.dumps(_dialog()) + ",\n" + deep + "\n]")
    with pytest.raises(DataInputError, match=r"hostile.json:3 \(item 2\): JSON nested deeper"):
        _prep(tmp_path, "sft", [arr], **cfg)


def test_max_record_bytes_is_validated():
    assert any("max_record_bytes=0" in p for p in DataConfig(max_record_bytes=0).problems())


_MEASURE = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)
"""


def _peak_rss_mb(args) -> tuple:
    """(exit code, peak RSS in MB) of `python -m kit ...args`, measured in a fresh parent of its own."""
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "kit", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    rc, mb = out.stdout.split()
    return int(rc), int(mb)


def test_a_224_mb_single_line_record_leaves_memory_flat(tmp_path):
    big = tmp_path / "big.jsonl"
    piece = "lorem ipsum dolor. " * 52_700  # ~1 MB, written 224 times: no 224 MB string in this process
    with open(big, "w") as fh:
        fh.write(json.dumps({"instruction": "hi", "output": "there", "text": "a document."}) + "\n")
        fh.write('{"instruction": "hi", "text": "x", "output": "')
        for _ in range(224):
            fh.write(piece)
        fh.write('"}\n')
        fh.write(json.dumps({"instruction": "hi", "output": "again", "text": "another document."}) + "\n")
    assert big.stat().st_size > 224e6
    out = tmp_path / "out"
    rc, mb = _peak_rss_mb(["data", "sft", str(big), "--out-dir", str(out), "--on-error", "skip"])
    assert rc == 0
    report = json.loads((out / "alpaca_hf" / "report.json").read_text())
    assert report["dropped"] == {"too_large": 1} and report["records_written"] == 2
    # the kit with torch and transformers loaded takes ~400 MB here; reading the line alone would add 224 MB, and
    # parsing and tokenizing it (what happened before the limit) passed 10 GB
    assert mb < 1000, f"peak RSS {mb} MB"
