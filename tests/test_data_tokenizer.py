"""Tokenizer loading: sample default, trust_remote_code as an explicit opt-in, fast path equals the HF call."""

from __future__ import annotations

import json
import shutil

import pytest

from kit.core.samples import sample_tokenizer_dir
from kit.data import DataConfig, IndexedReader, prepare
from kit.data.tokenizing import encode_texts, load_tokenizer

TEXTS = ["Hello world.", "天翼云公司英文名。", "<_user>hi<_bot>ok<end>", "", "  spaces  and\nnewlines\n"]


@pytest.fixture
def remote_code_dir(tmp_path):
    """A tokenizer folder whose class lives in its own Python file (as ChatGLM3 / Baichuan2 folders do)."""
    d = tmp_path / "remote_tok"
    d.mkdir()
    shutil.copy(sample_tokenizer_dir() / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "KitDemoTokenizer",
                "auto_map": {"AutoTokenizer": [None, "tokenization_kitdemo.KitDemoTokenizer"]},
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
            }
        )
    )
    (d / "tokenization_kitdemo.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class KitDemoTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    return d


def test_fast_path_equals_hf_call():
    tok = load_tokenizer()
    assert tok.kit_path == str(sample_tokenizer_dir())
    assert encode_texts(tok, TEXTS) == tok(TEXTS, add_special_tokens=False)["input_ids"]


def test_remote_code_needs_opt_in(remote_code_dir, tmp_path):
    with pytest.raises(ValueError, match="set trust_remote_code=True"):
        load_tokenizer(str(remote_code_dir))
    tok = load_tokenizer(str(remote_code_dir), trust_remote_code=True)
    assert type(tok).__name__ == "KitDemoTokenizer"
    res = prepare(
        DataConfig(
            kind="pretrain",
            tokenizer=str(remote_code_dir),
            trust_remote_code=True,
            max_length=32,
            max_records=5,
            out_dir=str(tmp_path / "o"),
        ),
        progress=False,
    )
    ref = load_tokenizer()
    first = IndexedReader(res.megatron_prefix)[0].tolist()
    assert first[-1] == ref.eos_token_id and res.meta["tokenizer"] == str(remote_code_dir)


def test_missing_tokenizer_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


def test_template_warning_for_foreign_markers(tmp_path, remote_code_dir):
    """A tokenizer without the template's role tokens gets a warning, not silence."""
    d = tmp_path / "plain"
    d.mkdir()
    tok_json = json.loads((sample_tokenizer_dir() / "tokenizer.json").read_text())
    tok_json["added_tokens"] = [
        t for t in tok_json["added_tokens"] if t["content"] in ("<s>", "</s>", "<pad>", "<unk>")
    ]
    (d / "tokenizer.json").write_text(json.dumps(tok_json))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"})
    )
    res = prepare(
        DataConfig(
            kind="sft",
            tokenizer=str(d),
            max_length=64,
            max_records=3,
            template="telechat",
            out_dir=str(tmp_path / "o"),
        ),
        progress=False,
    )
    assert any("'<_user>'" in w and "not single tokens" in w for w in res.report.warnings)
