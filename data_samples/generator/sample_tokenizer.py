"""Train the small byte-level BPE tokenizer shipped in `data_samples/tokenizer/` (Chinese + English).

The folder is written in the oldest form every supported transformers reads (4.40 and later): a
`PreTrainedTokenizerFast` config with the chat template inside `tokenizer_config.json`, and BPE merges as
"a b" strings. `save_pretrained` of transformers 5 would write `"tokenizer_class": "TokenizersBackend"` and a
separate `chat_template.jinja` that 4.x does not know, and tokenizers >= 0.20 writes merges as pairs, which
tokenizers 0.19 (the one transformers 4.40-4.44 needs) cannot parse; so the files are written here directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from kit.storage.atomic import atomic_dir

# Role and template tokens of the chat formats the data stage supports, so each renders as one token.
SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<_system>",
    "<_user>",
    "<_bot>",
    "<end>",  # TeleChat-style (the TeleChat NPU adaptation notes)
    "<|im_start|>",
    "<|im_end|>",  # ChatML / Qwen
    "[gMASK]",
    "sop",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",  # ChatGLM3
    "[INST]",
    "[/INST]",
    "<<SYS>>",
    "<</SYS>>",
]  # Llama-2 chat
# ChatML as the tokenizer's own template, so "use the tokenizer's chat_template" has something to use.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# transformers' VERY_LARGE_INTEGER: "no limit" for model_max_length, as its own save_pretrained writes it.
NO_MAX_LENGTH = int(1e30)


def legacy_merges(tokenizer_json: dict) -> dict:
    """`tokenizer.json` with BPE merges as "a b" strings (tokenizers < 0.20 reject the newer [a, b] pairs)."""
    model = tokenizer_json.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or isinstance(merges[0], str):
        return tokenizer_json
    # A space inside a piece would make "a b" ambiguous; byte-level BPE maps spaces to 'Ġ', so none occurs.
    bad = [pair for pair in merges if any(" " in piece for piece in pair)]
    if bad:
        raise ValueError(f"merge pieces contain spaces and cannot be written as 'a b' strings: {bad[:3]}")
    model["merges"] = [" ".join(pair) for pair in merges]
    return tokenizer_json


def tokenizer_config(tokenizer_json: dict) -> dict:
    """The `tokenizer_config.json` transformers 4.40+ and 5.x load as a PreTrainedTokenizerFast."""
    added = {
        str(t["id"]): {
            k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        }
        for t in tokenizer_json["added_tokens"]
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS[4:],
        "bos_token": "<s>",
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        # transformers 4.x gives PreTrainedTokenizerFast token_type_ids too, which Llama generate() rejects
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": NO_MAX_LENGTH,
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }


def sample_texts() -> list:
    """The texts the shipped tokenizer is trained on: the pretraining corpus and the SFT records."""
    from sample_corpus import alpaca_records, pretrain_documents

    texts = [d["text"] for d in pretrain_documents()]
    return texts + [" ".join(str(v) for v in r.values() if isinstance(v, str)) for r in alpaca_records()]


def train_sample_tokenizer(
    texts: Iterable[str], out_dir: str | Path, vocab_size: int = 3000, overwrite: bool = True
) -> Path:
    """Train a byte-level BPE on `texts` and write it as a transformers tokenizer folder (see module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    data = legacy_merges(json.loads(tok.to_str()))

    def dump(obj) -> str:
        return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"

    out = Path(out_dir)
    with atomic_dir(out, overwrite=overwrite, what="sample tokenizer folder") as tmp:
        (tmp / "tokenizer.json").write_text(dump(data), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(dump(tokenizer_config(data)), encoding="utf-8")
        # transformers >= 4.50 also reads (and 5.x prefers) the template from its own file: keep both equal.
        (tmp / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    return out
