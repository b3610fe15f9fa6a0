"""Tiny seeded HF checkpoints in the exact on-disk layout of real ones (the demo model: kit.core.samples.smollm2)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional, Union

from kit.storage.atomic import atomic_dir

PathLike = Union[str, Path]


def tiny_llama(
    out_dir: PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: Optional[int] = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    seed: int = 0,
    max_shard_size: str = "100KB",
    tokenizer_dir: Optional[PathLike] = None,
    overwrite: bool = False,
) -> Path:
    """Write a seeded random LlamaForCausalLM (GQA when num_kv_heads < num_heads) as a sharded HF folder.

    The folder holds `model-0000x-of-0000N.safetensors`, `model.safetensors.index.json`, `config.json`,
    `generation_config.json` and the sample tokenizer's files, like a checkpoint downloaded from a hub.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kit.core.samples.paths import sample_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir or sample_tokenizer_dir()))
    config = LlamaConfig(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # HF initialises norms to 1; perturb them so tests notice a norm weight mapped to the wrong place.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    with atomic_dir(out_dir, overwrite=overwrite, what="tiny checkpoint folder") as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        # Copy the tokenizer's files rather than `tok.save_pretrained`: transformers 5 would rewrite them in a
        # form transformers 4.x cannot load (see data_samples/generator/sample_tokenizer.py).
        src = Path(tokenizer_dir or sample_tokenizer_dir())
        for f in sorted(src.iterdir()):
            if f.is_file() and (
                f.name.startswith(("tokenizer", "special_tokens")) or f.name.endswith(".jinja")
            ):
                shutil.copy2(f, tmp / f.name)
    return Path(out_dir)
