"""Train the small byte-level BPE tokenizer shipped in `data_samples/tokenizer/` (Chinese + English)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

# Role and template tokens of the chat formats the data stage supports, so each renders as one token.
SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "<_system>",
    "<_user>",
    "<_bot>",
    "<end>",  # TeleChat-style (seed 000)
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


def train_sample_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 3000) -> Path:
    """Train a byte-level BPE on `texts` and save it as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    fast.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out
