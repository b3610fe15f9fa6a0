"""Megatron's on-disk layout: key names per flavor, rank folder names, the tracker file.

Which TP / PP layouts fit a model is kit/core/parallel.py's business; this module only names things on disk.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from kit.convert.spec import split_group, split_role

FLAVORS = ("local", "legacy", "te")
TRACKER = "latest_checkpointed_iteration.txt"
ITERATION = 1  # '0' fails read_metadata's `iteration > 0` (Megatron-LM core_v0.6.0 megatron/training/checkpointing.py)
ITER_DIR = f"iter_{ITERATION:07d}"
CHECKPOINT_VERSION = 3.0

# role -> key inside one rank's model dict. mcore keys are flat; legacy keys are paths in a nested dict.
_MCORE_LAYER = {
    "input_norm": "input_layernorm.weight",
    "qkv.weight": "self_attention.linear_qkv.weight",
    "qkv.bias": "self_attention.linear_qkv.bias",
    "proj.weight": "self_attention.linear_proj.weight",
    "post_norm": "pre_mlp_layernorm.weight",
    "fc1.weight": "mlp.linear_fc1.weight",
    "fc2.weight": "mlp.linear_fc2.weight",
    # Qwen3's q/k norms: mcore's q_layernorm / k_layernorm (same names in the TE spec); legacy Megatron has none
    "q_norm": "self_attention.q_layernorm.weight",
    "k_norm": "self_attention.k_layernorm.weight",
    # MLA (local spec, megatron-core 0.16 gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True))
    "mla.q_down": "self_attention.linear_q_down_proj.weight",
    "mla.q_norm": "self_attention.q_layernorm.weight",
    "mla.q_up": "self_attention.linear_q_up_proj.weight",
    "mla.q": "self_attention.linear_q_proj.weight",
    "mla.kv_down": "self_attention.linear_kv_down_proj.weight",
    "mla.kv_norm": "self_attention.kv_layernorm.weight",
    "mla.kv_up": "self_attention.linear_kv_up_proj.weight",
}
_TE_LAYER = dict(
    _MCORE_LAYER,
    input_norm="self_attention.linear_qkv.layer_norm_weight",
    post_norm="mlp.linear_fc1.layer_norm_weight",
)
_LEGACY_LAYER = {
    "input_norm": "input_norm.weight",
    "qkv.weight": "self_attention.query_key_value.weight",
    "qkv.bias": "self_attention.query_key_value.bias",
    "proj.weight": "self_attention.dense.weight",
    "post_norm": "post_attention_norm.weight",
    "fc1.weight": "mlp.dense_h_to_4h.weight",
    "fc2.weight": "mlp.dense_4h_to_h.weight",
}
_MCORE_GLOBAL = {
    "embedding": ("embedding.word_embeddings.weight",),
    "final_norm": ("decoder.final_layernorm.weight",),
    "output": ("output_layer.weight",),
}
_LEGACY_GLOBAL = {
    "embedding": ("language_model", "embedding", "word_embeddings", "weight"),
    "final_norm": ("language_model", "encoder", "final_norm.weight"),
    "output": ("language_model", "output_layer", "weight"),
    "tied_head": ("word_embeddings_for_head", "weight"),
}


# MoE layers (megatron-core 0.16 moe_layer.py / experts.py): the router, and each local expert k of this EP rank as
# SequentialMLP `local_experts.{k}` (the default) or, with --moe-grouped-gemm on the TE spec, TEGroupedMLP's one
# parameter per expert `linear_fc1.weight{k}`. A MoE layer's pre-MLP norm is its own module in both specs.
_MOE_LAYER = {
    "router.weight": "mlp.router.weight",
    "expert.fc1.weight": "mlp.experts.local_experts.{k}.linear_fc1.weight",
    "expert.fc2.weight": "mlp.experts.local_experts.{k}.linear_fc2.weight",
    "post_norm": "pre_mlp_layernorm.weight",
    "router.expert_bias": "mlp.router.expert_bias",
    "shared.fc1.weight": "mlp.shared_experts.linear_fc1.weight",
    "shared.fc2.weight": "mlp.shared_experts.linear_fc2.weight",
}
# an MTP layer's own tensors (megatron-core 0.16 MultiTokenPredictionLayer); its decoder layer is under
# `mtp.layers.{k}.transformer_layer.` with the decoder's names
_MTP = {
    "mtp.enorm": "enorm.weight",
    "mtp.hnorm": "hnorm.weight",
    "mtp.eh_proj": "eh_proj.weight",
    "mtp.final_norm": "final_layernorm.weight",
}
_TE_GROUPED = dict(
    _MOE_LAYER,
    **{
        "expert.fc1.weight": "mlp.experts.linear_fc1.weight{k}",
        "expert.fc2.weight": "mlp.experts.linear_fc2.weight{k}",
    },
)


# megatron-core's legacy GroupedMLP (local spec + --moe-grouped-gemm, what MindSpeed-LLM's qwen3_moe scripts train):
# all local experts of one EP rank in one tensor each, weight1 [hidden, experts x 2 x ffn/TP] whose bytes are the
# experts' fc1.T blocks [hidden, 2 x ffn/TP] one after another, weight2 [experts x ffn/TP, hidden] = the fc2.T
# blocks stacked (experts.py GroupedMLP.forward views them as [experts, hidden, -1] / [experts, -1, hidden]).
_LEGACY_GROUPED = {"fc1.weight": "mlp.experts.weight1", "fc2.weight": "mlp.experts.weight2"}


def key_path(
    flavor: str,
    role: str,
    local_layer: Optional[int] = None,
    moe: bool = False,
    grouped_gemm: bool = False,
    mtp: Optional[int] = None,
) -> Tuple[str, ...]:
    """Path of a role's tensor in one rank's `model` dict (one element for flat mcore keys).

    Expert roles carry the rank's LOCAL expert index (`expert1.fc1.weight` = local expert 1); `moe` says the layer
    is a MoE block (its pre-MLP norm is not fused into fc1 in the TE spec); `grouped_gemm` picks TEGroupedMLP
    names on the TE flavor; `mtp` k: the role is of MTP layer k (local_layer is then unused)."""
    if flavor not in FLAVORS:
        raise ValueError(
            f"unknown key flavor {flavor!r}; use one of {FLAVORS} (local = megatron-core local spec, "
            f"what MindSpeed-LLM trains; legacy = Megatron legacy / ModelLink legacy; te = "
            f"TransformerEngine spec)."
        )
    if local_layer is None and mtp is None:
        if flavor == "legacy":
            return _LEGACY_GLOBAL[role]
        if role == "tied_head":
            role = "output"  # mcore keeps the last stage's copy of a tied embedding as output_layer.weight
        return _MCORE_GLOBAL[role]
    if flavor == "legacy":
        return ("language_model", "encoder", f"layers.{local_layer}.{_LEGACY_LAYER[role]}")
    if mtp is not None and role in _MTP:
        return (f"mtp.layers.{mtp}.{_MTP[role]}",)
    pre = f"decoder.layers.{local_layer}" if mtp is None else f"mtp.layers.{mtp}.transformer_layer"
    group = split_group(role)
    if group is not None:  # GroupedMLP's one tensor for the EP rank's experts (flavor local)
        return (f"{pre}.{_LEGACY_GROUPED[group[0]]}",)
    base, k = split_role(role)
    if moe and base in _MOE_LAYER:
        names = _TE_GROUPED if (grouped_gemm and flavor == "te") else _MOE_LAYER
        return (f"{pre}.{names[base].format(k=k)}",)
    names = _TE_LAYER if flavor == "te" else _MCORE_LAYER
    return (f"{pre}.{names[role]}",)


def put(tree: dict, path: Sequence[str], value) -> None:
    """Set tree[path[0]][path[1]]... = value, creating nested dicts."""
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def get(tree: dict, path: Sequence[str]):
    """tree[path[0]][path[1]]...; KeyError names the whole path."""
    node = tree
    for p in path:
        if not isinstance(node, dict) or p not in node:
            raise KeyError(".".join(path))
        node = node[p]
    return node


def flatten(tree: dict, prefix: str = "") -> Dict[str, object]:
    """Nested dict -> {'a.b.c': leaf}."""
    out: Dict[str, object] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def rank_dir(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """`mp_rank_TT`, `_PPP` appended when PP > 1, `_EEE` appended when EP > 1 (Megatron-LM
    megatron/training/checkpointing.py get_checkpoint_name; MindSpeed-LLM's converter writes the same names):
    `mp_rank_01_002` is TP rank 1 of PP stage 2 without EP, or of EP rank 2 without PP; `mp_rank_01_000_002`."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of EP rank ep_rank's experts: a contiguous run, local expert k = global
    ep_rank * (num_experts / ep) + k (megatron-core's local_expert_indices)."""
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)
