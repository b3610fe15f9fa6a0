"""Pretraining data: EOS per document, concatenated, max_length rows; Megatron documents; deterministic output."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd
import pytest

from kit.core.samples import pretrain_corpus, sample_tokenizer_dir
from kit.data import DataConfig, IndexedReader, load_prepared, prepare, read_meta
from kit.data.readers import DataInputError


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(sample_tokenizer_dir()))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 120 documents of the sample corpus plus an empty one (dropped and counted)."""
    df = pd.read_parquet(pretrain_corpus()).head(120)
    df = pd.concat([df, pd.DataFrame({"text": ["   "]})], ignore_index=True)[["text"]]
    path = tmp_path_factory.mktemp("corpus") / "c.parquet"
    df.to_parquet(path)
    return path, df["text"].tolist()


def _run(out, corpus_path, **kw):
    cfg = DataConfig(
        kind="pretrain",
        inputs=[str(corpus_path)],
        name="c",
        max_length=kw.pop("max_length", 48),
        out_dir=str(out),
        **kw,
    )
    return prepare(cfg, progress=False)


def test_rows_are_the_concatenated_documents(tmp_path, corpus, tok):
    path, texts = corpus
    res = _run(tmp_path, path, batch_size=16)
    docs = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts if t.strip()]
    stream = np.concatenate(docs)
    ds = load_prepared(res.hf_dir)
    L = 48
    rows = np.array(ds["input_ids"])
    assert rows.shape == (stream.size // L, L)
    np.testing.assert_array_equal(rows.reshape(-1), stream[: rows.size])
    np.testing.assert_array_equal(np.array(ds["labels"]), rows)
    assert (np.array(ds["attention_mask"]) == 1).all()
    assert (np.array(ds["position_ids"]) == np.arange(L)).all()
    rep = res.report
    assert rep.records_read == 121 and rep.records_written == 120 and rep.dropped == {"empty_text": 1}
    assert rep.tokens_in == stream.size and rep.remainder_tokens == stream.size - rows.size
    assert rep.samples == len(ds) == res.meta["num_samples"]
    # Megatron: one document per input document, EOS-terminated, uint16 for this vocabulary
    mg = IndexedReader(res.megatron_prefix)
    assert mg.dtype == np.uint16 and mg.num_documents == len(docs)
    for i in (0, 57, len(docs) - 1):
        assert mg[i].tolist() == docs[i]


def test_megatron_core_reads_pretrain_files(tmp_path, corpus):
    mcore = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset",
        reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)",
    )
    path, _ = corpus
    res = _run(tmp_path, path)
    ds = mcore.IndexedDataset(res.megatron_prefix)
    ours = IndexedReader(res.megatron_prefix)
    assert len(ds) == len(ours)
    for i in range(len(ds)):
        assert ds[i].tolist() == ours[i].tolist()


@pytest.mark.slow
def test_megatron_gpt_dataset_samples_from_kit_documents(tmp_path, corpus):
    """megatron-core's own GPTDataset builder samples training windows out of the kit's documents intact."""
    pytest.importorskip(
        "megatron.core.datasets.gpt_dataset",
        reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)",
    )
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    path, _ = corpus
    res = _run(tmp_path, path, max_records=40)

    class SampleTokenizer:  # the attributes GPTDataset reads from a Megatron tokenizer
        eod, pad, bos, vocab_size = 2, 3, 1, 2522
        unique_identifiers = {"class": "kit-sample-tokenizer"}

    cfg = GPTDatasetConfig(
        random_seed=1,
        sequence_length=32,
        blend=([res.megatron_prefix], None),
        split="100,0,0",
        path_to_cache=str(tmp_path / "cache"),
        tokenizer=SampleTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [16, None, None], lambda: True, cfg).build()
    docs = [tuple(d.tolist()) for d in IndexedReader(res.megatron_prefix)]
    bodies = {d[:-1] for d in docs}
    for i in range(16):
        s = train[i]
        window = s["tokens"].tolist() + s["labels"].tolist()[-1:]
        assert s["labels"].tolist()[:-1] == s["tokens"].tolist()[1:]
        pieces, cur = [], []
        for t in window:  # split at EOS (id 2)
            if t == 2:
                pieces.append(tuple(cur))
                cur = []
            else:
                cur.append(t)
        pieces.append(tuple(cur))
        if len(pieces) == 1:  # the window lies inside one document
            inner = " " + " ".join(map(str, pieces[0])) + " "
            assert any(inner in " " + " ".join(map(str, b)) + " " for b in bodies)
            continue
        first, *middle, last = pieces
        assert any(b[len(b) - len(first) :] == first for b in bodies)  # the end of a document
        assert all(m in bodies for m in middle)  # whole documents
        assert any(b[: len(last)] == last for b in bodies)  # the start of a document


def test_bos_option(tmp_path, corpus, tok):
    path, texts = corpus
    res = _run(tmp_path, path, add_bos=True, max_records=3)
    mg = IndexedReader(res.megatron_prefix)
    first = [tok.bos_token_id] + tok(texts[0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert mg[0].tolist() == first


def _digests(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_byte_identical_whatever_the_worker_count_and_batch_size(tmp_path, corpus):
    path, _ = corpus
    a = _run(tmp_path, path, num_workers=1, batch_size=7)
    da = _digests(tmp_path)
    b = _run(tmp_path, path, num_workers=2, batch_size=13, overwrite=True)
    db = _digests(tmp_path)
    # config.json records num_workers, batch_size and overwrite themselves, the manifest its creation time; every
    # other file matches byte for byte, and so do the manifest's fields
    changed = {k for k in da if da[k] != db[k]} - {
        "c_hf/kit_manifest.json"
    }  # its time may be the same second
    assert set(da) == set(db) and changed == {"c_hf/config.json"}
    assert a.manifest.fields == b.manifest.fields
    assert a.report.as_dict() == b.report.as_dict()
    out = tmp_path / "sft"
    x = prepare(
        DataConfig(kind="sft", max_length=64, out_dir=str(out), num_workers=1, batch_size=9), progress=False
    )
    dx = _digests(out)
    y = prepare(
        DataConfig(kind="sft", max_length=64, out_dir=str(out), num_workers=2, batch_size=20, overwrite=True),
        progress=False,
    )
    dy = _digests(out)
    changed = {k for k in dx if dx[k] != dy[k]} - {"alpaca_hf/kit_manifest.json"}
    assert set(dx) == set(dy) and changed == {"alpaca_hf/config.json"}
    assert x.manifest.fields == y.manifest.fields
    assert x.report.samples == y.report.samples


def test_text_files_and_column_mapping(tmp_path, tok):
    (tmp_path / "d.txt").write_text("first line\nsecond line\n", encoding="utf-8")
    (tmp_path / "e.jsonl").write_text(json.dumps({"body": "third"}) + "\n", encoding="utf-8")
    r1 = prepare(
        DataConfig(
            kind="pretrain", inputs=[str(tmp_path / "d.txt")], max_length=8, out_dir=str(tmp_path / "o1")
        ),
        progress=False,
    )
    assert IndexedReader(r1.megatron_prefix)[1].tolist() == tok("second line", add_special_tokens=False)[
        "input_ids"
    ] + [tok.eos_token_id]
    with pytest.raises(DataInputError, match="no sample: 5 tokens in 1 records"):  # mapped, read, too short
        prepare(
            DataConfig(
                kind="pretrain",
                inputs=[str(tmp_path / "e.jsonl")],
                max_length=8,
                columns={"text": "body"},
                out_dir=str(tmp_path / "o2"),
            ),
            progress=False,
        )


def test_load_prepared_rejects_damaged_folders(tmp_path, corpus):
    path, _ = corpus
    res = _run(tmp_path, path, max_records=20)
    assert read_meta(res.hf_dir)["data_kind"] == "pretrain"
    assert len(load_prepared(str(tmp_path / "c"))) == res.report.samples  # the bare prefix works too
    ds, prepared = load_prepared(res.hf_dir, return_meta=True)
    assert prepared.max_length == 48 and len(ds) == prepared.num_samples
    manifest = res.hf_dir / "kit_manifest.json"
    record = json.loads(manifest.read_text())
    record["fields"]["num_samples"] += 1
    manifest.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="rows but the manifest says"):
        load_prepared(res.hf_dir)
    record["fields"]["num_samples"] -= 1
    record["fields"]["vocab_size"] = 10  # the rows hold ids this vocabulary does not have
    manifest.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"token ids outside 0..9"):
        load_prepared(res.hf_dir)
    with pytest.raises(FileNotFoundError, match="does not exist; expected a prepared-data folder"):
        load_prepared(tmp_path / "nothing_here")


def test_arrow_sink_bytes_independent_of_write_sizes(tmp_path):
    from datasets import load_from_disk

    from kit.data.hf_rows import ArrowSink

    rng = np.random.default_rng(0)
    rows = {
        c: rng.integers(0, 100, size=(8, 6)).astype(np.int32)
        for c in ("input_ids", "labels", "attention_mask", "position_ids")
    }
    lens = [[6], [2, 4], [1, 2, 3], [6], [3, 3], [5], [6], [1, 1, 4]]
    digests = []
    for i, sizes in enumerate(([8], [2, 5, 1], [1] * 8)):
        folder = tmp_path / f"s{i}"
        folder.mkdir()
        sink = ArrowSink(folder, "sft", 6, rows_per_batch=3)
        at = 0
        for n in sizes:
            sink.write({c: a[at : at + n] for c, a in rows.items()}, lens[at : at + n])
            at += n
        assert sink.finalize({"x": 1}) == 8
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()})
        ds = load_from_disk(str(folder))
        assert ds["seq_lens"] == lens and np.array(ds["labels"]).tolist() == rows["labels"].tolist()
    assert digests[0] == digests[1] == digests[2]
