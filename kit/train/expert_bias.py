"""DeepSeek's auxiliary-loss-free load balancing for HF training: each router's score-correction bias follows the
tokens its experts received in the last optimizer step (megatron-core 0.16.1's `get_updated_expert_bias` in
megatron/core/transformer/moe/moe_utils.py, the formula of arXiv 2408.15664: bias += rate * sign(mean - count)).

Plain HF training leaves the bias where the checkpoint put it: in transformers 5.25 `e_score_correction_bias` is a
buffer (`nn.Buffer` in DeepseekV3TopkRouter / Glm4MoeTopkRouter), not a parameter, so it gets no gradient and no
optimizer touches it; it only selects experts (the weights come from the unbiased scores). The trainer therefore
updates it itself after each optimizer step, on for every model with such routers (kit.train.trainer), except in
LoRA runs: there the base model stays frozen, biases included (the adapter holds LoRA tensors only, and the merged
export starts from the base checkpoint).
"""

from __future__ import annotations

from typing import Optional

import torch

UPDATE_RATE = 1e-3  # megatron-core's default moe_router_bias_update_rate


def updated_bias(tokens_per_expert, bias, rate: float):
    """bias + rate * sign(mean - tokens) per row: under-used experts rise, over-used ones fall (megatron-core's
    get_updated_expert_bias, without its all-reduce; `tokens_per_expert` and `bias` [..., E])."""
    tokens = tokens_per_expert.float()
    mean = tokens.sum(dim=-1, keepdim=True) / tokens.shape[-1]
    return bias + torch.sign(mean - tokens) * rate


def bias_routers(model) -> list:
    """The routers whose bias the trainer updates: those of transformers >= 5 DeepSeek-V3 / GLM-4.5 MoE blocks,
    whose output (router_logits, weights, indices) names the chosen experts."""
    from kit.adapt.moe import is_sigmoid_block

    modules = getattr(model, "modules", None)  # None: not a torch module (nothing to balance)
    return [] if modules is None else [block.gate for block in modules() if is_sigmoid_block(block)]


class ExpertBiasUpdate:
    """Counts the experts each router chooses in training forwards (grad enabled, as megatron-core counts) and
    moves the biases once per optimizer step.

    The biases are kept in float32 (as megatron-core keeps its expert_bias): a bf16 engine casts buffers with the
    model, and steps of 1e-3 would round away near 1. A forward recomputed under activation checkpointing counts
    its tokens twice in every layer alike, which leaves sign(mean - count) as it was.
    """

    def __init__(self, routers: list, rate: float = UPDATE_RATE):
        self.routers, self.rate = routers, float(rate)
        for router in routers:
            router._buffers["e_score_correction_bias"] = router.e_score_correction_bias.detach().float()
        bias = routers[0].e_score_correction_bias
        self.counts = torch.zeros(len(routers), bias.shape[0], dtype=torch.float32, device=bias.device)
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, row: int):
        def count(module, inputs, output):
            if torch.is_grad_enabled():
                indices = output[2].detach().reshape(-1)
                if self.counts.device != indices.device:
                    self.counts = self.counts.to(indices.device)
                self.counts[row].index_add_(0, indices, torch.ones_like(indices, dtype=torch.float32))

        return count

    def reset(self) -> None:
        self.counts.zero_()

    def step(self) -> None:
        """After the optimizer step: the counts summed over the ranks, each router's bias moved, counts cleared."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.counts)
        with torch.no_grad():
            for row, router in enumerate(self.routers):
                bias = router.e_score_correction_bias
                bias.copy_(updated_bias(self.counts[row].to(bias.device), bias, self.rate))
        self.reset()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def attach(model, rate: float = UPDATE_RATE) -> Optional[ExpertBiasUpdate]:
    """An ExpertBiasUpdate for a model with score-correction biases, else None (nothing to balance)."""
    routers = bias_routers(model)
    return ExpertBiasUpdate(routers, rate) if routers else None
