"""Notebook 02 runs headless on tiny parameters and writes what its summary says."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit.core.manifest import read_manifest
from kit.core.samples import sample_tokenizer_dir
from kit.data import IndexedReader, load_prepared, read_prepared

NB = Path(__file__).resolve().parent.parent / "notebooks" / "02_data_prep.ipynb"


@pytest.mark.slow
@pytest.mark.dev_stack  # glue over kit.data, which tests/test_data_*.py cover on every stack
def test_notebook_02_tiny(run_notebook, tmp_path):
    _, summary = run_notebook(
        "02",
        TOKENIZER=str(sample_tokenizer_dir()),
        MAX_LENGTH=64,
        TEMPLATE="telechat",
        WORKSPACE=str(tmp_path / "ws"),
    )
    assert summary is not None
    pre, sft = summary["pretrain"], summary["sft"]
    assert (
        pre["max_length"] == sft["max_length"] == summary["max_length"] == 64
        and sft["template"] == "telechat"
    )
    assert summary["sft_hf"] == sft["hf_dir"] and summary["tokenizer"] == str(sample_tokenizer_dir())
    assert pre["records_read"] == 600 and pre["records_dropped"] == 0 and pre["samples"] > 0
    # the default split: every 10th usable record, 12 of them, kept out of training
    assert pre["heldout_records"] == sft["heldout_records"] == 12
    assert sft["records_read"] == 158 and sft["records_written"] + sft["records_dropped"] + 12 == 158
    assert sft["padding_ratio"] < sft["padding_ratio_unpacked"]
    for part in (pre, sft):  # what the summary names is what the manifest on disk says
        man = read_manifest(part["hf_dir"], expect="prepared-data")
        assert part["manifest_sha256"] == man.sha256 and part["heldout"] == man["heldout"]
        assert len(read_prepared(part["hf_dir"]).heldout_dataset()) == 12
    assert sft["megatron_flags"] == ["--reset-attention-mask", "--neat-pack"] and pre["megatron_flags"] == []
    assert pre["megatron_prefix"].endswith("corpus_text_document") and sft["megatron_prefix"].endswith(
        "/alpaca"
    )
    ds = load_prepared(sft["hf_dir"])
    assert len(ds) == sft["samples"] and len(ds[0]["input_ids"]) == 64
    assert len(IndexedReader(pre["megatron_prefix"])) == 600 - 12
    assert all(Path(p).is_file() for p in pre["megatron_files"] + sft["megatron_files"])
    assert Path(sft["histogram_png"]).stat().st_size > 1000
    assert (
        Path(sft["hf_dir"]).parent
        == tmp_path / "ws" / "processed_for_ma_input" / "demo" / "data" / "finetune"
    )
    # the preference pairs of the shipped sample, one per row, held out as whole pairs, every pair accounted for
    pairs = summary["dpo"]
    assert summary["dpo_hf"] == pairs["hf_dir"] and pairs["template"] == "telechat"
    assert pairs["records_read"] == 56 and pairs["heldout_records"] == 5
    assert pairs["records_written"] + pairs["records_dropped"] + 5 == 56 and pairs["records_written"] > 40
    assert read_manifest(pairs["hf_dir"], expect="prepared-data")["data_kind"] == "dpo"
    assert len(load_prepared(pairs["hf_dir"])) == pairs["samples"] == pairs["records_written"]
