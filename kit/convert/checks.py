"""Checks made before any byte is written: tensors vs config, TP/PP vs the model, free disk space."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from kit.convert.families import ROLE_KIND, Family
from kit.convert.spec import ModelSpec, split_role
from kit.convert.tensor_ops import part_offsets
from kit.core.parallel import parallel_problems
from kit.errors import KitError


class ConversionError(KitError, ValueError):
    """A checkpoint or a requested layout that cannot be converted; lists every problem found."""

    def __init__(self, problems: Iterable[str], where: str = "conversion"):
        self.problems = list(problems)
        shown = self.problems[:25]
        more = len(self.problems) - len(shown)
        lines = "\n".join(f"  - {p}" for p in shown) + (f"\n  - ... and {more} more" if more > 0 else "")
        super().__init__(f"{len(self.problems)} problem(s) in {where}:\n{lines}")


def expected_hf_shapes(fam: Family, spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """Every HF key the family map expects for this spec, with its shape."""
    out: Dict[str, Tuple[int, ...]] = {}
    glob, _ = fam.roles(spec)
    items = [(r, -1) for r in glob] + [
        (r, i) for i in range(spec.all_layers) for r in fam.layer_roles(spec, i)
    ]
    for role, i in items:
        keys, rows = fam.hf_keys(role, i), fam.part_rows(spec, role)
        rest = spec.full_shape(role)[1:]
        for key, off, n in zip(keys, part_offsets(keys, rows), rows):
            prev = out.get(key, (0,))
            out[key] = (max(prev[0], off + n), *rest)
    return out


def hf_problems(fam: Family, spec: ModelSpec, shapes: Dict[str, Tuple[int, ...]]) -> List[str]:
    """Missing keys, unknown keys (never dropped silently) and shapes that contradict config.json."""
    expected = expected_hf_shapes(fam, spec)
    problems = []
    ignorable = set()
    if spec.tied:  # some tied checkpoints still store lm_head; it is the embedding, so it may go
        ignorable.update(fam.hf_keys("output"))
    for key in sorted(set(expected) - set(shapes)):
        problems.append(f"tensor {key!r} (shape {list(expected[key])}) is missing from the checkpoint.")
    for key in sorted(set(shapes) - set(expected)):
        if key in ignorable or key.endswith(fam.ignore_suffixes):
            continue
        problems.append(
            f"tensor {key!r} is not in the {fam.name} key map; it would be dropped. Check the family "
            f"(config model_type) or remove the tensor if it is not a model weight."
        )
    for key in sorted(set(expected) & set(shapes)):
        if tuple(shapes[key]) != tuple(expected[key]):
            problems.append(
                f"tensor {key!r} has shape {list(shapes[key])} but config.json implies "
                f"{list(expected[key])} (hidden {spec.hidden_size}, heads {spec.num_heads}, groups "
                f"{spec.num_groups}, head_dim {spec.head_dim}, ffn {spec.ffn_hidden_size}, vocab "
                f"{spec.vocab_size}{_moe_note(spec)}); config and weights do not belong together."
            )
    return problems


def _moe_note(spec: ModelSpec) -> str:
    if not spec.num_experts:
        return ""
    return f", {spec.num_experts} experts of ffn {spec.moe_ffn_hidden_size}"


def layout_plan_problems(
    spec: ModelSpec,
    tp: int,
    pp: int,
    layer_list: Optional[Sequence[int]],
    padded_vocab: int,
    flavor: str = "local",
    ep: int = 1,
    grouped_gemm: bool = False,
) -> List[str]:
    """Why a TP x PP x EP layout does not fit this model, if it does not (the rules of kit/core/parallel.py), or why the
    key flavor cannot hold it (legacy Megatron has no q/k layernorm and no MoE)."""
    problems = parallel_problems(
        spec.facts(), tp, pp, layer_list, padded_vocab=padded_vocab, flavor=flavor, ep=ep
    )
    if spec.qk_norm and flavor == "legacy":
        problems.append(
            f"flavor 'legacy' has no q/k layernorm for this {spec.family} model's q_norm/k_norm; use flavor "
            f"'local' (megatron-core, what MindSpeed-LLM trains with --use-mcore-models) or 'te'."
        )
    if spec.num_experts and flavor == "legacy":
        problems.append(
            f"flavor 'legacy' has no MoE layers for this {spec.family} model; use 'local' or 'te'."
        )
    if spec.multi_latent_attention and flavor != "local":
        problems.append(
            f"flavor {flavor!r} for multi-head latent attention: the kit writes MLA in megatron-core's local spec "
            f"names only; use flavor 'local'."
        )
    if spec.multi_latent_attention:  # the column-parallel MLA projections split their output rows over TP
        for what, rows in (
            ("q_lora_rank", spec.q_lora_rank),
            ("kv_lora_rank + qk_rope_head_dim", spec.kv_lora_rank + spec.qk_pos_emb_head_dim),
        ):
            if rows and rows % tp:
                problems.append(
                    f"TP {tp} does not divide {what} {rows} (megatron-core's local MLA splits that projection's "
                    f"rows over TP); use a TP that divides it."
                )
    if grouped_gemm and not spec.num_experts:
        problems.append("moe_grouped_gemm is set but this model has no experts; leave it False.")

    return problems


def role_kind(role: str) -> str:
    return ROLE_KIND["embedding" if role == "tied_head" else split_role(role)[0]]
