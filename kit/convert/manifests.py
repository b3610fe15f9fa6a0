"""The manifests conversion writes: `converted-checkpoint` (HF -> Megatron, re-shard) and `hf-model` (Megatron -> HF).

Each records the source folder, its hash and, when the source carried a manifest (the `hf/` model training exported,
another converted checkpoint), that manifest as a consumed input, so a model can be followed back through the chain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from kit.convert.megatron_io import HF_META_DIR
from kit.convert.spec import ModelSpec, moe_layer_freq_flag
from kit.core.manifest import CONVERTED_CHECKPOINT, HF_MODEL, Manifest, tokenizer_sha256, write_manifest
from kit.core.parallel import layer_list_flag
from kit.errors import MissingInputError


def _tokenizer_hash(folder: Path) -> Optional[str]:
    try:
        return tokenizer_sha256(folder)
    except MissingInputError:  # a model folder without tokenizer files (tiny test models)
        return None


def _source_fields(source: str, source_man: Optional[Manifest], source_hash: tuple) -> Dict[str, Any]:
    return {
        "source": str(Path(source).resolve()),
        "source_kind": source_man.kind if source_man is not None else None,
        "source_sha256": source_hash[0],
        "source_hash_rule": source_hash[1],
    }


def architecture_flags(
    model: Dict[str, Any], padded_vocab: Optional[int] = None, grouped_gemm: bool = False
) -> List[str]:
    """Megatron/MindSpeed `pretrain_gpt.py` model flags for these model facts (names as in Megatron-LM
    `megatron/training/arguments.py`, core_r0.8; `--padded-vocab-size`, `--qk-layernorm` and the llama3 rope
    scaling flags as in MindSpeed-LLM's example scripts, e.g. examples/mcore/llama31 and qwen3; the MoE flags as
    in examples/mcore/qwen3_moe). `grouped_gemm`: the checkpoint's experts are in the --moe-grouped-gemm layout."""
    heads, groups = int(model["num_heads"]), int(model["num_kv_groups"])
    flags = [
        "--num-layers", model["num_layers"],
        "--hidden-size", model["hidden_size"],
        "--ffn-hidden-size", model["ffn_hidden_size"],
        "--num-attention-heads", heads,
        "--kv-channels", model["head_dim"],
        "--max-position-embeddings", model["max_position_embeddings"],
        "--position-embedding-type", model["position"],
        "--normalization", "RMSNorm",
        "--norm-epsilon", model["norm_eps"],
        "--swiglu",
        "--disable-bias-linear",
        "--padded-vocab-size", padded_vocab or model["vocab_size"],
    ]  # fmt: skip
    if model["position"] == "rope":
        flags += ["--rotary-base", model["rotary_base"]]
        if model["rotary_percent"] != 1.0:
            flags += ["--rotary-percent", model["rotary_percent"]]
        if model["rotary_interleaved"]:
            flags.append("--rotary-interleaved")
        if model.get("rope_scaling") == "llama3":
            flags += [
                "--rope-scaling-type", "llama3",
                "--rope-scaling-factor", model["rope_scaling_factor"],
                "--low-freq-factor", model["low_freq_factor"],
                "--high-freq-factor", model["high_freq_factor"],
                "--original-max-position-embeddings", model["original_max_position_embeddings"],
            ]  # fmt: skip
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", groups]
    if model["qkv_bias"]:
        flags.append("--add-qkv-bias")
    if model.get("qk_norm"):
        flags.append("--qk-layernorm")
    # Megatron-LM's MLA arguments (MindSpeed-LLM examples/mcore/deepseek3)
    if model.get("multi_latent_attention"):
        yarn = model.get("rope_scaling") == "yarn"
        flags += [
            "--multi-latent-attention",
            *(["--q-lora-rank", model["q_lora_rank"]] if model.get("q_lora_rank") else []),
            "--kv-lora-rank", model["kv_lora_rank"],
            "--qk-head-dim", model["qk_head_dim"],
            "--qk-pos-emb-head-dim", model["qk_pos_emb_head_dim"],
            "--v-head-dim", model["v_head_dim"],
            "--rope-type", "yarn" if yarn else "rope",
        ]  # fmt: skip
        if yarn:  # MindSpeed-LLM's names, as its deepseek3 scripts' ROPE_ARGS
            flags += [
                "--rope-scaling-type", "yarn",
                "--rope-scaling-factor", model["rope_scaling_factor"],
                "--beta-fast", model["yarn_beta_fast"],
                "--beta-slow", model["yarn_beta_slow"],
                "--rope-scaling-mscale", model["yarn_mscale"],
                "--rope-scaling-mscale-all-dim", model["yarn_mscale_all_dim"],
                "--rope-scaling-original-max-position-embeddings", model["original_max_position_embeddings"],
            ]  # fmt: skip
    if not model["tied"]:
        flags.append("--untie-embeddings-and-output-weights")
    return [str(f) for f in flags + moe_flags(model, grouped_gemm)]


def moe_flags(model: Dict[str, Any], grouped_gemm: bool = False) -> List[str]:
    """The MoE flags of a model with experts (none for a dense one). Qwen3-MoE's router (softmax over the experts,
    top-k, renormalised when norm_topk_prob) is megatron-core's default routing (softmax over the top-k logits);
    MindSpeed-LLM's qwen3_moe scripts add --norm-topk-prob for it. Without norm_topk_prob the top-k keep their
    softmax over all experts: --moe-router-pre-softmax. The dispatcher is megatron-core's all-to-all (MindSpeed's
    scripts use their alltoall_seq, which megatron-core 0.16 does not have)."""
    if not model.get("num_experts"):
        return []
    sigmoid = model.get("moe_router_score_function") == "sigmoid"
    flags = [
        "--num-experts", model["num_experts"],
        "--moe-router-topk", model["moe_router_topk"],
        "--moe-ffn-hidden-size", model["moe_ffn_hidden_size"],
    ]  # fmt: skip
    flags += _balance_flags(model, sigmoid) + _layer_freq_flags(model["moe_layer_freq"])
    flags += ["--moe-token-dispatcher-type", "alltoall"]
    if model.get("moe_norm_topk_prob"):
        flags.append("--norm-topk-prob")
    elif not sigmoid:
        flags.append("--moe-router-pre-softmax")
    flags += _routed_flags(model)
    if grouped_gemm:
        flags.append("--moe-grouped-gemm")
    return [str(f) for f in flags]


def _balance_flags(model: Dict[str, Any], sigmoid: bool) -> List[Any]:
    """Load balancing: Qwen3-MoE's auxiliary loss; for the sigmoid router the expert bias balances the load
    (MindSpeed-LLM's examples/mcore/glm45 and deepseek3 scripts: --moe-router-load-balancing-type none), and a
    DeepSeek-V3 aux_loss_alpha is its sequence-wise loss (their --moe-aux-loss-coeff with --seq-aux)."""
    coeff = model.get("moe_aux_loss_coeff") or 0.0
    if not sigmoid:
        return ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", coeff]
    return ["--moe-router-load-balancing-type", "none"] + (
        ["--moe-aux-loss-coeff", coeff, "--seq-aux"] if coeff else []
    )


def _layer_freq_flags(pattern) -> List[Any]:
    """Which layers are MoE blocks. MindSpeed-LLM's pretrain_gpt.py builds every layer from one spec and makes the
    first k dense only through its own --first-k-dense-replace with an integer --moe-layer-freq
    (mindspeed_llm/core/transformer/transformer_block.py), so dense-first models (DeepSeek-V3, GLM-4.5) get those;
    any other pattern megatron-core's list form."""
    pattern = [int(x) for x in pattern]
    k = pattern.index(1) if 1 in pattern else len(pattern)
    if 0 < k < len(pattern) and all(pattern[k:]):
        return ["--first-k-dense-replace", k, "--moe-layer-freq", 1]
    return ["--moe-layer-freq", moe_layer_freq_flag(pattern)]


def _routed_flags(model: Dict[str, Any]) -> List[str]:
    """DeepSeek-V3 / GLM-4.5: the sigmoid router with its expert bias (fp32 router, as MindSpeed-LLM's scripts run
    it), grouped top-k and scaling, the shared experts and the MTP layers (Megatron-LM megatron/training/arguments.py
    names of the TransformerConfig fields; MindSpeed-LLM's --n-shared-experts, which sizes them
    n x --moe-ffn-hidden-size, where the size is such a multiple)."""
    flags: List[Any] = []
    if model.get("moe_router_score_function") == "sigmoid":
        flags += ["--moe-router-score-function", "sigmoid"]
    if model.get("moe_router_enable_expert_bias"):
        flags += ["--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32"]
    if model.get("moe_router_topk_scaling_factor"):
        flags += ["--moe-router-topk-scaling-factor", model["moe_router_topk_scaling_factor"]]
    if model.get("moe_router_num_groups"):
        flags += ["--moe-router-num-groups", model["moe_router_num_groups"]]
        flags += ["--moe-router-group-topk", model["moe_router_group_topk"]]
    shared, width = model.get("moe_shared_expert_intermediate_size") or 0, int(model["moe_ffn_hidden_size"])
    if shared and shared % width == 0:
        flags += ["--n-shared-experts", shared // width]
    elif shared:
        flags += ["--moe-shared-expert-intermediate-size", shared]
    if model.get("mtp_num_layers"):
        flags += ["--mtp-num-layers", model["mtp_num_layers"]]
    return [str(f) for f in flags]


def write_converted_manifest(
    tmp: Path,
    target: str,
    meta: Dict[str, Any],
    spec: ModelSpec,
    source_man: Optional[Manifest],
    source_hash: tuple,
) -> Manifest:
    """The converted-checkpoint manifest of a Megatron output (written last in its temporary folder)."""
    tok = tmp / HF_META_DIR
    model = spec.facts()
    fields = {
        "direction": meta["direction"],
        "family": spec.family,
        "flavor": meta["flavor"],
        "tp": meta["tp"],
        "pp": meta["pp"],
        "ep": meta.get("ep", 1),
        "expert_tensor_parallel_size": meta.get("expert_tensor_parallel_size"),
        "moe_grouped_gemm": bool(meta.get("moe_grouped_gemm")),
        "num_layer_list": meta["num_layer_list"],
        "padded_vocab_size": meta["padded_vocab_size"],
        "make_vocab_size_divisible_by": meta["make_vocab_size_divisible_by"],
        "dtype": meta["dtype"],
        "model": model,
        "tokenizer": str(Path(target).resolve() / HF_META_DIR) if tok.is_dir() else None,
        "tokenizer_sha256": _tokenizer_hash(tok) if tok.is_dir() else None,
        # what a Megatron/MindSpeed run loading this folder must be told (besides --load and TP/PP)
        "megatron_flags": architecture_flags(
            model, meta["padded_vocab_size"], meta.get("moe_grouped_gemm", False)
        )
        + (
            ["--num-layer-list", layer_list_flag(meta["num_layer_list"])]
            if layer_list_flag(meta["num_layer_list"])
            else []
        )
        + (["--use-mcore-models"] if meta["flavor"] != "legacy" else []),
        **_source_fields(meta["source"], source_man, source_hash),
    }
    inputs = [source_man.as_input()] if source_man is not None else []
    return write_manifest(tmp, CONVERTED_CHECKPOINT, fields, inputs=inputs)


def write_hf_manifest(
    tmp: Path,
    target: str,
    source: str,
    spec: ModelSpec,
    layout: Dict[str, Any],
    source_man: Optional[Manifest],
    source_hash: tuple,
) -> Manifest:
    """The hf-model manifest of a Megatron -> HF output (written last in its temporary folder)."""
    fields = {
        "family": spec.family,
        "direction": "megatron_to_hf",
        "model": spec.facts(),
        "source_layout": layout,  # tp, pp, flavor of the Megatron checkpoint merged
        "tokenizer": str(Path(target).resolve()),
        "tokenizer_sha256": _tokenizer_hash(tmp),
        **_source_fields(source, source_man, source_hash),
    }
    inputs = [source_man.as_input()] if source_man is not None else []
    return write_manifest(tmp, HF_MODEL, fields, inputs=inputs)


def refresh_tokenizer_hash(folder) -> Manifest:
    """Re-write a converted-checkpoint manifest after a tokenizer file was added to its hf_meta/ (util.py's
    --tokenizer-model), keeping its fields and inputs."""
    from kit.core.manifest import read_manifest

    m = read_manifest(folder, expect=CONVERTED_CHECKPOINT)
    fields = dict(m.fields, tokenizer=str(Path(folder).resolve() / HF_META_DIR))
    fields["tokenizer_sha256"] = _tokenizer_hash(Path(folder) / HF_META_DIR)
    return write_manifest(folder, CONVERTED_CHECKPOINT, fields, inputs=m.inputs)
