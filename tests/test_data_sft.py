"""Fine-tuning data on real templates: -100 exactly on non-answer tokens, whole dialogs packed, files agree."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from kit.core.samples import sample_tokenizer_dir, sft_alpaca
from kit.data import DataConfig, IndexedReader, load_prepared, prepare
from kit.data.dialogs import Dialog
from kit.data.packing import pack_lengths
from kit.data.sft import encode_dialogs

DIALOG = Dialog("SYS", [("Q1", "A1"), ("Q2", "A2")])
# Expected text (full dialog, learned part) per template, written out by hand from each model family's format.
EXPECTED = {
    "telechat": ("<_system>SYS<_user>Q1<_bot>A1<end><_user>Q2<_bot>A2<end>", "A1<end>A2<end>"),
    "chatml": (
        "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
        "A1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n",
        "A1<|im_end|>\nA2<|im_end|>\n",
    ),
    "chatglm3": (
        "[gMASK]sop<|system|>\nSYS<|user|>\nQ1<|assistant|>\nA1<|user|>\nQ2<|assistant|>\nA2</s>",
        "\nA1\nA2</s>",
    ),
    "llama2": (
        "<s>[INST] <<SYS>>\nSYS\n<</SYS>>\n\nQ1 [/INST] A1 </s><s>[INST] Q2 [/INST] A2 </s>",
        " A1 </s> A2 </s>",
    ),
    "baichuan2": ("SYS<reserved_106>Q1<reserved_107>A1<reserved_106>Q2<reserved_107>A2</s>", "A1A2</s>"),
    "llama3": (
        "<s><|start_header_id|>system<|end_header_id|>\n\nSYS<|eot_id|><|start_header_id|>user<|end_header_id|>"
        "\n\nQ1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|><|start_header_id|>user"
        "<|end_header_id|>\n\nQ2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA2<|eot_id|>",
        "A1<|eot_id|>A2<|eot_id|>",
    ),
    "alpaca": (
        "SYS\n\n### Instruction:\nQ1\n\n### Response:\nA1</s>\n\n### Instruction:\nQ2\n\n### Response:\nA2</s>",
        "A1</s>A2</s>",
    ),
}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(sample_tokenizer_dir()))


def _learned(ids, labels):
    return [int(i) for i, lab in zip(ids, labels) if lab != -100]


@pytest.mark.parametrize("template", sorted(EXPECTED))
def test_template_text_and_mask(tok, template):
    full, answers = EXPECTED[template]
    ids, labels = encode_dialogs([DIALOG], template=template)[0]
    assert tok.decode(ids) == full
    assert tok.decode(_learned(ids, labels)) == answers
    # learned labels are the token itself (unshifted) and -100 elsewhere, nothing else
    assert set(np.unique(labels[labels != ids])) <= {-100}


def test_telechat_mask_positions_exact(tok):
    """The TeleChat adaptation notes' example: -100 on `<_user>question<_bot>`, the answer and `<end>` learned."""
    d = Dialog(None, [("天翼云公司英文名。", "state cloud.")])
    ids, labels = encode_dialogs([d], template="telechat")[0]
    prompt = tok("<_user>天翼云公司英文名。<_bot>", add_special_tokens=False)["input_ids"]
    answer = tok("state cloud.<end>", add_special_tokens=False)["input_ids"]
    assert ids.tolist() == prompt + answer
    assert labels.tolist() == [-100] * len(prompt) + answer


def test_tokenizer_chat_template_matches_chatml(tok):
    """The sample tokenizer's own chat_template is ChatML: both paths give identical ids and labels."""
    for d in (DIALOG, Dialog(None, [("hi", "yo")])):
        a = encode_dialogs([d], template="tokenizer")[0]
        b = encode_dialogs([d], template="chatml")[0]
        assert a[0].tolist() == b[0].tolist() and a[1].tolist() == b[1].tolist()


def test_mask_history_and_train_on_prompt(tok):
    ids, labels = encode_dialogs([DIALOG], template="telechat", mask_history=True)[0]
    assert tok.decode(_learned(ids, labels)) == "A2<end>"
    ids, labels = encode_dialogs([DIALOG], template="telechat", train_on_prompt=True)[0]
    assert labels.tolist() == ids.tolist()


def test_default_system_of_template(tok):
    ids, _ = encode_dialogs([Dialog(None, [("q", "a")])], template="qwen")[0]
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    ids, _ = encode_dialogs([Dialog(None, [("q", "a")])], template="qwen", system="Be brief.")[0]
    assert "Be brief." in tok.decode(ids)


def test_pack_lengths_properties():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 64, size=500).tolist()
    bins = pack_lengths(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))  # every item exactly once
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert bins == pack_lengths(lengths, 64)  # deterministic
    # no worse than first-fit in arrival order
    ff: list = []
    for n in lengths:
        for b in ff:
            if b[0] + n <= 64:
                b[0] += n
                break
        else:
            ff.append([n])
    assert len(bins) <= len(ff)
    assert len(bins) >= -(-sum(lengths) // 64)
    with pytest.raises(ValueError, match="outside"):
        pack_lengths([65], 64)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    cfg = DataConfig(kind="sft", name="alpaca", max_length=64, out_dir=str(out), template="telechat")
    return prepare(cfg, progress=False)


def _sample_dialogs():
    from kit.data.dialogs import DEFAULT_COLUMNS, alpaca_dialog
    from kit.data.readers import iter_records

    return [alpaca_dialog(r, DEFAULT_COLUMNS["alpaca"]) for r in iter_records([str(sft_alpaca())])]


def test_packed_rows_hold_whole_dialogs(packed):
    ds = load_prepared(packed.hf_dir)
    L = 64
    segments = Counter()
    for row in ds:
        ids, labels = np.array(row["input_ids"]), np.array(row["labels"])
        att, pos, lens = np.array(row["attention_mask"]), np.array(row["position_ids"]), row["seq_lens"]
        n = sum(lens)
        assert len(ids) == L and n <= L and all(x > 0 for x in lens)
        assert att.tolist() == [1] * n + [0] * (L - n)
        assert pos.tolist() == [p for m in lens for p in range(m)] + [0] * (L - n)
        assert (labels[n:] == -100).all() and (ids[n:] == packed.meta["pad_token_id"]).all()
        at = 0
        for m in lens:
            segments[(tuple(ids[at : at + m]), tuple(labels[at : at + m]))] += 1
            at += m
    # every dialog of the input appears exactly once, unsplit (truncated ones cut at max_length)
    expected = Counter()
    for ids, labels in encode_dialogs(_sample_dialogs(), template="telechat"):
        expected[(tuple(ids[:L]), tuple(labels[:L]))] += 1
    assert segments == expected
    rep = packed.report
    assert rep.records_read == rep.records_written == 158 and rep.records_dropped == 0
    assert rep.padding_ratio < rep.padding_ratio_unpacked
    assert rep.tokens_out == sum(len(k[0]) * v for k, v in expected.items())


def test_mindspeed_files_agree(packed):
    ds = load_prepared(packed.hf_dir)
    prefix = packed.megatron_prefix
    r = {k: IndexedReader(f"{prefix}_packed_{k}_document") for k in ("input_ids", "attention_mask", "labels")}
    assert {len(x) for x in r.values()} == {len(ds)}
    for k, x in r.items():
        assert x.dtype == np.int32 and (x.lengths == 64).all() and x.num_documents == len(ds), k
    for i, row in enumerate(ds):
        assert r["input_ids"][i].tolist() == row["input_ids"]
        assert r["labels"][i].tolist() == row["labels"]
        seg = [s for s, m in enumerate(row["seq_lens"], 1) for _ in range(m)]
        assert r["attention_mask"][i].tolist() == seg + [0] * (64 - len(seg))
    mcore = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset",
        reason="megatron-core needs Python >= 3.10 and torch >= 2.6 (not in the compat stacks)",
    )
    lab = mcore.IndexedDataset(f"{prefix}_packed_labels_document")
    assert len(lab) == len(ds) and lab[0].tolist() == ds[0]["labels"]


def test_manifest_and_report_files(packed):
    meta = json.loads((packed.hf_dir / "kit_manifest.json").read_text())["fields"]
    assert not (packed.hf_dir / "meta.json").exists()  # the manifest replaced it
    assert meta["data_kind"] == "sft" and meta["max_length"] == 64 and meta["vocab_size"] == 2522
    assert (
        meta["pad_token_id"] == 3
        and meta["eos_token_id"] == 2
        and meta["num_samples"] == packed.report.samples
    )
    cfg = json.loads((packed.hf_dir / "config.json").read_text())
    assert cfg["template"] == "telechat" and cfg["max_length"] == 64
    rep = json.loads((packed.hf_dir / "report.json").read_text())
    assert sum(rep["length_histogram"].values()) == 158
    assert not (packed.hf_dir / "lengths.png").exists()  # plotting is a separate, optional step
    assert packed.plot_lengths() == packed.hf_dir / "lengths.png"
    assert (packed.hf_dir / "lengths.png").stat().st_size > 1000
    assert packed.summary()["histogram_png"] == str(packed.hf_dir / "lengths.png")


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overlong_policy_counted(tmp_path, policy):
    lengths = [ids.size for ids, _ in encode_dialogs(_sample_dialogs(), template="telechat")]
    L = 24
    over = sum(n > L for n in lengths)
    assert over > 0
    res = prepare(
        DataConfig(kind="sft", max_length=L, out_dir=str(tmp_path), overlong=policy, template="telechat"),
        progress=False,
    )
    rep = res.report
    if policy == "drop":
        assert rep.dropped == {"too_long": over} and rep.records_written == 158 - over and rep.truncated == 0
    else:
        assert rep.truncated + rep.dropped.get("too_long", 0) == over
        assert rep.records_written == 158 - rep.dropped.get("too_long", 0)
    for row in load_prepared(res.hf_dir):
        assert any(x != -100 for x in row["labels"])


def test_unpacked_one_dialog_per_row(tmp_path):
    res = prepare(DataConfig(kind="sft", max_length=64, out_dir=str(tmp_path), pack=False), progress=False)
    ds = load_prepared(res.hf_dir)
    assert len(ds) == 158 and all(len(r["seq_lens"]) == 1 for r in ds)
    assert res.report.padding_ratio == pytest.approx(res.report.padding_ratio_unpacked)


def test_explain_sample_separates_learned_text(packed):
    from kit.data.explain import explain_sample

    table = explain_sample(packed.hf_dir, 0)
    row = load_prepared(packed.hf_dir)[0]
    assert list(table["tokens"])[:-1] == row["seq_lens"] and table.loc["padding", "tokens"] == 64 - sum(
        row["seq_lens"]
    )
    assert all(t.endswith("<end>") for t in table["learned (loss)"].tolist()[:-1])
    assert all(
        c.startswith(("<_user>", "<_system>")) and c.endswith("<_bot>")
        for c in table["context (no loss)"].tolist()[:-1]
    )
    with pytest.raises(IndexError, match="does not exist"):
        explain_sample(packed.hf_dir, 10_000)
