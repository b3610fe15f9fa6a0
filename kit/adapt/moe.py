"""MoE blocks (Qwen3-MoE; DeepSeek-V3 and GLM-4.5) through kit.ops.moe, and the router's auxiliary loss as a
training setting.

`moe_block_forward` replaces Qwen3MoeSparseMoeBlock.forward (parameters untouched: state_dict, checkpoints and HF
exports keep HF's layout). Two layouts, found by attribute: transformers >= 5 keeps the experts fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) with a router module `gate` whose output
transformers records as the router logits (so the block calls it, and its forward is kit routing too);
transformers 4.51-4.57 keep `gate` as a Linear and `experts` as a ModuleList of MLPs, and the block returns
(hidden, router_logits) itself.

DeepSeek-V3 (`DeepseekV3MoE`) and GLM-4.5 (`Glm4MoeMoE`) blocks, transformers >= 5: a sigmoid router `gate`
(`DeepseekV3TopkRouter` / `Glm4MoeTopkRouter`: fp32 `weight`, the buffer `e_score_correction_bias`, n_group /
topk_group / norm_topk_prob / routed_scaling_factor) returning (router_logits, weights, indices), fused experts as
above, and `shared_experts` (an MLP every token runs) added to the routed output. Their 4.x layout is not adapted
(those blocks keep HF's forward; their expert MLPs still get the merged SwiGLU): a ModuleList of expert MLPs, a
router returning (indices, weights) without logits, and the groups left out masked to 0 instead of -inf (the
transformers 4.5x source). Neither family has a router auxiliary loss in HF (no `router_aux_loss_coef` in their
configs): the bias balances the load instead (kit.train.expert_bias).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from kit.ops import moe as kit_moe


def fused_experts(block) -> bool:
    """transformers >= 5: experts.gate_up_proj / experts.down_proj are 3-D parameters."""
    experts = getattr(block, "experts", None)
    gate_up = getattr(experts, "gate_up_proj", None)
    return isinstance(gate_up, torch.nn.Parameter) and gate_up.dim() == 3


SIGMOID_ROUTER_ATTRS = ("top_k", "num_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")


def is_sigmoid_block(module) -> bool:
    """A DeepSeek-V3 / GLM-4.5 MoE block of transformers >= 5 (bias-corrected sigmoid router, fused experts)."""
    gate = getattr(module, "gate", None)
    return (
        fused_experts(module)
        and isinstance(getattr(gate, "weight", None), torch.nn.Parameter)
        and isinstance(getattr(gate, "e_score_correction_bias", None), torch.Tensor)
        and all(hasattr(gate, a) for a in SIGMOID_ROUTER_ATTRS)
    )


def is_moe_block(module) -> bool:
    """A Qwen3-MoE sparse block in either layout (router `gate` + `experts`, no shared expert), or a DeepSeek-V3 /
    GLM-4.5 block (`is_sigmoid_block`)."""
    if is_sigmoid_block(module):
        return True
    if not type(module).__name__.endswith("SparseMoeBlock") or hasattr(module, "shared_expert"):
        return False
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    if gate is None or experts is None:
        return False
    if fused_experts(module):
        return isinstance(getattr(gate, "weight", None), torch.nn.Parameter) and hasattr(gate, "top_k")
    return isinstance(gate, torch.nn.Linear) and isinstance(experts, torch.nn.ModuleList)


def _top_k(block) -> int:
    return int(getattr(block.gate, "top_k", None) or block.top_k)


def _norm_topk(block) -> bool:
    return bool(getattr(block.gate, "norm_topk_prob", getattr(block, "norm_topk_prob", False)))


def router_forward(self, hidden_states):
    """Qwen3MoeTopKRouter.forward through kit.ops.moe.moe_route: (router_logits, weights, indices)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    weights, indices = kit_moe.moe_route(logits, self.top_k, bool(self.norm_topk_prob))
    return logits, weights, indices


def sigmoid_router_forward(self, hidden_states):
    """DeepseekV3TopkRouter.forward (Glm4MoeTopkRouter's is the same) through kit.ops.moe.moe_route_sigmoid:
    (router_logits in fp32, weights, indices)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states.float(), self.weight.float())
    weights, indices = kit_moe.moe_route_sigmoid(
        logits,
        int(self.top_k),
        self.e_score_correction_bias,
        int(self.num_group),
        int(self.topk_group),
        bool(self.norm_topk_prob),
        float(self.routed_scaling_factor),
    )
    return logits, weights, indices


def prepare_block(block) -> None:
    """Give a transformers >= 5 block's router the kit routing (the block calls it: its output is recorded)."""
    if fused_experts(block) and not isinstance(block.gate.__dict__.get("forward"), types.MethodType):
        forward = sigmoid_router_forward if is_sigmoid_block(block) else router_forward
        block.gate.forward = types.MethodType(forward, block.gate)


def moe_block_forward(self, hidden_states):
    """Qwen3MoeSparseMoeBlock.forward with sorted experts: same outputs, gradients and router logits as HF's."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    if fused_experts(self):
        _logits, weights, indices = self.gate(x)
        out = kit_moe.moe_experts(x, indices, weights, self.experts.gate_up_proj, self.experts.down_proj)
        shared = getattr(self, "shared_experts", None)  # DeepSeek-V3 / GLM-4.5: every token's MLP, added
        return out.reshape(shape) if shared is None else out.reshape(shape) + shared(hidden_states)
    logits = self.gate(x)
    weights, indices = kit_moe.moe_route(logits, _top_k(self), _norm_topk(self))
    out = kit_moe.moe_expert_modules(x, indices, weights, self.experts)
    return out.reshape(shape), logits


def is_moe_model(model) -> bool:
    """A causal LM whose config has routed experts and whose forward adds the router's auxiliary loss."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "num_experts", 0)) and hasattr(config, "router_aux_loss_coef")


def router_aux_loss_coef(model, coef) -> float:
    """The coefficient of the router's auxiliary loss for this run: `coef`, or None = the model's
    `config.router_aux_loss_coef`; set on the model, whose forward adds `coef * load_balancing_loss` (HF's own
    formula over every layer's router logits) when called with `output_router_logits=True`. The config is left
    as it is, so an export keeps the model's own value and does not return router logits by default."""
    value = float(model.config.router_aux_loss_coef if coef is None else coef)
    model.router_aux_loss_coef = (
        value  # Qwen3MoeForCausalLM.forward reads this attribute (set from the config)
    )
    return value


NO_LORA = ("gate", "experts")  # the router, and transformers 5's fused experts (see docs/adapt.md, MoE)


def lora_target_problems(model, targets) -> list:
    """LoRA targets a MoE model should not get, each with the reason: the router (its LoRA would move the load
    balance the aux loss keeps) and the experts module (fused parameters: peft cannot wrap them as modules, and the
    adapted block reads them directly)."""
    modules = getattr(model, "modules", None)
    routed = is_moe_model(model) or (modules is not None and any(map(is_sigmoid_block, modules())))
    if not routed:
        return []
    bad = [t for t in targets if t in NO_LORA]
    if not bad:
        return []
    return [
        f"LORA_TARGETS {bad}: in a MoE model 'gate' is the router and 'experts' the fused experts, which get no "
        "LoRA adapters (docs/adapt.md, Mixture of experts); target the attention projections (the default)."
    ]
