"""The data stage's handover: the prepared-data manifest, the held-out split, the typed loader and the generated CLI."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from kit.__main__ import main
from kit.core.manifest import KINDS, PREPARED_DATA, read_manifest, tokenizer_sha256, write_manifest
from kit.core.samples import sample_tokenizer_dir, sft_alpaca
from kit.data import DataConfig, IndexedReader, load_prepared, prepare, read_prepared
from kit.data.dialogs import Dialog
from kit.data.prepared import MODEL_INPUTS
from kit.data.sft import encode_dialogs
from kit.errors import InputError

PACKED_FLAGS = ["--reset-attention-mask", "--neat-pack"]


def _prep(out, kind="sft", **kw):
    return prepare(
        DataConfig(kind=kind, out_dir=str(out), max_length=kw.pop("max_length", 64), **kw), progress=False
    )


@pytest.fixture(scope="module")
def sft_held(tmp_path_factory):
    """The sample dialogs, 64 tokens, every 10th usable dialog held out (at most 12)."""
    return _prep(tmp_path_factory.mktemp("sft"), heldout_records=12)


def _segments(ds):
    """Each packed dialog of each row as a tuple of token ids (rows split by seq_lens)."""
    out = []
    for row in ds:
        at = 0
        for n in row["seq_lens"]:
            out.append(tuple(row["input_ids"][at : at + n]))
            at += n
    return out


def test_sft_manifest_fields(sft_held):
    res = sft_held
    man = read_manifest(res.hf_dir, expect=PREPARED_DATA)
    assert set(KINDS[PREPARED_DATA][1]) <= set(man.fields)
    out = res.hf_dir.parent
    tok = sample_tokenizer_dir()
    assert man["data_kind"] == "sft" and man["max_length"] == 64
    assert man["tokenizer"] == str(tok) and man["tokenizer_sha256"] == tokenizer_sha256(tok)
    assert man["template"] == "tokenizer" and man["pack"] is True
    assert (man["eos_token_id"], man["pad_token_id"], man["vocab_size"]) == (2, 3, 2522)
    assert man["hf_path"] == str(res.hf_dir) == str(out / "alpaca_hf")
    # MindSpeed-LLM's --data-path for packed SFT is the bare prefix; it appends _packed_<key>_document itself
    assert man["megatron_prefix"] == str(out / "alpaca")
    assert man["megatron_flags"] == PACKED_FLAGS
    assert sorted(man["megatron_files"]) == sorted(
        str(out / f"alpaca_packed_{k}_document.{e}")
        for k in ("input_ids", "attention_mask", "labels")
        for e in ("bin", "idx")
    )
    assert all(Path(f).is_file() for f in man["megatron_files"])
    rep = res.report.as_dict()
    assert man["counts"]["records_read"] == 158 == rep["records_read"]
    assert man["counts"]["samples"] == man["num_samples"] == len(load_prepared(res.hf_dir))
    assert man["counts"]["heldout_records"] == 12
    assert man["heldout"]["path"] == str(out / "alpaca_heldout_hf") and man["heldout"]["records"] == 12
    assert "every 10th usable dialog" in man["heldout"]["rule"]
    assert man.inputs == [] and man["inputs"] == [str(sft_alpaca())]
    # the summary the notebook writes carries the manifest's path and hash
    s = res.summary()
    assert (
        s["manifest_sha256"] == man.sha256
        and s["megatron_flags"] == PACKED_FLAGS
        and s["heldout"] == man["heldout"]
    )


def test_pretrain_manifest_names_the_full_text_document_prefix(tmp_path):
    res = _prep(tmp_path, "pretrain", name="wiki", max_records=30, max_length=32)
    man = read_manifest(res.hf_dir, expect=PREPARED_DATA)
    assert man["data_kind"] == "pretrain" and man["template"] is None and man["pack"] is True
    assert man["megatron_prefix"] == str(tmp_path / "wiki_text_document") and man["megatron_flags"] == []
    assert man["megatron_dtype"] == "uint16" and man["heldout"] is None
    assert len(IndexedReader(man["megatron_prefix"])) == 30
    assert not (tmp_path / "wiki_heldout_hf").exists()


def test_unpacked_sft_and_no_megatron_files_need_no_flags(tmp_path):
    unpacked = read_manifest(_prep(tmp_path / "a", pack=False, max_records=10).hf_dir)
    assert unpacked["pack"] is False and unpacked["megatron_flags"] == []
    assert unpacked["megatron_prefix"] == str(tmp_path / "a" / "alpaca")
    none = read_manifest(_prep(tmp_path / "b", megatron=False, max_records=10).hf_dir)
    assert none["megatron_prefix"] is None and none["megatron_files"] == [] and none["megatron_flags"] == []


def test_heldout_is_every_10th_dialog_and_never_trained_on(sft_held):
    """Held-out rows are exactly dialogs 10, 20, ... 120 of the sample, one per row; none is in the training rows."""
    prepared = read_prepared(sft_held.hf_dir)
    held = prepared.heldout_dataset()
    assert len(held) == 12 and held.column_names == list(MODEL_INPUTS) + ["seq_lens"]
    # what prepare encodes for each sample dialog, in input order (all 158 are usable)
    from kit.data.dialogs import DEFAULT_COLUMNS, alpaca_dialog
    from kit.data.readers import iter_records

    dialogs = [alpaca_dialog(r, DEFAULT_COLUMNS["alpaca"]) for r in iter_records([str(sft_alpaca())])]
    encoded = encode_dialogs(dialogs, str(sample_tokenizer_dir()), template=prepared.template)
    expected = [encoded[i] for i in range(9, 120, 10)]
    for row, (ids, labels) in zip(held, expected):
        n = min(ids.size, 64)
        assert row["seq_lens"] == [n]
        assert row["input_ids"][:n] == ids[:n].tolist() and row["labels"][:n] == labels[:n].tolist()
        assert row["attention_mask"] == [1] * n + [0] * (64 - n)
        assert row["position_ids"][:n] == list(range(n)) and set(row["labels"][n:]) <= {-100}
    # by content: no held-out dialog is among the training dialogs, and every other dialog is
    trained = _segments(load_prepared(sft_held.hf_dir))
    held_ids = {tuple(r["input_ids"][: r["seq_lens"][0]]) for r in held}
    assert not held_ids & set(trained)
    rep = sft_held.report
    assert len(trained) == rep.records_written == 158 - 12 and rep.records_dropped == 0


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_heldout_copies_are_never_trained_on(tmp_path):
    """A due record already trained on is passed over; later copies of a held-out record are dropped, counted."""
    a, b, c, d = ({"instruction": f"question {x}", "output": f"answer {x}"} for x in "abcd")
    src = _jsonl(tmp_path / "dup.jsonl", [a, b, a, c, d, c])
    res = _prep(tmp_path / "o", inputs=[str(src)], heldout_records=1, heldout_every=3, template="chatml")
    rep = res.report
    # record 3 (a copy of a, trained on) is due but passed over; record 4 (c) is held out; record 6 (c again) dropped
    assert (rep.records_read, rep.records_written, rep.heldout) == (6, 4, 1)
    assert rep.dropped == {"same_as_heldout": 1}
    held = read_prepared(res.hf_dir).heldout_dataset()
    tok_c = encode_dialogs([Dialog(turns=[("question c", "answer c")])], template="chatml")[0][0].tolist()
    assert held[0]["input_ids"][: held[0]["seq_lens"][0]] == tok_c
    assert tuple(tok_c) not in set(_segments(load_prepared(res.hf_dir)))


def test_pretrain_heldout_documents_are_not_in_the_training_files(tmp_path):
    res = _prep(tmp_path, "pretrain", max_records=100, heldout_records=5, heldout_every=7, max_length=32)
    prepared = read_prepared(res.hf_dir)
    held = prepared.heldout_dataset()
    assert prepared.heldout["records"] == len(held) == 5 and res.report.records_written == 95
    mg = IndexedReader(prepared.megatron_prefix)
    trained = {tuple(mg[i].tolist()) for i in range(len(mg))}
    assert len(mg) == 95
    for row in held:
        n = row["seq_lens"][0]
        doc = tuple(row["input_ids"][:n])
        assert row["labels"][:n] == list(doc)  # pretraining learns every token
        assert not any(t[:n] == doc for t in trained)


def test_too_few_records_for_the_split_is_a_warning(tmp_path):
    res = _prep(tmp_path, max_records=15, heldout_records=4)
    assert res.report.heldout == 1 and read_prepared(res.hf_dir).heldout["records"] == 1
    assert any("only 1 of the usable records" in w for w in res.report.warnings)
    # nothing held out at all: no split, and a stale split of the same name is removed on overwrite
    again = _prep(tmp_path, max_records=5, heldout_records=4, overwrite=True)
    assert again.prepared.heldout is None and not (tmp_path / "alpaca_heldout_hf").exists()


def _digests(folder):
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_heldout_split_byte_identical_whatever_the_worker_count(tmp_path):
    x = _prep(tmp_path, heldout_records=8, heldout_every=5, num_workers=1, batch_size=7)
    dx = _digests(tmp_path)
    y = _prep(tmp_path, heldout_records=8, heldout_every=5, num_workers=2, batch_size=20, overwrite=True)
    dy = _digests(tmp_path)
    # config.json records num_workers and batch_size; the manifest its creation time; all else is byte for byte
    changed = {k for k in dx if dx[k] != dy[k]} - {"alpaca_hf/kit_manifest.json"}
    assert set(dx) == set(dy) and changed == {"alpaca_hf/config.json"}
    assert "alpaca_heldout_hf/data-00000-of-00001.arrow" in dx
    assert x.manifest.fields == y.manifest.fields


def test_wrong_kind_missing_and_old_folders_name_notebook_02(tmp_path):
    plain = tmp_path / "plain_hf"
    plain.mkdir()
    with pytest.raises(
        InputError, match=r"has no kit_manifest.json.*expected a prepared-data folder \(made by notebook 02"
    ):
        load_prepared(plain)
    other = tmp_path / "ckpt"
    other.mkdir()
    write_manifest(other, "hf-model", {"family": "llama2", "source": None})
    with pytest.raises(
        InputError, match=r"is a hf-model folder .*; expected a prepared-data folder \(made by notebook 02"
    ):
        read_prepared(other)
    old = tmp_path / "old_hf"
    old.mkdir()
    (old / "meta.json").write_text('{"kind": "sft"}')
    with pytest.raises(InputError, match="prepared before the kit wrote manifests.*notebook 02"):
        load_prepared(old)
    with pytest.raises(FileNotFoundError, match="does not exist; expected a prepared-data folder"):
        load_prepared(tmp_path / "nothing_here")


def test_read_prepared_types_and_prefix_lookup(tmp_path):
    res = _prep(tmp_path, "pretrain", name="c", max_records=20, max_length=48)
    for path in (res.hf_dir, tmp_path / "c", tmp_path / "c_text_document"):
        p = read_prepared(path)
        assert (p.kind, p.max_length, p.pack, p.template, p.num_samples) == (
            "pretrain",
            48,
            True,
            None,
            len(p.dataset()),
        )
    # the names meta.json used still answer (for callers written before the manifest)
    assert p.get("kind") == "pretrain" and p["packed"] is True and p["max_length"] == 48


def test_cli_options_come_from_the_config(tmp_path, capsys):
    from kit.core.configs import field_docs

    docs = field_docs(DataConfig)
    with pytest.raises(SystemExit):
        main(["data", "sft", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("heldout_records", "heldout_every", "template", "pack", "max_length", "name"):
        assert "--" + name.replace("_", "-") in text and docs[name] in text, name
    with pytest.raises(SystemExit):
        main(["data", "pretrain", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--keep-special-tokens" in text and "--template" not in text and "--pack-window" not in text
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
                "--heldout-records",
                "3",
                "--no-pack",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["heldout"]["records"] == 3 and summary["pack"] is False and summary["megatron_flags"] == []
    cfg = json.loads((out / "alpaca_hf" / "config.json").read_text())
    assert (cfg["name"], cfg["template"], cfg["heldout_every"]) == ("alpaca", "tokenizer", 10)
    assert main(["data", "check", str(out / "alpaca_hf")]) == 0
    assert re.search(r"held out: 3 rows in .*alpaca_heldout_hf", capsys.readouterr().out)


def test_heldout_config_problems():
    problems = DataConfig(heldout_records=-1, heldout_every=0).problems()
    assert any(p.startswith("heldout_records=-1") for p in problems)
    assert any(p.startswith("heldout_every=0") for p in problems)
