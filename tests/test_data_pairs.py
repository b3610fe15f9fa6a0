"""Preference pairs (kit.data.pairs): the formats users have, one rendering through the SFT templates, and what is
dropped, truncated and held out, counted."""

from __future__ import annotations

import json

import pytest

from kit.core.samples import dpo_pairs, sample_tokenizer_dir
from kit.data import DataConfig, DataInputError, explain_sample, prepare
from kit.data.dialogs import Dialog
from kit.data.sft import encode_dialogs

Q, A, B = "What is 2 + 2?", "2 + 2 = 4.", "2 + 2 = 5."
HISTORY = [["Hello!", "Hi, how can I help?"]]


def _write(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _prepare(tmp_path, records, **kw):
    src = _write(tmp_path / "pairs.jsonl", records)
    kw = {"max_length": 64, "template": "chatml", **kw}
    cfg = DataConfig(kind="dpo", inputs=[str(src)], out_dir=str(tmp_path / "out"), overwrite=True, **kw)
    return prepare(cfg, progress=False)


def _rows(result):
    ds = result.prepared.dataset()
    return [
        tuple(tuple(ds[i][c]) for c in ("prompt_ids", "chosen_ids", "rejected_ids")) for i in range(len(ds))
    ]


def test_every_format_gives_the_same_tokens_for_the_same_pair(tmp_path):
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi, how can I help?"}]
    gpt = [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "Hi, how can I help?"}]
    whole = msgs + [{"role": "user", "content": Q}]
    records = [
        # TRL conversational
        {
            "prompt": whole,
            "chosen": [{"role": "assistant", "content": A}],
            "rejected": [{"role": "assistant", "content": B}],
        },
        # TRL implicit prompt (whole dialogs)
        {
            "chosen": whole + [{"role": "assistant", "content": A}],
            "rejected": whole + [{"role": "assistant", "content": B}],
        },
        # Anthropic HH text
        {
            "chosen": f"\n\nHuman: Hello!\n\nAssistant: Hi, how can I help?\n\nHuman: {Q}\n\nAssistant: {A}",
            "rejected": f"\n\nHuman: Hello!\n\nAssistant: Hi, how can I help?\n\nHuman: {Q}\n\nAssistant: {B}",
        },
        # LLaMA-Factory ranking, alpaca and sharegpt
        {"instruction": Q, "input": "", "history": HISTORY, "chosen": A, "rejected": B},
        {
            "conversations": gpt + [{"from": "human", "value": Q}],
            "chosen": {"from": "gpt", "value": A},
            "rejected": {"from": "gpt", "value": B},
        },
    ]
    result = _prepare(tmp_path, records, heldout_records=0)
    rows = _rows(result)
    assert len(rows) == 5 and len(set(rows)) == 1
    assert result.report.formats == {"alpaca": 1, "hh": 2, "sharegpt": 1, "trl": 1}
    # the prompt and an answer are the ids SFT data of that dialog holds, and only the answer is learned
    dialog = Dialog(None, [tuple(HISTORY[0]), (Q, A)])
    ids, labels = encode_dialogs([dialog], str(sample_tokenizer_dir()), "chatml", mask_history=True)[0]
    prompt, chosen, _ = rows[0]
    assert list(ids) == list(prompt + chosen)
    assert [int(x) for x in labels if x != -100] == list(chosen)
    # TRL's plain-text prompt is one user turn through the same template
    plain = _prepare(tmp_path, [{"prompt": Q, "chosen": A, "rejected": B}])
    ids, _ = encode_dialogs([Dialog(None, [(Q, A)])], str(sample_tokenizer_dir()), "chatml")[0]
    p, c, _ = _rows(plain)[0]
    assert list(ids) == list(p + c)


def test_hostile_pairs_are_refused_or_counted_in_one_line(tmp_path):
    good = {"prompt": Q, "chosen": A, "rejected": B}
    with pytest.raises(DataInputError) as err:
        _prepare(tmp_path, [good, {"prompt": Q, "chosen": A}])
    line = str(err.value)
    assert "\n" not in line and "pairs.jsonl:2" in line and "'rejected'" in line
    result = _prepare(
        tmp_path,
        [
            good,
            {"prompt": Q, "chosen": A},  # missing rejected
            {"prompt": Q, "chosen": A, "rejected": A},  # identical answers
            {"prompt": " ", "chosen": A, "rejected": B},  # empty prompt
            {"prompt": Q, "chosen": "", "rejected": B},  # empty answer
            {"prompt": "word " * 80, "chosen": A, "rejected": B},  # the prompt alone fills max_length
            {"prompt": Q, "chosen": A + " and more" * 40, "rejected": B},  # an answer cut to fit
            {"chosen": "no turns here", "rejected": "nor here"},  # whole "dialogs" without a prompt
        ],
        on_error="skip",
    )
    rep = result.report.as_dict()
    assert rep["dropped"] == {
        "empty_answer": 1,
        "empty_prompt": 1,
        "missing_field": 2,
        "prompt_too_long": 1,
        "same_answers": 1,
    }
    assert rep["records_read"] == 8 and rep["records_written"] == 2 and rep["truncated"] == 1
    assert all("\n" not in p for p in rep["problems"])
    p, c, r = _rows(result)[1]
    assert len(p) + len(c) == 64 and len(p) + len(r) < 64  # the long answer kept its start, cut at max_length
    dropped = _prepare(
        tmp_path, [good, {"prompt": Q, "chosen": A + " and more" * 40, "rejected": B}], overlong="drop"
    )
    assert dropped.report.as_dict()["dropped"] == {"too_long": 1} and dropped.report.truncated == 0


def test_sample_pairs_hold_out_a_split_write_a_manifest_and_explain_a_pair(tmp_path):
    cfg = DataConfig(
        kind="dpo",
        out_dir=str(tmp_path),
        max_length=64,
        template="chatml",
        heldout_records=4,
        heldout_every=5,
    )
    result = prepare(cfg, progress=False)
    p = result.prepared
    n = len(dpo_pairs().read_text(encoding="utf-8").splitlines())
    assert p.kind == "dpo" and p.template == "chatml" and not p.pack
    assert p.megatron_prefix == str(tmp_path / "pairs")
    assert p.heldout["records"] == 4 and len(p.heldout_dataset()) == 4
    assert p.num_samples + 4 == n == result.report.records_read
    train = {tuple(row["chosen_ids"]) + tuple(row["prompt_ids"]) for row in p.dataset()}
    held = {tuple(row["chosen_ids"]) + tuple(row["prompt_ids"]) for row in p.heldout_dataset()}
    assert not train & held
    counts = p.counts
    assert counts["tokens_learned"] == sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in p.dataset())
    table = explain_sample(p.folder, 0)
    row = p.dataset()[0]
    assert list(table.index) == ["prompt", "chosen", "rejected"]
    assert table.loc["prompt", "learned_tokens"] == 0
    assert table.loc["chosen", "learned_tokens"] == len(row["chosen_ids"])
    assert table.loc["prompt", "text"].startswith("<|im_start|>user\n")
    assert table.loc["rejected", "text"].endswith("<|im_end|>\n")
    from kit.data.check import check_prepared

    assert check_prepared(p.folder)["samples"] == p.num_samples


def test_pairs_are_written_as_mindspeed_llm_pairwise_files(tmp_path):
    """02 writes MindSpeed-LLM's four pairwise files (one int32 document per pair, labels -100 on the prompt)."""
    import numpy as np

    from kit.data.indexed import IndexedReader
    from kit.data.prepared import PAIR_MEGATRON_KEYS

    p = prepare(
        DataConfig(kind="dpo", out_dir=str(tmp_path), max_length=64, template="chatml"), progress=False
    )
    prepared = p.prepared
    assert prepared.megatron_flags == ["--prompt-type", "chatml"]
    files = {
        key: IndexedReader(f"{prepared.megatron_prefix}_packed_{key}_document") for key in PAIR_MEGATRON_KEYS
    }
    assert sorted(prepared.megatron_files) == sorted(
        f"{prepared.megatron_prefix}_packed_{k}_document{e}"
        for k in PAIR_MEGATRON_KEYS
        for e in (".bin", ".idx")
    )
    rows = prepared.dataset()
    for key, reader in files.items():
        assert len(reader) == len(rows) == prepared.num_samples, key
        assert reader.dtype == np.int32, key
    for i in (0, len(rows) - 1):
        row = rows[i]
        prompt = [int(t) for t in row["prompt_ids"]]
        for side in ("chosen", "rejected"):
            answer = [int(t) for t in row[f"{side}_ids"]]
            assert files[f"{side}_input_ids"][i].tolist() == prompt + answer
            assert files[f"{side}_labels"][i].tolist() == [-100] * len(prompt) + answer
