"""The HF side of the preflight for mixture-of-experts models (Qwen3-MoE): transformers' own model on the same batches.

For MoE the reference is transformers' Qwen3MoeForCausalLM itself (its router: softmax over every expert, top-k,
renormalised when norm_topk_prob; its per-expert loop), not a re-statement of it, loaded from the checkpoint converted
back by notebook 03's code. The padded vocabulary is reproduced as for dense models (zero rows, so both softmaxes run
over padded_vocab_size columns).

The two sides define the router's auxiliary loss differently, so the preflight compares it separately:
- megatron-core 0.16 (`switch_load_balancing_loss_func` in transformer/moe/moe_utils.py, called per MoE layer and per
  micro-batch in router.py `_apply_aux_loss`): per layer, E / (k T^2) * sum_i c_i s_i, where c_i counts the top-k
  assignments to expert i and s_i sums its softmax probabilities over the micro-batch's T tokens; each layer's term is
  added to the objective with --moe-aux-loss-coeff.
- transformers (`load_balancing_loss_func` in models/qwen3_moe/modeling_qwen3_moe.py): the counts and probabilities
  pooled over every layer and the whole batch, E / (L T)^2 * sum_i C_i S_i (no 1/k), added once with
  router_aux_loss_coef.
Both sides' objective here is the LM loss plus megatron-core's definition computed from HF's router logits (so the
grad norm and the steps compare like for like); HF's own number is reported beside it, not compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F


def megatron_aux_losses(router_logits, topk: int, num_experts: int) -> List[torch.Tensor]:
    """Per layer, megatron-core's load-balancing loss without its coefficient (see the module doc), from [T, E]
    router logits of one micro-batch; differentiable through the probabilities, the counts are not."""
    out = []
    for logits in router_logits:
        scores = torch.softmax(logits.float(), dim=-1)
        with torch.no_grad():
            top = torch.topk(scores, k=topk, dim=-1).indices
            counts = torch.zeros_like(scores).scatter(1, top, 1.0).sum(0)
        tokens = scores.shape[0]
        out.append((scores.sum(0) * counts).sum() * (num_experts / (topk * tokens * tokens)))
    return out


def _additive_mask(segments: torch.Tensor) -> torch.Tensor:
    """A [n, 1, s, s] additive mask (0 attend, float min masked): causal, and only inside one segment."""
    s = segments.shape[-1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    masked = causal[None] | (segments[:, :, None] != segments[:, None, :])
    return torch.zeros(masked.shape).masked_fill(masked, torch.finfo(torch.float32).min)[:, None]


class MoEReference:
    """transformers' MoE causal LM in fp32 (padded vocabulary) and the terms of a micro-batch's objective."""

    def __init__(self, hf_dir: Path, padded_vocab: int):
        from transformers import AutoModelForCausalLM

        # eager: megatron-core's local DotProductAttention is the same unfused softmax(QK^T) V
        model = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), dtype=torch.float32, attn_implementation="eager"
        )
        cfg = model.config
        self.vocab = int(cfg.vocab_size)
        if padded_vocab > self.vocab:
            model.resize_token_embeddings(padded_vocab, mean_resizing=False)
            with torch.no_grad():  # the converter's zero rows
                model.get_input_embeddings().weight[self.vocab :] = 0
                model.get_output_embeddings().weight[self.vocab :] = 0
        # transformers builds the embedding with padding_idx = pad_token_id, whose row then never gets a gradient;
        # megatron-core's embedding has no such row (nor has the dense reference): both sides train every row
        model.get_input_embeddings().padding_idx = None
        model.eval()  # no dropout; the MoE block behaves the same in both modes
        self.model = model
        self.topk = int(cfg.num_experts_per_tok)
        self.num_experts = int(cfg.num_experts)
        self.aux_coef = float(cfg.router_aux_loss_coef)
        self.params: Dict[str, torch.nn.Parameter] = dict(model.named_parameters())
        vocab_rows = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        self._vocab_rows = {n for n, p in self.params.items() if any(p is w for w in vocab_rows)}

    def terms(self, b: dict) -> dict:
        """lm: mean CE over the loss-masked tokens (as the ranks' loss); aux: megatron-core's per-layer aux losses
        (no coefficient); hf_aux: transformers' load_balancing_loss_func on the same router logits (no coefficient)."""
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        seg = b["segments"]
        one_segment = bool((seg == seg[:, :1]).all())
        # one document per row: transformers' own causal mask; packed rows: the per-dialog mask megatron gets too
        mask = None if one_segment else _additive_mask(seg)
        out = self.model.model(
            input_ids=b["tokens"],
            position_ids=b["position_ids"],
            attention_mask=mask,
            output_router_logits=True,
            use_cache=False,
        )
        logits = self.model.lm_head(out.last_hidden_state).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1), reduction="none")
        lm = (ce * b["loss_mask"].reshape(-1)).sum() / b["loss_mask"].sum().clamp(min=1)
        aux = megatron_aux_losses(out.router_logits, self.topk, self.num_experts)
        with torch.no_grad():
            hf_aux = float(load_balancing_loss_func(out.router_logits, self.num_experts, self.topk, None))
        return {"lm": lm, "aux": aux, "hf_aux": hf_aux}

    def loss(self, b: dict) -> torch.Tensor:
        """The LM loss of a micro-batch (what the ranks report as `lm loss`)."""
        return self.terms(b)["lm"]

    def unpadded(self) -> Dict[str, torch.Tensor]:
        """transformers' parameters (its in-memory names) with the padded vocabulary rows dropped."""
        return {
            k: v.detach()[: self.vocab] if k in self._vocab_rows else v.detach()
            for k, v in self.params.items()
        }

    @staticmethod
    def read_hf(folder: Path) -> Dict[str, torch.Tensor]:
        """An HF folder's weights under the same names as unpadded() (transformers' loader and key conversions)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        return {k: v.detach() for k, v in model.named_parameters()}
