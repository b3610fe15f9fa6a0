"""The model a plan is for, from its `config.json` alone: exact parameter counts from the real model class built on
the meta device (no weights, no memory), and slices of it (the same model with fewer layers) for the trace."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

from kit.core.workspace import LORA_TARGETS
from kit.errors import InputError, MissingInputError


@dataclass(frozen=True)
class Counts:
    """Parameter counts of the whole model (exact: summed over the real class's parameters)."""

    total: int
    layers: int
    per_layer: int
    """One decoder layer: the mean over the layers (they are alike, but for the dense layers that lead some MoE
    models; see dense_layers)."""
    embedding: int
    head: int
    """The output projection; 0 when tied to the embedding."""
    other: int
    """Final norm and whatever else sits outside the layers, embedding and head."""
    experts_per_layer: int
    """Routed-expert parameters of one layer (0 for a dense model)."""
    num_experts: int
    top_k: int
    lora_per_layer: int
    """LoRA adapter parameters per layer at rank 1 (times LORA_R for the run's)."""
    small: int = 0
    """Parameters in tensors of fewer than SMALL elements (ZeRO-3 keeps those whole on every card)."""
    dense_layers: int = 0
    """Leading layers with a dense MLP instead of experts (DeepSeek-V3, GLM-4.5: config `first_k_dense_replace`)."""

    @property
    def expert_layers(self) -> int:
        """Layers that hold routed experts."""
        return self.layers - self.dense_layers if self.num_experts else 0

    @property
    def active(self) -> int:
        """Parameters one token runs through (MoE: the routed experts it is sent to, not all of them)."""
        if not self.num_experts:
            return self.total
        unused = self.experts_per_layer * (1 - self.top_k / self.num_experts)
        return int(self.total - self.expert_layers * unused)


def load_config(path: Union[str, Path]):
    """transformers' config of the model at `path` (a folder with config.json, or the file itself)."""
    path = Path(path)
    folder = path.parent if path.name.endswith(".json") else path
    file = path if path.name.endswith(".json") else path / "config.json"
    if not file.is_file():
        raise MissingInputError(f"{file} does not exist; give a model folder with config.json, or the file.")
    raw = json.loads(file.read_text(encoding="utf-8"))
    if raw.get("auto_map") and not raw.get("model_type"):
        raise InputError(
            f"{file} names only remote code (auto_map); the planner needs a transformers model_type."
        )
    try:
        from transformers import CONFIG_MAPPING

        cls = CONFIG_MAPPING[raw["model_type"]]
    except KeyError:
        raise InputError(
            f"model_type {raw.get('model_type')!r} in {file} is not one transformers knows here; "
            "the planner builds the model from its class (upgrade transformers, or plan a family it has)."
        ) from None
    config = cls.from_dict({k: v for k, v in raw.items() if k != "transformers_version"})
    config._name_or_path = str(folder)
    return config


def dense_layers(config) -> int:
    """The leading dense layers of an MoE model whose later layers all hold experts (`first_k_dense_replace`:
    transformers' DeepseekV3 and Glm4Moe decoder layers use experts from that index on)."""
    return int(getattr(config, "first_k_dense_replace", 0) or 0)


def sliced(config, layers: int):
    """The same model with `layers` decoder layers (per-layer lists cut to match)."""
    out = copy.deepcopy(config)
    out.num_hidden_layers = layers
    for name in ("layer_types", "mlp_only_layers"):
        value = getattr(out, name, None)
        if isinstance(value, list) and name == "layer_types":
            setattr(out, name, value[:layers])
        elif isinstance(value, list):
            setattr(out, name, [i for i in value if i < layers])
    return out


def build(config, dtype=None):
    """The model class of `config`, built wherever the caller's device / fake mode says (no weights loaded)."""
    import torch
    from transformers import AutoModelForCausalLM

    from kit.system.hf_compat import dtype_kw

    return AutoModelForCausalLM.from_config(config, **dtype_kw(dtype or torch.float32))


SMALL = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (zero/config.py)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def counts(config, lora_targets: Sequence[str] = LORA_TARGETS) -> Counts:
    """Exact counts from the model class on the meta device, at k+1 and k+2 layers for k leading dense layers (the
    later layers are alike: a layer's count is the two slices' difference; the rest is the same in both). LoRA's
    count is on the targets as a run resolves them (DeepSeek-V3's default: MLA's projections)."""
    import torch

    from kit.adapt.lora_targets import resolve_targets

    k = min(dense_layers(config), int(config.num_hidden_layers) - 1)
    with torch.device("meta"):
        one, two = build(sliced(config, k + 1)), build(sliced(config, k + 2))
    typical = _numel(two) - _numel(one)
    small_one = sum(p.numel() for p in one.parameters() if p.numel() < SMALL)
    small_layer = sum(p.numel() for p in two.parameters() if p.numel() < SMALL) - small_one
    layers = int(config.num_hidden_layers)
    total = _numel(one) + typical * (layers - k - 1)
    embedding = one.get_input_embeddings().weight.numel()
    head_module = one.get_output_embeddings()
    tied = head_module is None or head_module.weight is one.get_input_embeddings().weight
    head = 0 if tied else head_module.weight.numel()
    stack = one.model.layers if hasattr(one, "model") and hasattr(one.model, "layers") else None
    in_layers = _numel(stack) + typical * (layers - k - 1) if stack is not None else typical * layers
    other = total - in_layers - embedding - head
    layer = stack[k] if stack is not None else None
    experts = 0
    lora = 0
    if layer is not None:
        for name, p in layer.named_parameters():
            if ".experts." in f".{name}" or name.split(".")[-2:-1] == ["experts"]:
                experts += p.numel()
        targets = resolve_targets(one, lora_targets)
        for name, module in layer.named_modules():
            if name.split(".")[-1] in targets and isinstance(module, torch.nn.Linear):
                lora += module.in_features + module.out_features
    num_experts = int(getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0) or 0)
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    return Counts(
        total=total,
        layers=layers,
        per_layer=round(in_layers / layers),
        embedding=embedding,
        head=head,
        other=other,
        experts_per_layer=experts,
        num_experts=num_experts if experts else 0,
        top_k=top_k if experts else 0,
        lora_per_layer=lora,
        small=small_one + small_layer * (layers - k - 1),
        dense_layers=k if experts else 0,
    )
