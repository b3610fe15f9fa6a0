"""Embedded defaults: shipped sample data and tokenizer, tiny seeded HF checkpoints, the SmolLM2 demo model."""

from kit.core.samples.models import tiny_llama
from kit.core.samples.paths import DATA_SAMPLES, dpo_pairs, pretrain_corpus, sample_tokenizer_dir, sft_alpaca
from kit.core.samples.smollm2 import demo_model_dir

__all__ = [
    "DATA_SAMPLES",
    "demo_model_dir",
    "dpo_pairs",
    "pretrain_corpus",
    "sample_tokenizer_dir",
    "sft_alpaca",
    "tiny_llama",
]
