"""Reading a Megatron checkpoint as a conversion source: its model spec (checked against its own args), which layers
each pipeline stage holds, that every tensor is one the family map knows with the shape the config implies, and each
role's tensor merged over the TP ranks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Optional, Union

from kit.convert import megatron_layout as layout
from kit.convert.checks import ConversionError, role_kind
from kit.convert.families import Family, family_for_config, position_reason
from kit.convert.file_slices import FileSlice
from kit.convert.hf_io import read_json
from kit.convert.megatron_io import HF_META_DIR, MegatronReader
from kit.convert.spec import ModelSpec
from kit.convert.tensor_ops import merge_tp
from kit.convert.torch_zip import TensorRef
from kit.parallel import pipeline_problems, stage_layers

PathLike = Union[str, Path]


def rank_entries(layer_roles: List[str], spec: ModelSpec, flavor: str, stages: List[List[int]], s: int):
    """(key path, source role, global layer) of every tensor in a stage-s rank file, in writing order."""
    pp = len(stages)
    if s == 0:
        yield layout.key_path(flavor, "embedding"), "embedding", None
    for local, g in enumerate(stages[s]):
        for role in layer_roles:
            yield layout.key_path(flavor, role, local), role, g
    if s == pp - 1:
        yield layout.key_path(flavor, "final_norm"), "final_norm", None
        if not spec.tied:
            yield layout.key_path(flavor, "output"), "output", None
        elif pp > 1:  # the last stage holds its own copy of a tied embedding
            yield layout.key_path(flavor, "tied_head"), "embedding", None


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
    full, kind = spec.full_shape(role if role != "tied_head" else "embedding"), role_kind(role)
    if kind == "replicated":
        return full
    if kind == "row":
        return (full[0], full[1] // tp)
    if kind == "vocab":
        return None
    return (full[0] // tp, *full[1:])


def check_megatron_keys(mr: MegatronReader, fam: Family, spec: ModelSpec, stages: List[List[int]]) -> None:
    """Every tensor in every rank file must be one the map knows, with the shape the config implies for this TP:
    nothing is dropped silently and a config that does not match the weights is an error, not a wrong model."""
    _, layer_roles = fam.roles(spec)
    problems = []
    for s in range(mr.pp):
        entries = list(rank_entries(layer_roles, spec, mr.flavor, stages, s))
        known = {".".join(kp) for kp, _, _ in entries}
        for r in range(mr.tp):
            flat = layout.flatten(mr.refs(r, s))
            where = layout.rank_dir(r, s, mr.pp)
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
    if problems:
        raise ConversionError(problems, f"Megatron checkpoint {mr.folder}")


def stages_of(mr: MegatronReader, spec: ModelSpec) -> List[List[int]]:
    stages = stage_layers(spec.num_layers, mr.pp, mr.layer_list(spec.num_layers))
    problems = pipeline_problems(spec.num_layers, mr.pp, [len(x) for x in stages] or None)
    if problems:
        raise ConversionError(problems, f"Megatron checkpoint {mr.folder}")
    return stages


def locate(mr: MegatronReader, stages: List[List[int]], role: str, layer: Optional[int]) -> tuple:
    """(stage, key path) of a role's tensor."""
    if layer is None or layer < 0:
        return (0 if role == "embedding" else mr.pp - 1), layout.key_path(mr.flavor, role)
    where = {g: (s, i) for s, layers in enumerate(stages) for i, g in enumerate(layers)}
    s, local = where[layer]
    return s, layout.key_path(mr.flavor, role, local)


def merged_tensor_fn(
    mr: MegatronReader, spec: ModelSpec, fam: Family
) -> Callable[[str, Optional[int]], object]:
    """(role, global layer) -> the whole tensor merged over the source's TP ranks (vocab still padded)."""
    stages = stages_of(mr, spec)
    check_megatron_keys(mr, fam, spec, stages)

    def full(role: str, layer: Optional[int]):
        s, path = locate(mr, stages, role, layer)
        return merge_tp(role_kind(role), mr.parts(path, s), what=".".join(path))

    return full


def same_bytes(parts: List[FileSlice]) -> bool:
    first = os.pread(parts[0].fd, parts[0].nbytes, parts[0].offset)
    return all(os.pread(p.fd, p.nbytes, p.offset) == first for p in parts[1:])
