"""LoRA targets per model family: the default (kit.core.workspace.LORA_TARGETS: q/k/v/o) under each family's own
names.

DeepSeek-V3's multi-head latent attention (MLA) has no k_proj / v_proj: its projections are q_a_proj and q_b_proj
(q_proj when q_lora_rank is None), kv_a_proj_with_mqa, kv_b_proj and o_proj (transformers 5.25
DeepseekV3Attention). GLM-4.5 (glm4_moe) keeps q/k/v/o_proj. Routers (`gate`) and experts get no adapter in any
MoE family (kit.adapt.moe.lora_target_problems).
"""

from __future__ import annotations

from kit.core.workspace import LORA_TARGETS

# model_type -> its attention projections, where they are not TrainConfig's default names
ATTENTION_PROJECTIONS = {
    "deepseek_v3": ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
}


def resolve_targets(model, targets) -> list:
    """The run's LoRA targets: the default set becomes the family's attention projections (those this model has:
    q_proj or q_a_proj + q_b_proj); targets the user chose stay as they are."""
    family = ATTENTION_PROJECTIONS.get(str(getattr(model.config, "model_type", "")))
    if family is None or tuple(targets) != LORA_TARGETS:
        return list(targets)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    return [t for t in family if t in names]
