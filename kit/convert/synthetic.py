"""Seeded random HF checkpoints of any family, written straight from the key map (no remote code needed).

Used for the ChatGLM3- and Baichuan2-shaped test models and for the benchmark's large synthetic models: the
config.json uses each family's real field names and the tensors the real key names and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from kit.atomic import atomic_dir
from kit.convert.checks import expected_hf_shapes
from kit.convert.families import FAMILIES
from kit.convert.hf_io import HFWriter, copy_side_files

PathLike = Union[str, Path]


def family_config(
    family: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_groups: int,
    ffn_hidden_size: int,
    vocab_size: int,
    tie: bool = False,
    qkv_bias: Optional[bool] = None,
    dtype: str = "float32",
    num_experts: int = 0,
    moe_ffn_hidden_size: int = 0,
) -> dict:
    """A config.json dict in the family's own vocabulary (Llama / Qwen3-MoE / ChatGLM3 / Baichuan2 field names)."""
    if (
        family == "qwen3_moe"
    ):  # every layer a MoE block of num_experts, top-2, normalised (Qwen3-30B-A3B's kind)
        cfg = family_config(
            "llama", hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_groups=num_groups,
            ffn_hidden_size=ffn_hidden_size, vocab_size=vocab_size, tie=tie, dtype=dtype,
        )  # fmt: skip
        cfg.update(
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            head_dim=hidden_size // num_heads,
            num_experts=num_experts,
            num_experts_per_tok=2,
            moe_intermediate_size=moe_ffn_hidden_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
        )
        return cfg
    if family == "llama":
        # q/k/v biases make it a Qwen2: a Llama's attention_bias puts a bias on o_proj too, which Megatron has not
        return {
            "model_type": "qwen2" if qkv_bias else "llama",
            "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
            "hidden_size": hidden_size,
            "intermediate_size": ffn_hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_groups,
            "vocab_size": vocab_size,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
            "tie_word_embeddings": tie,
            "hidden_act": "silu",
            "torch_dtype": dtype,
        }
    if family == "chatglm":
        return {
            "model_type": "chatglm",
            "architectures": ["ChatGLMModel"],
            "auto_map": {
                "AutoConfig": "configuration_chatglm.ChatGLMConfig",
                "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
            },
            "hidden_size": hidden_size,
            "ffn_hidden_size": ffn_hidden_size,
            "num_layers": num_layers,
            "num_attention_heads": num_heads,
            "multi_query_attention": num_groups != num_heads,
            "multi_query_group_num": num_groups,
            "kv_channels": hidden_size // num_heads,
            "padded_vocab_size": vocab_size,
            "layernorm_epsilon": 1e-5,
            "rmsnorm": True,
            "add_bias_linear": False,
            "add_qkv_bias": True if qkv_bias is None else qkv_bias,
            "post_layer_norm": True,
            "apply_residual_connection_post_layernorm": False,
            "original_rope": True,
            "seq_length": 512,
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
        }
    if family == "baichuan":
        if num_groups != num_heads:
            raise ValueError("Baichuan2 has no grouped-query attention; use num_groups == num_heads.")
        return {
            "model_type": "baichuan",
            "architectures": ["BaichuanForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_baichuan.BaichuanConfig",
                "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM",
            },
            "hidden_size": hidden_size,
            "intermediate_size": ffn_hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "vocab_size": vocab_size,
            "rms_norm_eps": 1e-6,
            "model_max_length": 512,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "z_loss_weight": 0,
            "torch_dtype": dtype,
        }
    raise ValueError(f"unknown family {family!r}; use one of {sorted(FAMILIES)}.")


def synthetic_checkpoint(
    out_dir: PathLike,
    family: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_groups: int = 2,
    ffn_hidden_size: int = 128,
    vocab_size: int = 2522,
    tie: bool = False,
    qkv_bias: Optional[bool] = None,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_mb: float = 0.1,
    with_tokenizer: bool = True,
    overwrite: bool = False,
    num_experts: int = 0,
    moe_ffn_hidden_size: int = 0,
) -> Path:
    """Write a seeded random checkpoint (sharded safetensors + index + config) of a family; returns its folder."""
    cfg = family_config(
        family,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_groups=num_groups,
        ffn_hidden_size=ffn_hidden_size,
        vocab_size=vocab_size,
        tie=tie,
        qkv_bias=qkv_bias,
        dtype=dtype,
        num_experts=num_experts,
        moe_ffn_hidden_size=moe_ffn_hidden_size,
    )
    fam = FAMILIES[family]
    spec = fam.read_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    with atomic_dir(out_dir, overwrite=overwrite, what="synthetic checkpoint folder") as tmp:
        writer = HFWriter(tmp, int(max_shard_mb * 1024**2))
        for key, shape in expected_hf_shapes(fam, spec).items():
            t = torch.randn(shape, generator=gen)
            if key.endswith("norm.weight"):
                t = 1.0 + 0.1 * t  # not all ones, so a norm mapped to the wrong place shows in the logits
            elif key.endswith(".bias"):
                t = 0.1 * t
            else:
                t = t / shape[-1] ** 0.5
            writer.add(key, t.to(tdtype))
        if family == "chatglm":  # real ChatGLM3 files carry the rotary buffer; the converter must skip it
            rd = spec.head_dim // 2
            writer.add(
                "transformer.rotary_pos_emb.inv_freq",
                (1.0 / 10000 ** (torch.arange(0, rd, 2).float() / rd)).to(tdtype),
            )
        writer.close()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        (tmp / "generation_config.json").write_text(
            json.dumps({"do_sample": False, "max_new_tokens": 32}) + "\n", encoding="utf-8"
        )
        if with_tokenizer:
            from kit.samples import sample_tokenizer_dir

            copy_side_files(sample_tokenizer_dir(), tmp)
    return Path(out_dir)
