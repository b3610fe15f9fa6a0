"""The shape facts of one model, read from an HF config.json per family, and the Megatron arguments they imply."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

EXPERT_PREFIX = (
    "expert"  # per-expert roles are `expert<e>.fc1.weight` (global index e), base role `expert.fc1.weight`
)


def expert_role(e: int, role: str) -> str:
    """The role of expert e's tensor (`expert3.fc1.weight` for role `fc1.weight`)."""
    return f"{EXPERT_PREFIX}{e}.{role}"


def group_role(first: int, count: int, role: str) -> str:
    """The role of `count` experts' tensors from expert `first` on, held as one tensor (megatron-core's GroupedMLP
    weight1 / weight2 of one EP rank): `experts2+2.fc1.weight`."""
    return f"{EXPERT_PREFIX}s{first}+{count}.{role}"


def split_group(role: str) -> Optional[Tuple[str, range]]:
    """(role, global experts) of a group role, None for any other role."""
    head, _, rest = role.partition(".")
    if not head.startswith(EXPERT_PREFIX + "s") or "+" not in head:
        return None
    first, count = (int(x) for x in head[len(EXPERT_PREFIX) + 1 :].split("+"))
    return rest, range(first, first + count)


def split_role(role: str) -> Tuple[str, Optional[int]]:
    """(base role, expert index or None): `expert3.fc1.weight` -> (`expert.fc1.weight`, 3)."""
    head, _, rest = role.partition(".")
    if head.startswith(EXPERT_PREFIX) and head[len(EXPERT_PREFIX) :].isdigit():
        return f"{EXPERT_PREFIX}.{rest}", int(head[len(EXPERT_PREFIX) :])
    return role, None


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
    # Mixture of experts (Qwen3-MoE); num_experts 0 = a dense model. Megatron's names (--num-experts, ...).
    num_experts: int = 0
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0  # one expert's FFN width (HF moe_intermediate_size)
    moe_norm_topk_prob: bool = False  # HF norm_topk_prob: the top-k probabilities renormalised to sum 1
    moe_aux_loss_coeff: float = 0.0  # HF router_aux_loss_coef
    moe_layer_freq: Tuple[int, ...] = ()  # one 1 (MoE block) or 0 (dense MLP) per layer; () for dense models
    # GLM-4.5 / DeepSeek-V3: shared experts (HF n_shared_experts x moe_intermediate_size), sigmoid routing with a
    # score-correction bias (megatron-core's router.expert_bias), grouped top-k and a routed scaling factor
    moe_shared_expert_intermediate_size: int = 0
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_topk_scaling_factor: float = 0.0  # 0 = none
    moe_router_num_groups: int = 0  # 0 = no group-limited routing
    moe_router_group_topk: int = 0
    # multi-token prediction layers after the decoder (HF num_nextn_predict_layers; model.layers.{num_layers + k})
    mtp_num_layers: int = 0
    # DeepSeek-V3 multi-head latent attention (megatron-core MLATransformerConfig names); head_dim is v_head_dim.
    # q_lora_rank 0: the query is one projection of the hidden state (HF q_lora_rank None, DeepSeek-V2-Lite)
    multi_latent_attention: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_head_dim: int = 0  # HF qk_nope_head_dim
    qk_pos_emb_head_dim: int = 0  # HF qk_rope_head_dim
    v_head_dim: int = 0
    # DeepSeek-V3's YaRN on the MLA rope dims (rope_scaling "yarn" with rope_scaling_factor and
    # original_max_position_embeddings above): megatron-core's mscale / mscale_all_dim / beta_fast / beta_slow
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def is_moe_layer(self, layer: int) -> bool:
        """True when layer `layer` (global index) is a MoE block (router + experts) rather than a dense MLP; an MTP
        layer (index num_layers and up) is one in every MoE family the kit converts."""
        if layer >= self.num_layers:
            return bool(self.num_experts)
        return bool(self.num_experts) and bool(self.moe_layer_freq[layer])

    def is_mtp_layer(self, layer: int) -> bool:
        """True for the multi-token prediction layers (global index num_layers and up)."""
        return layer >= self.num_layers

    @property
    def all_layers(self) -> int:
        """Decoder layers and MTP layers: what the HF folder holds under model.layers."""
        return self.num_layers + self.mtp_num_layers

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    def full_shape(self, role: str) -> Tuple[int, ...]:
        """Shape of the whole (TP=1, unpadded) Megatron tensor of a role (one expert's for expert roles)."""
        role, _ = split_role(role)
        h, hd, ffn, moe = self.hidden_size, self.head_dim, self.ffn_hidden_size, self.moe_ffn_hidden_size
        qkv = (self.num_heads + 2 * self.num_groups) * hd
        q_head = self.qk_head_dim + self.qk_pos_emb_head_dim
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
            "router.weight": (self.num_experts, h),
            "expert.fc1.weight": (2 * moe, h),
            "expert.fc2.weight": (h, moe),
            "router.expert_bias": (self.num_experts,),
            "shared.fc1.weight": (2 * self.moe_shared_expert_intermediate_size, h),
            "shared.fc2.weight": (h, self.moe_shared_expert_intermediate_size),
            "mla.q_down": (self.q_lora_rank, h),
            "mla.q_norm": (self.q_lora_rank,),
            "mla.q_up": (self.num_heads * q_head, self.q_lora_rank),
            "mla.q": (self.num_heads * q_head, h),
            "mla.kv_down": (self.kv_lora_rank + self.qk_pos_emb_head_dim, h),
            "mla.kv_norm": (self.kv_lora_rank,),
            "mla.kv_up": (self.num_heads * (self.qk_head_dim + self.v_head_dim), self.kv_lora_rank),
            "mtp.enorm": (h,),
            "mtp.hnorm": (h,),
            "mtp.eh_proj": (h, 2 * h),
            "mtp.final_norm": (h,),
            "mtp.embedding": (self.vocab_size, h),
            "mtp.output": (self.vocab_size, h),
        }
        return shapes[role]

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def facts(self) -> Dict[str, Any]:
        """The model facts the next stages need (a converted-checkpoint manifest's `model` field, the input of
        kit.core.parallel's rules and of Megatron's architecture flags): every field, plus `num_kv_groups` and
        `num_attention_heads` under Megatron's names."""
        out = self.to_dict()
        out["num_kv_groups"] = self.num_groups
        out["num_attention_heads"] = self.num_heads
        out["moe_layer_freq"] = list(self.moe_layer_freq)  # what JSON gives back
        return out


def moe_layer_freq_flag(spec_or_pattern) -> str:
    """Megatron's --moe-layer-freq value: `1` when every layer is a MoE block, else the list (`[1,1,0,1]`)."""
    pattern = [int(x) for x in getattr(spec_or_pattern, "moe_layer_freq", spec_or_pattern)]
    return "1" if all(pattern) else "[" + ",".join(map(str, pattern)) + "]"


def megatron_args(
    spec: ModelSpec,
    tp: int,
    pp: int,
    layer_list: list,
    padded_vocab: int,
    divisible_by: int,
    dtype,
    flavor: str,
    ep: int = 1,
    grouped_gemm: bool = False,
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
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
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
        **_moe_args(spec, grouped_gemm),
    )


def _moe_args(spec: ModelSpec, grouped_gemm: bool) -> Dict[str, Any]:
    """Megatron-LM's MoE arguments (megatron/training/arguments.py names; norm_topk_prob is MindSpeed-LLM's): the
    router of Qwen3-MoE is a softmax over the experts, top-k, renormalised when norm_topk_prob, which is
    megatron-core's default routing (top-k of the logits, softmax over the k); without it, --moe-router-pre-softmax."""
    if not spec.num_experts:
        return dict(num_experts=None, moe_grouped_gemm=False, mtp_num_layers=None)
    sigmoid = spec.moe_router_score_function == "sigmoid"
    return dict(
        num_experts=spec.num_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        # the sigmoid router always renormalises its top-k (moe_utils.topk_routing_with_score_function)
        moe_router_pre_softmax=not spec.moe_norm_topk_prob and not sigmoid,
        norm_topk_prob=spec.moe_norm_topk_prob,
        moe_router_score_function=spec.moe_router_score_function,
        moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor or None,
        moe_router_num_groups=spec.moe_router_num_groups or None,
        moe_router_group_topk=spec.moe_router_group_topk or None,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size or None,
        mtp_num_layers=spec.mtp_num_layers or None,
        **_mla_args(spec),
        moe_layer_freq=list(spec.moe_layer_freq),
        moe_grouped_gemm=bool(grouped_gemm),
        moe_token_dispatcher_type="alltoall",
    )


def _mla_args(spec: ModelSpec) -> Dict[str, Any]:
    """Megatron-LM's MLA arguments (megatron/training/arguments.py, MLATransformerConfig fields): plain RoPE on the
    qk_pos_emb_head_dim dims."""
    if not spec.multi_latent_attention:
        return dict(multi_latent_attention=False)
    return dict(
        multi_latent_attention=True,
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_head_dim=spec.qk_head_dim,
        qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
        v_head_dim=spec.v_head_dim,
        # rotary_scaling_factor (above) is YaRN's factor; 1 for plain RoPE, so no mscale on the softmax scale
        rope_type="yarn" if spec.rope_scaling == "yarn" else "rope",
        mscale=spec.yarn_mscale,
        mscale_all_dim=spec.yarn_mscale_all_dim,
        beta_fast=spec.yarn_beta_fast,
        beta_slow=spec.yarn_beta_slow,
        # MindSpeed-LLM reads its own names (its deepseek3 scripts' ROPE_ARGS)
        rope_scaling_beta_fast=spec.yarn_beta_fast,
        rope_scaling_beta_slow=spec.yarn_beta_slow,
        rope_scaling_mscale=spec.yarn_mscale,
        rope_scaling_mscale_all_dim=spec.yarn_mscale_all_dim,
    )
