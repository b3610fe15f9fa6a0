"""The config.json readers of the DeepSeek-V3 MoE block (GLM-4.5 has the same) and of multi-head latent attention:
config dict -> ModelSpec fields, refusing what megatron-core 0.16 cannot run as transformers does."""

from __future__ import annotations

from kit.errors import InputError


def routed_moe_fields(cfg: dict, family: str) -> dict:
    """ModelSpec MoE fields of the DeepSeek-V3 router and MoE block that GLM-4.5 shares (transformers
    modeling_deepseek_v3 / modeling_glm4_moe): sigmoid scores plus e_score_correction_bias pick the experts, the
    top-k inside the topk_group best of n_group groups (a group scored by its best two experts), their sigmoid
    weights renormalised and times routed_scaling_factor; shared experts beside; layers below first_k_dense_replace
    dense. Combinations megatron-core 0.16 cannot run the same way are refused."""
    n, experts = int(cfg["num_hidden_layers"]), int(cfg.get("n_routed_experts") or 0)
    topk, groups = int(cfg.get("num_experts_per_tok") or 0), int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or 1)
    scoring = cfg.get("scoring_func") or "sigmoid"
    bad = []
    if scoring != "sigmoid":
        bad.append(f"scoring_func {scoring!r} (the kit converts the sigmoid router of DeepSeek-V3 / GLM-4.5)")
    if not cfg.get("norm_topk_prob", True):
        bad.append(
            "norm_topk_prob false (megatron-core's sigmoid router always renormalises its top-k weights)"
        )
    if groups > 1 and (experts % groups or topk % topk_group or topk // topk_group != 2):
        bad.append(
            f"n_group {groups}, topk_group {topk_group}, num_experts_per_tok {topk} (megatron-core scores a group "
            f"by its best num_experts_per_tok / topk_group experts and HF by its best 2: they agree only when "
            f"that is 2 and n_group divides the {experts} experts)"
        )
    if bad:
        raise InputError(
            f"config.json of this {family} model has {'; '.join(bad)}: megatron-core 0.16 cannot route it the "
            f"way transformers does, so the converted model would not be the same model; not supported."
        )
    if cfg.get("num_nextn_predict_layers") and cfg.get("tie_word_embeddings"):
        raise InputError(
            f"config.json of this {family} model ties the embedding and the head and has MTP layers: the kit maps "
            f"the MTP layer's head to the untied output layer; not supported."
        )
    dense_first = int(cfg.get("first_k_dense_replace") or 0)
    factor = float(cfg.get("routed_scaling_factor") or 1.0)
    return dict(
        num_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
        moe_norm_topk_prob=True,
        moe_aux_loss_coeff=float(cfg.get("aux_loss_alpha") or 0.0),
        moe_layer_freq=tuple(int(i >= dense_first) for i in range(n)),
        moe_shared_expert_intermediate_size=int(cfg.get("n_shared_experts") or 0)
        * int(cfg["moe_intermediate_size"]),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=factor if factor != 1.0 else 0.0,
        moe_router_num_groups=groups if groups > 1 else 0,
        moe_router_group_topk=topk_group if groups > 1 else 0,
        mtp_num_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


def mla_fields(cfg: dict) -> dict:
    """ModelSpec fields of DeepSeek-V3's multi-head latent attention (q_lora_rank None: one query projection)."""
    # HF's rope_interleave=True rotates the rope dims in pairs (2i, 2i+1); megatron-core's MLA
    # (rope_utils._apply_rotary_pos_emb_bshd with multi_latent_attention) first reorders them even-then-odd and
    # rotates pairs (i, i + d/2): the same pairs, so the same attention scores from the same weights. With
    # rope_interleave=False HF rotates (i, i + d/2) of the stored order, which megatron-core's MLA cannot: refused,
    # as are biases. yarn is kept as facts (it changes no weight): yarn_fields.
    bad = []
    if not cfg.get("rope_interleave", True):
        bad.append("rope_interleave false (megatron-core's MLA rotates interleaved pairs)")
    if cfg.get("attention_bias"):
        bad.append("attention_bias true (megatron-core's MLA projections have no bias)")
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind not in ("default", "yarn"):
        bad.append(f"rope scaling {kind!r} (the kit converts plain RoPE and yarn for MLA)")
    if bad:
        raise InputError(
            f"config.json of this deepseek_v3 model has {'; '.join(bad)}; the kit converts MLA with interleaved "
            f"RoPE (plain or yarn) and no biases (rope_interleave true, attention_bias false), so this model "
            f"cannot be converted yet."
        )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        **(yarn_fields(rs, cfg) if kind == "yarn" else {}),
    )


YARN_FIXED = {"attention_factor": None, "truncate": True}  # HF keys megatron-core 0.16 has no setting for


def yarn_fields(rs: dict, cfg: dict) -> dict:
    """ModelSpec fields of DeepSeek-V3's yarn rope_scaling (published: factor 40, beta_fast 32, beta_slow 1, mscale 1,
    mscale_all_dim 1, original_max_position_embeddings 4096), read as transformers reads them
    (modeling_rope_utils._compute_yarn_parameters, yarn_apply_mscale): no factor = max / original positions; cos and
    sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else times mscale(factor, 1);
    the softmax scale times mscale(factor, mscale_all_dim)^2. megatron-core's YarnRotaryEmbedding and MLA compute the
    same from (mscale, mscale_all_dim), so where HF ignores mscale (mscale_all_dim unset) the spec holds (1, 0)."""
    fixed = [f"{k} {rs[k]!r}" for k, want in YARN_FIXED.items() if k in rs and rs[k] != want]
    if fixed:
        raise InputError(
            f"config.json of this deepseek_v3 model has yarn rope scaling with {', '.join(fixed)}; megatron-core "
            f"0.16's YarnRotaryEmbedding has no setting for it (it derives the attention factor from mscale and "
            f"mscale_all_dim and rounds the correction range); remove it from rope_scaling to convert."
        )
    original = int(rs.get("original_max_position_embeddings") or 4096)
    factor = float(rs.get("factor") or int(cfg.get("max_position_embeddings", original)) / original)
    mscale, mscale_all = float(rs.get("mscale") or 0.0), float(rs.get("mscale_all_dim") or 0.0)
    if not (mscale and mscale_all):
        mscale = 1.0
    return dict(
        rope_scaling="yarn",
        rope_scaling_factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(rs.get("beta_fast") or 32.0),
        beta_slow=float(rs.get("beta_slow") or 1.0),
        mscale=mscale,
        mscale_all_dim=mscale_all,
    )
