"""The shape facts of one model, read from an HF config.json per family, and the Megatron arguments they imply."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any, Dict, Tuple


@dataclass(frozen=True)
class ModelSpec:
    """Everything the key/shape maps need; one field per Megatron architecture argument."""

    family: str
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    tied: bool
    qkv_bias: bool
    position: str  # "rope" or "alibi" (Baichuan2-13B; MindSpeed/ModelLink only)
    rotary_base: float
    rotary_percent: float
    rotary_interleaved: bool
    max_position_embeddings: int
    norm_head: bool = False  # Baichuan2 NormHead: lm_head rows are L2-normalised at forward time
    qk_norm: bool = False  # Qwen3: a per-head RMSNorm on q and k before rotary (Megatron --qk-layernorm)
    # Llama-3.1/3.2 `rope_scaling` (rope_type llama3): "" = none. The factors of HF's _compute_llama3_parameters.
    rope_scaling: str = ""
    rope_scaling_factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    def full_shape(self, role: str) -> Tuple[int, ...]:
        """Shape of the whole (TP=1, unpadded) Megatron tensor of a role."""
        h, hd, ffn = self.hidden_size, self.head_dim, self.ffn_hidden_size
        qkv = (self.num_heads + 2 * self.num_groups) * hd
        shapes = {
            "embedding": (self.vocab_size, h),
            "output": (self.vocab_size, h),
            "final_norm": (h,),
            "input_norm": (h,),
            "post_norm": (h,),
            "qkv.weight": (qkv, h),
            "qkv.bias": (qkv,),
            "proj.weight": (h, self.num_heads * hd),
            "fc1.weight": (2 * ffn, h),
            "fc2.weight": (h, ffn),
            "q_norm": (hd,),
            "k_norm": (hd,),
        }
        return shapes[role]

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def facts(self) -> Dict[str, Any]:
        """The model facts the next stages need (a converted-checkpoint manifest's `model` field, the input of
        kit.parallel's rules and of Megatron's architecture flags): every field, plus `num_kv_groups` and
        `num_attention_heads` under Megatron's names."""
        out = self.to_dict()
        out["num_kv_groups"] = self.num_groups
        out["num_attention_heads"] = self.num_heads
        return out

    @classmethod
    def from_facts(cls, facts: Dict[str, Any]) -> ModelSpec:
        """The spec back from `facts()` (extra keys ignored)."""
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in facts.items() if k in names})


def megatron_args(
    spec: ModelSpec,
    tp: int,
    pp: int,
    layer_list: list,
    padded_vocab: int,
    divisible_by: int,
    dtype,
    flavor: str,
) -> argparse.Namespace:
    """The `args` Namespace of model_optim_rng.pt: primitives and one torch.dtype, so weights_only loading works.

    The dtype is a reference to `torch.<name>` that pickles as torch.save writes a dtype, so no torch is needed."""
    from kit.convert.file_slices import dtype_name
    from kit.convert.torch_zip import torch_dtype_ref

    name = dtype_name(dtype)
    uneven = len(set(layer_list)) > 1
    return argparse.Namespace(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        group_query_attention=spec.num_groups != spec.num_heads,
        num_query_groups=spec.num_groups,
        num_key_value_heads=spec.num_groups,
        kv_channels=spec.head_dim,
        seq_length=spec.max_position_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
        position_embedding_type=spec.position,
        add_position_embedding=True,
        use_rotary_position_embeddings=(spec.position == "rope"),
        rotary_base=spec.rotary_base,
        rotary_percent=spec.rotary_percent,
        rotary_interleaved=spec.rotary_interleaved,
        normalization="RMSNorm",
        norm_epsilon=spec.norm_eps,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        untie_embeddings_and_output_weights=not spec.tied,
        padded_vocab_size=padded_vocab,
        make_vocab_size_divisible_by=divisible_by,
        tokenizer_type="PretrainedFromHF",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        num_layer_list=",".join(map(str, layer_list)) if uneven else None,
        expert_model_parallel_size=1,
        params_dtype=torch_dtype_ref(name),
        bf16=name == "bfloat16",
        fp16=name == "float16",
        bert_binary_head=False,
        iteration=1,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        use_mcore_models=flavor != "legacy",
        use_legacy_models=flavor == "legacy",
        transformer_impl="transformer_engine" if flavor == "te" else "local",
        apply_layernorm_1p=False,
        apply_query_key_layer_scaling=False,
        model_family=spec.family,
        qk_layernorm=spec.qk_norm,
        # Megatron-LM's names (--use-rope-scaling, --rotary-scaling-factor) and MindSpeed-LLM's (the rest)
        use_rope_scaling=spec.rope_scaling == "llama3",
        rotary_scaling_factor=spec.rope_scaling_factor,
        rope_scaling_type=spec.rope_scaling or None,
        rope_scaling_factor=spec.rope_scaling_factor,
        low_freq_factor=spec.low_freq_factor,
        high_freq_factor=spec.high_freq_factor,
        original_max_position_embeddings=spec.original_max_position_embeddings or None,
    )
