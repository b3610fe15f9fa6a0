"""Declarative key maps per model family: which HF tensors (and which rows of fused ones) make each Megatron role.

A role is a Megatron tensor of one layer (`qkv.weight`) or of the model (`embedding`); its value lists the HF keys
its parts come from, in order. Parts that share one HF key are stacked rows of that key (ChatGLM3
`query_key_value` = [Q; K; V], Baichuan2 `W_pack` = [Q; K; V]). The inverse direction reads the same map backwards.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, Union

from kit.convert.routed import mla_fields, routed_moe_fields
from kit.convert.spec import ModelSpec, expert_role, split_role
from kit.core.i18n import t
from kit.errors import InputError

PathLike = Union[str, Path]

# How each role is split over tensor-parallel ranks (Megatron-LM core_v0.16 attention.py / mlp.py, and ModelLink's saver).
ROLE_KIND = {
    "embedding": "vocab",
    "output": "vocab",
    "final_norm": "replicated",
    "input_norm": "replicated",
    "post_norm": "replicated",
    "qkv.weight": "qkv",
    "qkv.bias": "qkv",
    "proj.weight": "row",
    "fc1.weight": "glu",
    "fc2.weight": "row",
    "q_norm": "replicated",  # Qwen3: one [head_dim] weight shared by every head (mcore q_layernorm / k_layernorm)
    "k_norm": "replicated",
    # MoE (megatron-core 0.16 moe/router.py, moe/experts.py): the router is replicated over TP and EP; each expert
    # is an MLP split over the expert-TP ranks like the dense one (expert_tensor_parallel_size defaults to TP).
    "router.weight": "replicated",
    "expert.fc1.weight": "glu",
    "expert.fc2.weight": "row",
    # GLM-4.5 / DeepSeek-V3 MoE layers (megatron-core 0.16 moe/router.py, moe/shared_experts.py): the score-correction
    # bias is a router buffer, replicated; the shared experts are one MLP split over TP like the dense one.
    "router.expert_bias": "replicated",
    "shared.fc1.weight": "glu",
    "shared.fc2.weight": "row",
    # multi-token prediction (megatron-core 0.16 transformer/multi_token_prediction.py): eh_proj is a column-parallel
    # [h, 2h] (its output gathered); the norms replicated. The MTP layer's embedding and head are the model's own
    # (megatron-core passes them in): on the HF side they are copies, written back from the main ones.
    # multi-head latent attention (megatron-core 0.16 multi_latent_attention.py with the local spec, where every MLA
    # projection is a ColumnParallelLinear: the down projections' outputs are gathered again, the up projections
    # keep their heads per rank); the latent norms are replicated
    "mla.q_down": "column",
    "mla.q_norm": "replicated",
    "mla.q_up": "column",
    "mla.q": "column",
    "mla.kv_down": "column",
    "mla.kv_norm": "replicated",
    "mla.kv_up": "column",
    "mtp.enorm": "replicated",
    "mtp.hnorm": "replicated",
    "mtp.eh_proj": "column",
    "mtp.final_norm": "replicated",
    "mtp.embedding": "vocab",
    "mtp.output": "vocab",
}
# roles a dtype cast leaves alone: megatron-core keeps the router's expert_bias in fp32 (router.py
# _maintain_float32_expert_bias), and a bf16 copy would move the routing
KEEP_DTYPE = ("router.expert_bias",)
# roles whose Megatron tensor is another role's (the MTP layer shares the embedding and the output layer)
ALIAS_ROLES = {"mtp.embedding": "embedding", "mtp.output": "output"}
MTP_ROLES = ("mtp.enorm", "mtp.hnorm", "mtp.eh_proj", "mtp.final_norm", "mtp.embedding", "mtp.output")
GLOBAL_ROLES = ("embedding", "final_norm", "output")
LAYER_ROLES = (
    "input_norm",
    "qkv.weight",
    "qkv.bias",
    "q_norm",
    "k_norm",
    "proj.weight",
    "post_norm",
    "fc1.weight",
    "fc2.weight",
)


@dataclass(frozen=True)
class Family:
    """One HF architecture: its key map, the config fields it reads, and the keys it may carry but we drop."""

    name: str
    model_types: Tuple[str, ...]
    # (config.json dict, the folder holding it or None) -> spec; only Baichuan2 reads the folder (its modeling code)
    read_config: Callable[..., ModelSpec]
    global_keys: Dict[str, Tuple[str, ...]]
    layer_prefix: str
    layer_keys: Dict[str, Tuple[str, ...]]
    ignore_suffixes: Tuple[str, ...] = ()
    notes: str = ""
    extra: Dict[str, str] = field(default_factory=dict)

    def roles(self, spec: ModelSpec) -> Tuple[List[str], List[str]]:
        """(global roles, per-layer roles) present in a model of this spec."""
        glob = [r for r in GLOBAL_ROLES if not (r == "output" and spec.tied)]
        absent = set() if spec.qkv_bias else {"qkv.bias"}
        absent |= set() if spec.qk_norm else {"q_norm", "k_norm"}
        layer = [r for r in LAYER_ROLES if r not in absent]
        if spec.multi_latent_attention:  # MLA's projections and latent norms take the place of QKV
            mla = ["mla.q_down", "mla.q_norm", "mla.q_up"] if spec.q_lora_rank else ["mla.q"]
            mla += ["mla.kv_down", "mla.kv_norm", "mla.kv_up"]
            at = layer.index("proj.weight")
            layer = [r for r in layer[:at] if r in ("input_norm",)] + mla + layer[at:]
        return glob, layer

    def layer_roles(self, spec: ModelSpec, layer: int) -> List[str]:
        """The roles of one layer: a MoE layer has the router and every expert's fc1 / fc2 (global expert
        indices, `expert3.fc1.weight`) instead of the dense fc1 / fc2."""
        _, roles = self.roles(spec)
        mtp = list(MTP_ROLES) if spec.is_mtp_layer(layer) else []
        if not spec.is_moe_layer(layer):
            return roles + mtp
        out = [r for r in roles if r not in ("fc1.weight", "fc2.weight")] + ["router.weight"]
        if spec.moe_router_enable_expert_bias:
            out.append("router.expert_bias")
        if spec.moe_shared_expert_intermediate_size:
            out += ["shared.fc1.weight", "shared.fc2.weight"]
        for e in range(spec.num_experts):
            out += [expert_role(e, "fc1.weight"), expert_role(e, "fc2.weight")]
        return out + mtp

    def hf_keys(self, role: str, layer: int = -1) -> Tuple[str, ...]:
        """The HF keys of a role's parts (layer roles get the layer prefix, expert roles the expert filled in)."""
        if role in self.global_keys:
            return self.global_keys[role]
        base, e = split_role(role)
        pre = self.layer_prefix.format(i=layer)
        return tuple(pre + (k.format(e=e) if e is not None else k) for k in self.layer_keys[base])

    def part_rows(self, spec: ModelSpec, role: str) -> Tuple[int, ...]:
        """Rows of each part (q, k, v for QKV; gate, up for GLU; one part otherwise)."""
        full = spec.full_shape(role)
        kind = ROLE_KIND[split_role(role)[0]]
        if kind == "qkv":
            hd = spec.head_dim
            return (spec.num_heads * hd, spec.num_groups * hd, spec.num_groups * hd)
        if kind == "glu":
            return (full[0] // 2, full[0] // 2)
        return (full[0],)


def _rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or rp.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict) -> dict:
    """ModelSpec fields of config.json's `rope_scaling` (transformers 4.x) or `rope_parameters` (5.x); only the
    Llama-3.1 kind (rope_type llama3) changes the frequencies the kit and Megatron compute, others are refused."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return {}
    if kind != "llama3":
        raise InputError(
            f"config.json rope_scaling type {kind!r} is not supported (the kit converts and checks rope_type "
            f"'llama3' only); remove rope_scaling from config.json to convert for the original context length."
        )
    return dict(
        rope_scaling="llama3",
        rope_scaling_factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def _llama_spec(
    cfg: dict, folder: Optional[PathLike] = None, rope: Callable[[dict], dict] = _rope_scaling
) -> ModelSpec:
    nh = int(cfg["num_attention_heads"])
    return ModelSpec(
        family="llama",
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=nh,
        num_groups=int(cfg.get("num_key_value_heads") or nh),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // nh),
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama has them only with attention_bias.
        qkv_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
        position="rope",
        rotary_base=_rope_theta(cfg),
        rotary_percent=1.0,
        rotary_interleaved=False,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        **rope(cfg),
    )


def _qwen3_spec(cfg: dict, folder: Optional[PathLike] = None) -> ModelSpec:
    # Qwen3 = the Llama layout + per-head q/k RMSNorm; head_dim is its own field (128 where hidden/heads is 64)
    return replace(_llama_spec(cfg), family="qwen3", qk_norm=True)


def _qwen3_moe_spec(cfg: dict, folder: Optional[PathLike] = None) -> ModelSpec:
    # Qwen3-MoE = Qwen3 attention + a sparse MoE block on layer i when i is not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0 (transformers modeling_qwen3_moe.Qwen3MoeDecoderLayer); the other layers
    # keep a dense MLP of intermediate_size.
    # `num_experts` in the published configs (transformers 4.x); transformers 5 writes it as num_local_experts
    n, experts = (
        int(cfg["num_hidden_layers"]),
        int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
    )
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    if cfg.get("shared_expert_intermediate_size"):
        raise InputError(
            "config.json has shared_expert_intermediate_size (a shared expert, Qwen2-MoE): the qwen3_moe map has "
            "no shared expert; this model is not supported yet."
        )
    return replace(
        _qwen3_spec(cfg),
        family="qwen3_moe",
        num_experts=experts,
        moe_router_topk=int(cfg.get("num_experts_per_tok") or 0),
        moe_ffn_hidden_size=int(cfg.get("moe_intermediate_size") or 0),
        moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef") or 0.0),
        moe_layer_freq=tuple(int(experts > 0 and i not in dense and (i + 1) % step == 0) for i in range(n)),
    )


def _deepseek3_spec(cfg: dict, folder: Optional[PathLike] = None) -> ModelSpec:
    # DeepSeek-V3 (transformers modeling_deepseek_v3): the Llama fields with multi-head latent attention, whose
    # reader also takes the rope scaling (YaRN) and refuses biases (kit.convert.routed.mla_fields)
    return replace(
        _llama_spec(cfg, rope=mla_fields),
        family="deepseek_v3",
        num_groups=int(cfg["num_attention_heads"]),
        head_dim=int(cfg["v_head_dim"]),
        # megatron-core's local spec builds MLA's q / kv latent norms only with qk_layernorm (--qk-layernorm)
        qk_norm=True,
        **routed_moe_fields(cfg, "deepseek_v3"),
    )


def _glm4_moe_spec(cfg: dict, folder: Optional[PathLike] = None) -> ModelSpec:
    # GLM-4.5 (transformers modeling_glm4_moe): GLM-4's partial rotary with rotate_half pairs (i, i + rd/2), not
    # GLM-4's interleaved pairs; q/k/v bias only with attention_bias, optional per-head q/k RMSNorm (use_qk_norm);
    # the DeepSeek-V3 MoE block.
    return replace(
        _glm_spec(cfg),
        family="glm4_moe",
        qkv_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=bool(cfg.get("use_qk_norm", False)),
        rotary_interleaved=False,
        **routed_moe_fields(cfg, "glm4_moe"),
    )


def _glm_spec(cfg: dict, folder: Optional[PathLike] = None) -> ModelSpec:
    # HF-native GLM-4 (GlmConfig): q/k/v bias, fused [gate; up], rotary on the first half of each head in
    # interleaved pairs (modeling_glm.py apply_rotary_pos_emb), like ChatGLM3.
    rp = cfg.get("rope_parameters") or {}
    percent = cfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor") or 0.5
    return replace(
        _llama_spec(cfg),
        family="glm",
        qkv_bias=bool(cfg.get("attention_bias", True)),
        rotary_percent=float(percent),
        rotary_interleaved=True,
    )


def _chatglm_spec(cfg: dict, folder: Optional[PathLike] = None) -> ModelSpec:
    nh = int(cfg["num_attention_heads"])
    groups = int(cfg["multi_query_group_num"]) if cfg.get("multi_query_attention") else nh
    return ModelSpec(
        family="chatglm",
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["ffn_hidden_size"]),
        num_layers=int(cfg["num_layers"]),
        num_heads=nh,
        num_groups=groups,
        head_dim=int(cfg.get("kv_channels") or cfg["hidden_size"] // nh),
        vocab_size=int(cfg["padded_vocab_size"]),
        norm_eps=float(cfg.get("layernorm_epsilon", 1e-5)),
        tied=False,
        qkv_bias=bool(cfg.get("add_qkv_bias", True)),
        position="rope",
        # GLM rotates the first half of each head in interleaved pairs: mcore rotary_percent=0.5 + interleaved.
        rotary_base=10000.0 * float(cfg.get("rope_ratio", 1.0)),
        rotary_percent=0.5,
        rotary_interleaved=True,
        max_position_embeddings=int(cfg.get("seq_length", 8192)),
    )


# Names the Baichuan2 modeling files define (facts of baichuan-inc's published modeling_baichuan.py): 7B's RoPE
# (`RotaryEmbedding`, `rotate_half`, `apply_rotary_pos_emb`), 13B's ALiBi (`_get_interleave` slopes, `_gen_alibi_mask`,
# `BaichuanModel.get_alibi_mask`).
_ROPE_NAMES = ("RotaryEmbedding", "rotate_half", "apply_rotary_pos_emb")
_ALIBI_NAMES = ("_get_interleave", "_gen_alibi_mask", "get_alibi_mask", "_buffered_future_mask")


def _modeling_file(cfg: dict, folder: Optional[PathLike]) -> Optional[Path]:
    """The folder's own modeling code: auto_map's module for AutoModelForCausalLM, else modeling_baichuan.py; None when
    there is no folder, or auto_map names another repository's code (`repo--module.Class`) and no file is here."""
    if folder is None:
        return None
    target = (cfg.get("auto_map") or {}).get("AutoModelForCausalLM") or ""
    module = target.rsplit(".", 1)[0] if target and "--" not in target else "modeling_baichuan"
    path = Path(folder) / f"{module}.py"
    return path if path.is_file() else None


def _defined_names(path: Path) -> set:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(
            f"{path} is not readable Python ({type(exc).__name__}: {exc}); the kit reads it to tell Baichuan2's "
            f"RoPE (7B) from ALiBi (13B): copy the model's own modeling_baichuan.py again."
        ) from None
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {node.name for node in ast.walk(tree) if isinstance(node, kinds)}


def baichuan_position(cfg: dict, folder: Optional[PathLike] = None) -> Tuple[str, str]:
    """("rope" | "alibi", why) of a Baichuan2 model: the one rule convert, verify and the preflight share.

    The modeling code that ships with the checkpoint decides (it is what transformers runs with trust_remote_code):
    one that defines the RoPE functions is 7B-style, one that defines the ALiBi mask is 13B-style; one with both or
    neither is refused. Without a modeling file (a bare config dict, or auto_map pointing at another repository) the
    fallback is the released sizes: hidden_size 4096 is Baichuan2-7B (RoPE), anything else ALiBi.
    """
    path = _modeling_file(cfg, folder)
    if path is None:
        h = int(cfg["hidden_size"])
        if h == 4096:
            return (
                "rope",
                "no modeling file beside config.json: hidden_size 4096 taken as Baichuan2-7B's RoPE",
            )
        return (
            "alibi",
            f"no modeling file beside config.json: hidden_size {h} is not Baichuan2-7B's 4096, so ALiBi",
        )
    names = _defined_names(path)
    rope = sorted(n for n in names if n in _ROPE_NAMES)
    alibi = sorted(n for n in names if n in _ALIBI_NAMES)
    if rope and not alibi:
        return "rope", f"{path.name} defines {', '.join(rope)}: Baichuan2-7B's RoPE"
    if alibi and not rope:
        return "alibi", f"{path.name} defines {', '.join(alibi)}: Baichuan2-13B's ALiBi"
    found = (
        f"both RoPE ({', '.join(rope)}) and ALiBi ({', '.join(alibi)}) code"
        if rope
        else "neither RoPE nor ALiBi code"
    )
    raise InputError(
        f"{path} defines {found}, so the kit cannot tell which position encoding this Baichuan model was trained "
        f"with; put the model's own modeling file there (Baichuan2-7B's defines {_ROPE_NAMES[0]}, 13B's "
        f"{_ALIBI_NAMES[1]})."
    )


def _baichuan_spec(cfg: dict, folder: Optional[PathLike] = None) -> ModelSpec:
    nh, h = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    return ModelSpec(
        family="baichuan",
        hidden_size=h,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=nh,
        num_groups=nh,
        head_dim=h // nh,
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=False,
        # 7B RoPE, 13B ALiBi (which only MindSpeed/ModelLink can train): the folder's modeling code decides
        position=baichuan_position(cfg, folder)[0],
        rotary_base=10000.0,
        rotary_percent=1.0,
        rotary_interleaved=False,
        max_position_embeddings=int(cfg.get("model_max_length", 4096)),
        norm_head=True,
    )


def position_reason(family: str, cfg: dict, folder: Optional[PathLike] = None) -> str:
    """Why the family's position encoding is what it is, when a rule (not the architecture) decided it; else ''."""
    return baichuan_position(cfg, folder)[1] if family == "baichuan" else ""


_LLAMA_LAYER = {
    "input_norm": ("input_layernorm.weight",),
    "qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "proj.weight": ("self_attn.o_proj.weight",),
    "post_norm": ("post_attention_layernorm.weight",),
    "fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "fc2.weight": ("mlp.down_proj.weight",),
}

LLAMA = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2"),
    read_config=_llama_spec,
    global_keys={
        "embedding": ("model.embed_tokens.weight",),
        "final_norm": ("model.norm.weight",),
        "output": ("lm_head.weight",),
    },
    layer_prefix="model.layers.{i}.",
    layer_keys=_LLAMA_LAYER,
    ignore_suffixes=("rotary_emb.inv_freq",),
    notes="Llama-2/3.x (MHA, GQA; llama3 rope_scaling), Mistral, Qwen2/Qwen2.5 (q/k/v bias): one map.",
)

QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    read_config=_qwen3_spec,
    global_keys=LLAMA.global_keys,
    layer_prefix="model.layers.{i}.",
    layer_keys=dict(_LLAMA_LAYER, q_norm=("self_attn.q_norm.weight",), k_norm=("self_attn.k_norm.weight",)),
    ignore_suffixes=("rotary_emb.inv_freq",),
    notes="Qwen3 dense: the Llama map + per-head q/k RMSNorm (replicated over TP), head_dim from config.",
)

QWEN3_MOE = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    read_config=_qwen3_moe_spec,
    global_keys=LLAMA.global_keys,
    layer_prefix="model.layers.{i}.",
    layer_keys=dict(
        QWEN3.layer_keys,
        **{
            "router.weight": ("mlp.gate.weight",),
            # the on-disk per-expert keys (transformers 5 fuses them in memory only)
            "expert.fc1.weight": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
            "expert.fc2.weight": ("mlp.experts.{e}.down_proj.weight",),
        },
    ),
    ignore_suffixes=("rotary_emb.inv_freq",),
    notes="Qwen3-MoE: Qwen3 attention + router and per-expert SwiGLU MLPs (no shared expert); EP over experts.",
)

# the DeepSeek-V3 MoE block and MTP layer on disk (published checkpoints: per-expert keys; the MTP layer
# model.layers.{num_hidden_layers} with its own copies of the embedding and head, which transformers does not load)
_ROUTED_MOE_LAYER = {
    "router.weight": ("mlp.gate.weight",),
    "router.expert_bias": ("mlp.gate.e_score_correction_bias",),
    "shared.fc1.weight": ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "shared.fc2.weight": ("mlp.shared_experts.down_proj.weight",),
    "expert.fc1.weight": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
    "expert.fc2.weight": ("mlp.experts.{e}.down_proj.weight",),
    "mtp.enorm": ("enorm.weight",),
    "mtp.hnorm": ("hnorm.weight",),
    "mtp.eh_proj": ("eh_proj.weight",),
    "mtp.final_norm": ("shared_head.norm.weight",),
    "mtp.embedding": ("embed_tokens.weight",),
    "mtp.output": ("shared_head.head.weight",),
}

GLM4_MOE = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    read_config=_glm4_moe_spec,
    global_keys=LLAMA.global_keys,
    layer_prefix="model.layers.{i}.",
    layer_keys=dict(QWEN3.layer_keys, **_ROUTED_MOE_LAYER),
    ignore_suffixes=("rotary_emb.inv_freq",),
    notes="GLM-4.5 / 4.5-Air: GQA + q/k/v bias (+ q/k norm), half-dim rotate_half RoPE, sigmoid-routed experts "
    "with a score bias, a shared expert, dense first layers, one MTP layer.",
)

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    read_config=_deepseek3_spec,
    global_keys=LLAMA.global_keys,
    layer_prefix="model.layers.{i}.",
    layer_keys=dict(
        _LLAMA_LAYER,
        **{
            "mla.q_down": ("self_attn.q_a_proj.weight",),
            "mla.q_norm": ("self_attn.q_a_layernorm.weight",),
            "mla.q_up": ("self_attn.q_b_proj.weight",),
            "mla.q": ("self_attn.q_proj.weight",),
            "mla.kv_down": ("self_attn.kv_a_proj_with_mqa.weight",),
            "mla.kv_norm": ("self_attn.kv_a_layernorm.weight",),
            "mla.kv_up": ("self_attn.kv_b_proj.weight",),
        },
        **_ROUTED_MOE_LAYER,
    ),
    ignore_suffixes=("rotary_emb.inv_freq",),
    notes="DeepSeek-V3 (and V2-Lite's q_proj layout): multi-head latent attention, sigmoid-routed experts with a "
    "score bias in groups, a shared expert, dense first layers, one MTP layer.",
)

GLM = Family(
    name="glm",
    model_types=("glm",),
    read_config=_glm_spec,
    global_keys=LLAMA.global_keys,
    layer_prefix="model.layers.{i}.",
    layer_keys=dict(_LLAMA_LAYER, **{"fc1.weight": ("mlp.gate_up_proj.weight",) * 2}),
    ignore_suffixes=("rotary_emb.inv_freq",),
    notes="GLM-4 HF-native (GLM-4-9B-chat-hf): q/k/v bias, fused [gate;up], half-dim interleaved RoPE.",
)

CHATGLM = Family(
    name="chatglm",
    model_types=("chatglm",),
    read_config=_chatglm_spec,
    global_keys={
        "embedding": ("transformer.embedding.word_embeddings.weight",),
        "final_norm": ("transformer.encoder.final_layernorm.weight",),
        "output": ("transformer.output_layer.weight",),
    },
    layer_prefix="transformer.encoder.layers.{i}.",
    layer_keys={
        "input_norm": ("input_layernorm.weight",),
        "qkv.weight": ("self_attention.query_key_value.weight",) * 3,
        "qkv.bias": ("self_attention.query_key_value.bias",) * 3,
        "proj.weight": ("self_attention.dense.weight",),
        "post_norm": ("post_attention_layernorm.weight",),
        "fc1.weight": ("mlp.dense_h_to_4h.weight",) * 2,
        "fc2.weight": ("mlp.dense_4h_to_h.weight",),
    },
    ignore_suffixes=("rotary_pos_emb.inv_freq",),
    notes="ChatGLM3: fused [Q;K;V] with multi-query groups and bias, fused [gate;up], half-dim interleaved RoPE.",
    extra={"auto_model": "AutoModel"},
)

BAICHUAN = Family(
    name="baichuan",
    model_types=("baichuan",),
    read_config=_baichuan_spec,
    global_keys={
        "embedding": ("model.embed_tokens.weight",),
        "final_norm": ("model.norm.weight",),
        "output": ("lm_head.weight",),
    },
    layer_prefix="model.layers.{i}.",
    layer_keys=dict(_LLAMA_LAYER, **{"qkv.weight": ("self_attn.W_pack.weight",) * 3}),
    notes="Baichuan2: W_pack = [Q;K;V]; NormHead lm_head normalised at conversion; 13B ALiBi is MindSpeed-only.",
)

FAMILIES = {f.name: f for f in (LLAMA, QWEN3, QWEN3_MOE, GLM4_MOE, DEEPSEEK_V3, GLM, CHATGLM, BAICHUAN)}
# ModelLink 1.0 `util.py --loader` names (the ModelArts user manual's conversion command) and their families.
LOADER_ALIASES = {
    "llama2_hf": "llama",
    "llama_hf": "llama",
    "mistral_hf": "llama",
    "qwen2_hf": "llama",
    "chatglm3_hf": "chatglm",
    "baichuan2_hf": "baichuan",
    # MindSpeed-LLM convert_ckpt_v2.py --model-type-hf names
    "glm45": "glm4_moe",
    "glm45-air": "glm4_moe",
    "deepseek3": "deepseek_v3",
    "deepseek2": "deepseek_v3",
    "deepseek2-lite": "deepseek_v3",
    "hf": None,
}


def family_for_config(cfg: dict, name: str = None) -> Family:
    """The family named (`llama`, `qwen3`, `qwen3_moe`, `glm`, `chatglm`, `baichuan` or a util.py loader name) or else the one of cfg's model_type."""
    if name:
        name = LOADER_ALIASES.get(name, name)
    if name:
        if name not in FAMILIES:
            loaders = sorted(k for k, v in LOADER_ALIASES.items() if v)
            raise InputError(t("family.unknown", name=name, known=sorted(FAMILIES), loaders=loaders))
        return FAMILIES[name]
    model_type = cfg.get("model_type", "")
    for fam in FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    supported = [m for f in FAMILIES.values() for m in f.model_types]
    raise InputError(t("family.uncovered", model_type=model_type, supported=supported))
