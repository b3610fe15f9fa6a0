"""Reading a Megatron checkpoint as a conversion source: its model spec (checked against its own args), which layers
each pipeline stage holds, that every tensor is one the family map knows with the shape the config implies, and each
role's tensor merged over the TP ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Optional, Union

from kit.convert import megatron_layout as layout
from kit.convert.checks import ConversionError, role_kind
from kit.convert.families import ALIAS_ROLES, Family, family_for_config, position_reason
from kit.convert.file_slices import FileSlice
from kit.convert.hf_io import read_json
from kit.convert.megatron_io import HF_META_DIR, MegatronReader
from kit.convert.spec import ModelSpec, expert_role, group_role, split_group, split_role
from kit.convert.tensor_ops import merge_tp
from kit.convert.torch_zip import TensorRef
from kit.core.parallel import pipeline_problems, stage_layers

PathLike = Union[str, Path]


def rank_entries(
    fam: Family,
    spec: ModelSpec,
    flavor: str,
    stages: List[List[int]],
    s: int,
    ep_rank: int = 0,
    ep: int = 1,
    grouped: str = "",
):
    """(key path, source role, global layer) of every tensor in the rank file of stage s and EP rank ep_rank, in
    writing order. Every EP rank holds the dense tensors and the router; its experts are the contiguous run
    layout.local_experts names, keyed by their local index (grouped "te": TEGroupedMLP names), or, grouped
    "legacy", one group role per MoE layer for fc1 and for fc2 (GroupedMLP weight1 / weight2)."""
    pp = len(stages)
    mine = layout.local_experts(spec.num_experts, ep, ep_rank) if spec.num_experts else range(0)
    te_grouped = grouped == "te"

    def layer_entries(g: int, local: Optional[int], mtp: Optional[int]):
        moe = spec.is_moe_layer(g)
        for role in fam.layer_roles(spec, g):
            if role in ALIAS_ROLES:  # the MTP layer's embedding / head: the model's own tensors
                continue
            base, e = split_role(role)
            if e is not None and grouped == "legacy":
                if e == mine.start:  # the group stands for all of this rank's experts
                    for part in ("fc1.weight", "fc2.weight"):
                        group = group_role(mine.start, len(mine), part)
                        yield layout.key_path(flavor, group, local, moe, mtp=mtp), group, g
                continue
            if e is not None:
                if e not in mine:
                    continue
                key_role = expert_role(e - mine.start, base.split(".", 1)[1])
            else:
                key_role = role
            yield layout.key_path(flavor, key_role, local, moe, te_grouped, mtp), role, g

    if s == 0:
        yield layout.key_path(flavor, "embedding"), "embedding", None
    for local, g in enumerate(stages[s]):
        yield from layer_entries(g, local, None)
    if s == pp - 1:
        yield layout.key_path(flavor, "final_norm"), "final_norm", None
        if not spec.tied:
            yield layout.key_path(flavor, "output"), "output", None
        elif pp > 1:  # the last stage holds its own copy of a tied embedding
            yield layout.key_path(flavor, "tied_head"), "embedding", None
        for m in range(spec.mtp_num_layers):  # megatron-core builds the MTP block on the last stage
            yield from layer_entries(spec.num_layers + m, None, m)


def rank_elements(spec: ModelSpec, role: str, tp: int, padded_vocab: int) -> int:
    """Elements of TP rank r's part of a role, as read_rank cuts it (the same for every r)."""
    group = split_group(role)
    if group is not None:  # GroupedMLP: this rank's experts in one tensor
        which, experts = group
        return len(experts) * rank_elements(spec, expert_role(experts[0], which), tp, padded_vocab)
    shape = spec.full_shape(role)
    whole = 1
    for n in shape:
        whole *= n
    kind = role_kind(role)
    if kind == "replicated":
        return whole
    if kind == "vocab":
        return padded_vocab // tp * (whole // shape[0])
    return whole // tp


# a rank file's bytes beyond its tensors' (torch zip: each tensor's record, zip headers and 64-byte alignment; the
# file's pickled args), measured on the kit's own files: an upper bound for both, so the estimate never falls short
TENSOR_FRAMING, FILE_FRAMING = 400, 16 << 10


def layout_bytes(
    fam: Family,
    spec: ModelSpec,
    flavor: str,
    stages: List[List[int]],
    tp: int,
    ep: int,
    padded_vocab: int,
    itemsize: int,
    grouped: str = "",
) -> int:
    """Bytes the rank files of a TP x PP x EP layout take: every tensor each file holds (EP ranks repeat the dense
    tensors and the router, TP ranks the norms their kind replicates, the last stage a tied embedding) and framing."""
    total = 0
    for s in range(len(stages)):
        for e in range(ep):
            entries = [role for _, role, _ in rank_entries(fam, spec, flavor, stages, s, e, ep, grouped)]
            tensors = sum(rank_elements(spec, role, tp, padded_vocab) for role in entries) * itemsize
            total += tp * (tensors + len(entries) * TENSOR_FRAMING + FILE_FRAMING)
    return total


def source_spec(mr: MegatronReader, hf_config_dir: Optional[PathLike], family: Optional[str]) -> tuple:
    """Family and spec of a Megatron checkpoint: from its hf_meta/ (kit-made) or an HF config folder, checked
    against every dimension the checkpoint's own args state."""
    cfg_dir = Path(hf_config_dir) if hf_config_dir else mr.folder / HF_META_DIR
    if not (cfg_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"no HF config.json at {cfg_dir}; this checkpoint was not made by the kit. Pass "
            f"hf_config_dir (--hf-config-dir) = the original HF model folder of this model."
        )
    hf_cfg = read_json(cfg_dir / "config.json")
    fam = family_for_config(hf_cfg, family or (mr.meta or {}).get("family"))
    spec = fam.read_config(hf_cfg, cfg_dir)
    a = mr.args
    groups = getattr(a, "num_query_groups", None) if getattr(a, "group_query_attention", True) else None
    if groups is None and getattr(a, "group_query_attention", None) is False:
        groups = getattr(a, "num_attention_heads", None)  # Megatron ignores num_query_groups without GQA
    wanted = (
        ("num_layers", getattr(a, "num_layers", None), spec.num_layers),
        ("hidden_size", getattr(a, "hidden_size", None), spec.hidden_size),
        ("ffn_hidden_size", getattr(a, "ffn_hidden_size", None), spec.ffn_hidden_size),
        ("num_attention_heads", getattr(a, "num_attention_heads", None), spec.num_heads),
        ("num_query_groups (KV heads)", groups, spec.num_groups),
        ("kv_channels (head_dim)", getattr(a, "kv_channels", None), spec.head_dim),
        ("add_qkv_bias", getattr(a, "add_qkv_bias", None), spec.qkv_bias),
        ("qk_layernorm", getattr(a, "qk_layernorm", None), spec.qk_norm),
        ("num_experts", getattr(a, "num_experts", None), spec.num_experts or None),
        (
            "moe_ffn_hidden_size",
            getattr(a, "moe_ffn_hidden_size", None) if spec.num_experts else None,
            spec.moe_ffn_hidden_size,
        ),
        (
            "moe_router_topk",
            getattr(a, "moe_router_topk", None) if spec.num_experts else None,
            spec.moe_router_topk,
        ),
        (
            "moe_shared_expert_intermediate_size",
            getattr(a, "moe_shared_expert_intermediate_size", None) if spec.num_experts else None,
            spec.moe_shared_expert_intermediate_size or None,
        ),
        ("mtp_num_layers", getattr(a, "mtp_num_layers", None), spec.mtp_num_layers or None),
        *(
            (name, getattr(a, name, None), getattr(spec, name) or None)
            for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
            if spec.multi_latent_attention
        ),
        (
            "untie_embeddings_and_output_weights",
            getattr(a, "untie_embeddings_and_output_weights", None),
            not spec.tied,
        ),
    )
    wrong = [
        f"{name}: checkpoint args say {have}, {cfg_dir}/config.json implies {want}"
        for name, have, want in wanted
        if have is not None and have != want
    ]
    position = getattr(
        a, "position_embedding_type", None
    )  # older Megatron-LM says learned_absolute beside RoPE
    if position in ("rope", "alibi") and position != spec.position:
        why = position_reason(fam.name, hf_cfg, cfg_dir)
        wrong.append(
            f"position_embedding_type: checkpoint args say {position}, {cfg_dir} implies {spec.position}"
            + (f" ({why})" if why else "")
        )
    padded = getattr(a, "padded_vocab_size", None)
    if padded is not None and padded < spec.vocab_size:
        wrong.append(
            f"padded_vocab_size: checkpoint args say {padded}, fewer than the vocabulary {spec.vocab_size} "
            f"of {cfg_dir}/config.json"
        )
    if wrong:
        raise ConversionError(wrong, f"Megatron checkpoint {mr.folder} vs its HF config")
    return fam, spec, cfg_dir


def rank_shape(spec: ModelSpec, role: str, tp: int) -> Optional[tuple]:
    """The shape one TP rank holds of a role (None: the vocabulary rows, checked in total)."""
    group = split_group(role)
    if group is not None:  # GroupedMLP weight1 [h, n x 2f/TP] / weight2 [n x f/TP, h]
        n, f, h = len(group[1]), spec.moe_ffn_hidden_size // tp, spec.hidden_size
        return (h, n * 2 * f) if group[0] == "fc1.weight" else (n * f, h)
    full, kind = spec.full_shape(role if role != "tied_head" else "embedding"), role_kind(role)
    if kind == "replicated":
        return full
    if kind == "row":
        return (full[0], full[1] // tp)
    if kind == "vocab":
        return None
    return (full[0] // tp, *full[1:])


def _rank_file_problems(
    mr: MegatronReader,
    fam: Family,
    spec: ModelSpec,
    stages: List[List[int]],
    entries: list,
    r: int,
    s: int,
    e: int,
) -> List[str]:
    """Unknown, missing and misshapen tensors of one rank file against the entries it should hold."""
    problems = []
    known = {".".join(kp) for kp, _, _ in entries}
    flat = layout.flatten(mr.refs(r, s, e))
    where = layout.rank_dir(r, s, mr.pp, e, mr.ep)
    for key in sorted(set(flat) - known):
        if key.endswith("_extra_state") or not isinstance(flat[key], TensorRef):
            continue  # TE/fp8 metadata, no weights
        problems.append(
            f"{where}: tensor {key!r} is not in the {fam.name} map "
            f"({mr.flavor} key names); it would be dropped. Is the family or the config right?"
        )
    missing = sorted(known - set(flat))
    if missing:
        problems.append(
            f"{where}: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} (layers per stage {[len(x) for x in stages]})"
        )
    for kp, role, _ in entries:
        ref, want = flat.get(".".join(kp)), rank_shape(spec, role, mr.tp)
        if not isinstance(ref, TensorRef):
            continue
        if want is None:
            want_rest = (spec.hidden_size,)
            if ref.shape[1:] != want_rest:
                problems.append(
                    f"{where}: {'.'.join(kp)} has rows of {list(ref.shape[1:])}, the config "
                    f"implies {list(want_rest)} (hidden_size)"
                )
        elif ref.shape != want:
            problems.append(
                f"{where}: {'.'.join(kp)} has shape {list(ref.shape)}, the HF config implies {list(want)} "
                f"at TP{mr.tp}; config and checkpoint do not belong together"
            )
    return problems


def check_megatron_keys(mr: MegatronReader, fam: Family, spec: ModelSpec, stages: List[List[int]]) -> None:
    """Every tensor in every rank file must be one the map knows, with the shape the config implies for this TP:
    nothing is dropped silently and a config that does not match the weights is an error, not a wrong model."""
    problems = []
    for s in range(mr.pp):
        for e in range(mr.ep):
            entries = list(rank_entries(fam, spec, mr.flavor, stages, s, e, mr.ep, mr.grouped_gemm))
            for r in range(mr.tp):
                problems += _rank_file_problems(mr, fam, spec, stages, entries, r, s, e)
    if problems:
        raise ConversionError(problems, f"Megatron checkpoint {mr.folder}")


def stages_of(mr: MegatronReader, spec: ModelSpec) -> List[List[int]]:
    stages = stage_layers(spec.num_layers, mr.pp, mr.layer_list(spec.num_layers))
    problems = pipeline_problems(spec.num_layers, mr.pp, [len(x) for x in stages] or None)
    if problems:
        raise ConversionError(problems, f"Megatron checkpoint {mr.folder}")
    return stages


def locate(
    mr: MegatronReader,
    stages: List[List[int]],
    role: str,
    layer: Optional[int],
    spec: Optional[ModelSpec] = None,
) -> tuple:
    """(stage, key path, EP rank) of a role's tensor: an expert's EP rank and local index from its global index,
    every other tensor from EP rank 0 (the EP ranks hold the same dense tensors)."""
    role = ALIAS_ROLES.get(role, role)  # the MTP layer's embedding / head are the model's
    if role in ("embedding", "output"):
        layer = None
    if layer is None or layer < 0:
        return (0 if role == "embedding" else mr.pp - 1), layout.key_path(mr.flavor, role), 0
    mtp = layer - spec.num_layers if spec is not None and spec.is_mtp_layer(layer) else None
    if mtp is not None:
        s, local = mr.pp - 1, None
    else:
        where = {g: (s, i) for s, layers in enumerate(stages) for i, g in enumerate(layers)}
        s, local = where[layer]
    moe = spec is not None and spec.is_moe_layer(layer)
    base, e = split_role(role)
    ep_rank = 0
    if e is not None:
        per = spec.num_experts // mr.ep
        ep_rank, role = e // per, expert_role(e % per, base.split(".", 1)[1])
        if mr.grouped_gemm == "legacy":
            role = group_role(ep_rank * per, per, base.split(".", 1)[1])
    return s, layout.key_path(mr.flavor, role, local, moe, mr.grouped_gemm == "te", mtp), ep_rank


def role_pieces(
    mr: MegatronReader, stages: List[List[int]], role: str, layer: Optional[int], spec: ModelSpec
) -> tuple:
    """(stage, key path, EP rank, the TP ranks' pieces) of a role's tensor: byte ranges on disk, or for an expert
    of a GroupedMLP checkpoint its block cut out of weight1 / weight2 (a tensor; only that block is read)."""
    s, path, e = locate(mr, stages, role, layer, spec)
    pieces = mr.pieces(path, s, e)
    base, k = split_role(role)
    if k is not None and mr.grouped_gemm == "legacy":
        from kit.convert.file_slices import as_tensor
        from kit.convert.tensor_ops import grouped_block

        per, part = spec.num_experts // mr.ep, base.split(".", 1)[1]
        pieces = [
            grouped_block(part, p, k % per, per)
            if isinstance(p, FileSlice)
            else _cut(as_tensor(p), part, k % per, per)
            for p in pieces
        ]
    return s, path, e, pieces


def _cut(whole, part: str, local: int, count: int):
    """Local expert `local`'s fc1 / fc2 out of a GroupedMLP tensor already in memory."""
    if part == "fc1.weight":
        return whole.reshape(count, whole.shape[0], -1)[local].T.contiguous()
    return whole.reshape(count, -1, whole.shape[1])[local].T.contiguous()


def merged_tensor_fn(
    mr: MegatronReader, spec: ModelSpec, fam: Family
) -> Callable[[str, Optional[int]], object]:
    """(role, global layer) -> the whole tensor merged over the source's TP ranks (vocab still padded)."""
    stages = stages_of(mr, spec)
    check_megatron_keys(mr, fam, spec, stages)

    def full(role: str, layer: Optional[int]):
        _, path, _, pieces = role_pieces(mr, stages, role, layer, spec)
        from kit.convert.file_slices import as_tensor

        return merge_tp(role_kind(role), [as_tensor(p) for p in pieces], what=".".join(path))

    return full


def same_bytes(parts: List[FileSlice]) -> bool:
    first = os.pread(parts[0].fd, parts[0].nbytes, parts[0].offset)
    return all(os.pread(p.fd, p.nbytes, p.offset) == first for p in parts[1:])
