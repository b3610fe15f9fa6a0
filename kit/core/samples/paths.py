"""Where the shipped samples live."""

from __future__ import annotations

from pathlib import Path

from kit.core.workspace import repo_root

DATA_SAMPLES = repo_root() / "data_samples"


def _existing(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"sample file {path} is missing; run `python data_samples/generator` to regenerate "
            f"the samples, or reinstall the kit from a full checkout."
        )
    return path


def sample_tokenizer_dir() -> Path:
    """The small BPE tokenizer folder shipped in data_samples/tokenizer."""
    return _existing(DATA_SAMPLES / "tokenizer")


def pretrain_corpus() -> Path:
    """The mixed Chinese/English pretraining corpus (parquet, column `text`)."""
    return _existing(DATA_SAMPLES / "pretrain_corpus.parquet")


def sft_alpaca() -> Path:
    """The Alpaca-style fine-tuning file (jsonl: instruction / input / output, some with system and history)."""
    return _existing(DATA_SAMPLES / "sft_alpaca.jsonl")


def dpo_pairs() -> Path:
    """The preference-pair file (jsonl, TRL's prompt / chosen / rejected), for DPO."""
    return _existing(DATA_SAMPLES / "dpo_pairs.jsonl")
