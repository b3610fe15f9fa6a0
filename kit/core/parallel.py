"""Tensor / pipeline parallel rules in one place: which TP and PP sizes fit a model, how layers are split over
pipeline stages, and how Megatron pads the vocabulary.

Weight conversion (kit/convert) and the Megatron command builder (kit/train/megatron.py) both ask these functions,
so a layout the converter writes is a layout training accepts, and the other way round. Every function takes plain
model facts (integers), the same names the `model` field of a converted-checkpoint manifest holds
(`kit.convert.model_facts`): num_layers, num_heads, num_kv_groups, ffn_hidden_size, vocab_size.

Sources of the rules (Megatron-LM core_v0.x, `megatron/training/arguments.py` and
`megatron/core/transformer/attention.py`; MindSpeed-LLM `--num-layer-list`):
- TP divides the attention heads and the FFN hidden size (each rank holds whole heads and an equal FFN slice);
- KV groups: Megatron legacy and older megatron-core need num_query_groups divisible by TP; megatron-core >= 0.16
  also accepts TP a multiple of the groups (each group's K/V rows are then replicated over TP / groups ranks);
- the padded vocabulary is a multiple of make_vocab_size_divisible_by x TP (`_vocab_size_with_padding`), or an
  explicit --padded-vocab-size divisible by TP;
- PP: every stage needs a layer; an uneven split is an explicit per-stage list (MindSpeed-LLM `--num-layer-list`,
  e.g. `7,8,8,7` for 30 layers on 4 stages) of PP positive counts summing to the layers.
- EP (mixture-of-experts models): EP divides the number of experts (each EP rank holds num_experts / EP whole
  experts; megatron-core moe_layer.py); expert TP is TP (megatron-core 0.16 ModelParallelConfig:
  expert_tensor_parallel_size None -> tensor_model_parallel_size), so TP also divides the experts' FFN width; and
  on a world of W ranks (megatron-core 0.16.1 parallel_state.initialize_model_parallel): W divisible by TP x PP
  (x CP; DP = W / (TP x PP)), and W divisible by expert-TP x EP x PP, i.e. EP x expert-TP divides the DP x TP
  ranks of one pipeline stage: EP lives inside data parallelism.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

# Key-name flavors whose KV-group rule is the strict one (groups divisible by TP).
STRICT_KV_FLAVORS = ("legacy",)
FACT_NAMES = ("num_layers", "num_heads", "num_kv_groups", "ffn_hidden_size", "vocab_size")


def padded_vocab_size(
    vocab_size: int, tp: int, divisible_by: int = 128, explicit: Optional[int] = None
) -> int:
    """Megatron's padded vocabulary: `explicit` if given, else vocab rounded up to a multiple of divisible_by x TP."""
    if explicit:
        return int(explicit)
    multiple = int(divisible_by) * int(tp)
    return -(-int(vocab_size) // multiple) * multiple


def kv_groups_fit(num_kv_groups: int, tp: int, flavor: str = "local") -> bool:
    """True when TP fits the KV groups: groups divisible by TP, or (megatron-core flavors) TP a multiple of them."""
    if num_kv_groups % tp == 0:
        return True
    return flavor not in STRICT_KV_FLAVORS and tp % num_kv_groups == 0


def tp_candidates(
    num_heads: int,
    ffn_hidden_size: int,
    num_kv_groups: int,
    flavor: str = "local",
    moe_ffn_hidden_size: int = 0,
) -> List[int]:
    """Every TP size that passes every rule at once: divides the heads, the FFN (and the experts' FFN) and fits
    the KV groups."""
    return [
        d
        for d in range(1, int(num_heads) + 1)
        if num_heads % d == 0
        and ffn_hidden_size % d == 0
        and (moe_ffn_hidden_size or 0) % d == 0
        and kv_groups_fit(num_kv_groups, d, flavor)
    ]


def tensor_parallel_problems(
    num_heads: int,
    ffn_hidden_size: int,
    num_kv_groups: int,
    tp: int,
    flavor: str = "local",
    moe_ffn_hidden_size: int = 0,
) -> List[str]:
    """Why TP does not fit the attention heads, FFN, experts' FFN (split over expert TP = TP) and KV groups (empty
    when it fits); names the sizes that do."""
    if not isinstance(tp, int) or tp < 1:
        return [f"tensor parallel size {tp!r} must be a positive integer."]
    sizes = [("attention heads", num_heads), ("FFN hidden size", ffn_hidden_size)]
    if moe_ffn_hidden_size:
        sizes.append(("experts' FFN hidden size (expert TP = TP)", moe_ffn_hidden_size))
    problems = [f"tensor parallel size {tp} does not divide the {n} {what}." for what, n in sizes if n % tp]
    if not kv_groups_fit(num_kv_groups, tp, flavor):
        rule = (
            "divisible by TP" if flavor in STRICT_KV_FLAVORS else "divisible by TP, or TP a multiple of them"
        )
        problems.append(
            f"tensor parallel size {tp} does not fit the {num_kv_groups} KV groups (num_key_value_heads must be "
            f"{rule} for flavor {flavor!r})."
        )
    if problems:  # the sizes that pass every rule at once, not one rule at a time
        problems.append(
            f"TP sizes that fit this model (every rule at once): "
            f"{tp_candidates(num_heads, ffn_hidden_size, num_kv_groups, flavor, moe_ffn_hidden_size)}."
        )
    return problems


def vocab_problems(vocab_size: int, padded_vocab: int, tp: int) -> List[str]:
    """Why a padded vocabulary cannot be split over TP ranks (smaller than the vocabulary, or not divisible)."""
    if padded_vocab < vocab_size:
        return [f"padded vocabulary {padded_vocab} is smaller than the vocabulary {vocab_size}."]
    if tp >= 1 and padded_vocab % tp:
        return [f"padded vocabulary {padded_vocab} is not divisible by tensor parallel size {tp}."]
    return []


def even_layer_list(num_layers: int, pp: int) -> List[int]:
    """A layer list close to even (the first stages take one more), e.g. 30 layers, PP4 -> [8, 8, 7, 7]."""
    base = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        base[i] += 1
    return base


def pipeline_problems(num_layers: int, pp: int, layer_list: Optional[Sequence[int]] = None) -> List[str]:
    """Why a pipeline split is impossible (empty when it is fine); an uneven list such as [7, 8, 8, 7] is fine."""
    if not isinstance(pp, int) or pp < 1:
        return [f"pipeline parallel size {pp!r} must be a positive integer."]
    if pp > num_layers:
        return [
            f"pipeline parallel size {pp} is larger than the {num_layers} layers; every stage needs a layer."
        ]
    if layer_list:
        try:
            counts = [int(c) for c in layer_list]
        except (TypeError, ValueError):
            return [f"layer list {list(layer_list)!r} must hold integers (layers per stage)."]
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            return [
                f"layer list {counts} must have {pp} positive counts (one per stage) summing to {num_layers}."
            ]
        return []
    if num_layers % pp:
        return [
            f"{num_layers} layers do not split evenly into {pp} pipeline stages; pass an explicit layer list "
            f"(num_layer_list, e.g. {even_layer_list(num_layers, pp)})."
        ]
    return []


def stage_layers(num_layers: int, pp: int, layer_list: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Global layer indices of each pipeline stage (uniform, or the explicit per-stage counts); [] if impossible."""
    if layer_list:
        counts = [int(c) for c in layer_list]
    else:
        counts = [num_layers // pp] * pp if pp and num_layers % pp == 0 else []
    start, stages = 0, []
    for c in counts:
        stages.append(list(range(start, start + c)))
        start += c
    return stages


def layer_list_flag(layer_list: Optional[Sequence[int]]) -> Optional[str]:
    """MindSpeed-LLM's `--num-layer-list` value ("7,8,8,7") for an uneven split; None when the split is even."""
    if not layer_list or len(set(int(c) for c in layer_list)) <= 1:
        return None
    return ",".join(str(int(c)) for c in layer_list)


def ep_candidates(num_experts: int, tp: int = 1, pp: int = 1, world_size: Optional[int] = None) -> List[int]:
    """Every EP size that divides the experts and, given a world size, fits megatron-core's rank layout."""
    return [
        e
        for e in range(1, int(num_experts) + 1)
        if num_experts % e == 0 and (not world_size or world_size % (tp * e * pp) == 0)
    ]


def expert_parallel_problems(
    num_experts: int, ep: int, tp: int = 1, pp: int = 1, world_size: Optional[int] = None
) -> List[str]:
    """Why EP does not fit the experts (and, given the world size, megatron-core 0.16.1's rank layout: W divisible
    by TP x PP, and by expert-TP x EP x PP with expert-TP = TP); empty when it fits; names the sizes that do."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        return [f"expert parallel size {ep!r} must be a positive integer."]
    num_experts = int(num_experts or 0)
    if not num_experts:
        return (
            []
            if ep == 1
            else [f"expert parallel size {ep} needs a mixture-of-experts model; this one has none."]
        )
    problems = []
    if num_experts % ep:
        problems.append(f"expert parallel size {ep} does not divide the {num_experts} experts.")
    if world_size and isinstance(tp, int) and isinstance(pp, int) and tp >= 1 and pp >= 1:
        if world_size % (tp * pp):
            problems.append(f"world size {world_size} is not divisible by TP x PP = {tp} x {pp}.")
        elif world_size % (tp * ep * pp):
            dp = world_size // (tp * pp)
            problems.append(
                f"expert parallel size {ep} x expert TP {tp} does not divide the {dp * tp} data x tensor parallel "
                f"ranks of a pipeline stage (world size {world_size}, TP{tp} PP{pp}, DP{dp}; megatron-core keeps "
                f"EP inside DP)."
            )
    if problems:
        where = f" on {world_size} ranks with TP{tp} PP{pp}" if world_size else ""
        problems.append(
            f"EP sizes that fit this model{where} (every rule at once): "
            f"{ep_candidates(num_experts, tp, pp, world_size)}."
        )
    return problems


def parallel_problems(
    model: Mapping[str, Any],
    tp: int,
    pp: int,
    layer_list: Optional[Sequence[int]] = None,
    padded_vocab: Optional[int] = None,
    divisible_by: int = 128,
    flavor: str = "local",
    ep: int = 1,
    world_size: Optional[int] = None,
) -> List[str]:
    """Every reason a TP x PP x EP layout (with its layer list and padded vocabulary) does not fit a model, at once.

    `model` holds plain facts: num_layers, num_heads, num_kv_groups, ffn_hidden_size, vocab_size (the `model`
    field of a converted-checkpoint manifest, or `kit.convert.model_facts(folder)`). `padded_vocab` None: the
    Megatron rule with `divisible_by`. MoE models add num_experts and moe_ffn_hidden_size; `world_size` (the
    training's ranks) adds the rank-layout rules, None checks the model only (conversion).
    """
    missing = [k for k in FACT_NAMES if model.get(k) is None]
    if missing:
        return [f"model facts lack {missing}; read them with kit.convert.model_facts(folder)."]
    heads, groups, ffn = int(model["num_heads"]), int(model["num_kv_groups"]), int(model["ffn_hidden_size"])
    vocab, layers = int(model["vocab_size"]), int(model["num_layers"])
    experts = int(model.get("num_experts") or 0)
    moe_ffn = int(model.get("moe_ffn_hidden_size") or 0) if experts else 0
    problems = tensor_parallel_problems(heads, ffn, groups, tp, flavor, moe_ffn)
    if isinstance(tp, int) and tp >= 1:
        padded = padded_vocab if padded_vocab else padded_vocab_size(vocab, tp, divisible_by)
        problems += vocab_problems(vocab, int(padded), tp)
    problems += pipeline_problems(layers, pp, layer_list)
    return problems + expert_parallel_problems(experts, ep, tp, pp, world_size)
