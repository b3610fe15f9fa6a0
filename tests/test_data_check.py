"""`data check` looks at everything the manifest describes: every row's lengths and token ids (loading for training
too), each Megatron file's size, hash and counts, and the tokenizer's hash; a damaged part is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kit.__main__ import main
from kit.data import DataConfig, load_prepared, prepare
from kit.data.check import check_prepared
from kit.errors import IntegrityError


@pytest.fixture(scope="module")
def tokenizer_copy(tmp_path_factory) -> Path:
    from kit.core.samples import sample_tokenizer_dir

    dst = tmp_path_factory.mktemp("tok") / "tok"
    shutil.copytree(sample_tokenizer_dir(), dst)
    return dst


def _prepared(tmp_path: Path, kind: str = "pretrain", **kw):
    kw.setdefault("max_records", 40)  # enough rows (pretraining: ~190 of 16 tokens), little time
    cfg = DataConfig(
        kind=kind, max_length=16 if kind == "pretrain" else 128, out_dir=str(tmp_path / kind), **kw
    )
    return prepare(cfg, progress=False)


def _check_line(capsys, hf_dir) -> tuple:
    code = main(["data", "check", str(hf_dir)])
    out, err = capsys.readouterr()
    return code, (out if code == 0 else err).strip().splitlines()[-1]  # after any progress bar


def test_an_intact_folder_passes_with_its_hashes_verified(tmp_path, capsys):
    for kind in ("pretrain", "sft"):
        res = _prepared(tmp_path, kind)
        checks = res.manifest["megatron_checks"]
        assert sorted(checks) == sorted(str(f) for f in res.megatron_files)
        code, line = _check_line(capsys, res.hf_dir)
        assert code == 0, line
        assert line.startswith("ok: ") and "hashes verified" in line and "tokenizer hash matches" in line


def test_an_out_of_range_id_in_a_middle_row_is_found_by_check_and_by_loading(tmp_path, capsys, monkeypatch):
    from datasets import load_from_disk

    res = _prepared(tmp_path)
    vocab = res.prepared.vocab_size
    ds = load_from_disk(str(res.hf_dir))
    row = len(ds) // 2 + 1
    assert row > 1

    def poison(r, i):
        if i == row:
            r["input_ids"] = r["input_ids"][:3] + [vocab + 7] + r["input_ids"][4:]
        return r

    changed = tmp_path / "changed"
    ds.map(poison, with_indices=True).save_to_disk(str(changed))
    del ds
    for f in changed.iterdir():  # the rows only: manifest, config and report stay
        shutil.copy(f, res.hf_dir / f.name)
    with pytest.raises(IntegrityError, match=rf"row {row} has token ids outside 0\.\.{vocab - 1}"):
        load_prepared(res.hf_dir)  # what training calls: it no longer reaches an IndexError at iteration 2
    code, line = _check_line(capsys, res.hf_dir)
    assert code == 2 and line.startswith("error: ") and f"row {row} has token ids" in line
    import kit.data.prepared

    monkeypatch.setattr(kit.data.prepared, "_CHECK_ROWS", 7)  # rows checked a slice at a time: the same row
    with pytest.raises(IntegrityError, match=rf"row {row} has token ids"):
        load_prepared(res.hf_dir)


def test_damaged_megatron_files_are_named(tmp_path, capsys):
    res = _prepared(tmp_path)
    bin_path = next(f for f in res.megatron_files if f.suffix == ".bin")
    data = bytearray(bin_path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit: same size, a valid id still
    bin_path.write_bytes(bytes(data))
    code, line = _check_line(capsys, res.hf_dir)
    assert code == 2 and f"{bin_path} does not match its SHA-256" in line
    bin_path.write_bytes(bytes(data[:-2]))  # one token short
    with pytest.raises(IntegrityError, match="holds .* tokens but the index lists"):
        check_prepared(res.hf_dir)
    # an index swapped in from another run: another document count, named against the manifest
    other = _prepared(tmp_path / "other", input_format="text", max_records=3)
    idx = bin_path.with_suffix(".idx")
    shutil.copy(next(f for f in other.megatron_files if f.suffix == ".idx"), idx)
    shutil.copy(next(f for f in other.megatron_files if f.suffix == ".bin"), bin_path)
    with pytest.raises(IntegrityError, match=rf"{idx} lists 3 documents, the manifest \d+"):
        check_prepared(res.hf_dir)


def test_a_changed_tokenizer_is_named(tmp_path, tokenizer_copy, capsys):
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_copy, tok)
    res = _prepared(tmp_path, tokenizer=str(tok))
    assert _check_line(capsys, res.hf_dir)[0] == 0
    cfg_file = tok / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["model_max_length"] = 12345
    cfg_file.write_text(json.dumps(cfg))
    code, line = _check_line(capsys, res.hf_dir)
    assert code == 2 and f"the tokenizer {tok} changed since the data was made" in line
    shutil.rmtree(tok)
    code, line = _check_line(capsys, res.hf_dir)
    assert code == 2 and f"the tokenizer {tok} the data was made with is gone" in line
