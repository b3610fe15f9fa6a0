"""`python -m kit data ...`: prepare, check and list templates from the command line."""

from __future__ import annotations

import json

from kit.__main__ import main


def test_cli_sft_then_check(tmp_path, capsys):
    out = tmp_path / "o"
    assert (
        main(
            [
                "data",
                "sft",
                "--out-dir",
                str(out),
                "--max-length",
                "64",
                "--max-records",
                "12",
                "--template",
                "chatml",
                "--name",
                "demo",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["records_read"] == 12 and summary["hf_dir"] == str(out / "demo_hf")
    assert (out / "demo_packed_labels_document.idx").is_file()
    assert main(["data", "check", str(out / "demo_hf")]) == 0
    assert '"template": "chatml"' in capsys.readouterr().out
    assert main(["data", "sft", "--out-dir", str(out), "--max-length", "64", "--name", "demo"]) == 2
    assert "already exists" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "q", "output": 1}\n')
    assert main(["data", "sft", str(bad), "--out-dir", str(out), "--name", "bad"]) == 2
    assert f"{bad}:1: field 'output' is a int" in capsys.readouterr().err


def test_cli_pretrain_into_workspace(tmp_path, capsys):
    assert (
        main(
            [
                "data",
                "pretrain",
                "--workspace",
                str(tmp_path / "ws"),
                "--model",
                "m",
                "--max-length",
                "32",
                "--max-records",
                "5",
                "--no-megatron",
                "--columns",
                '{"text": "text"}',
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["hf_dir"].endswith("processed_for_ma_input/m/data/pretrain/corpus_hf")
    assert summary["megatron_files"] == []


def test_cli_templates_lists_all(capsys):
    assert main(["data", "templates"]) == 0
    text = capsys.readouterr().out
    for name in (
        "telechat",
        "chatml",
        "qwen",
        "chatglm3",
        "llama2",
        "llama3",
        "baichuan2",
        "alpaca",
        "tokenizer",
    ):
        assert name in text
