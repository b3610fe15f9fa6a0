"""The HF side of the preflight: the same batches through the HF weights, differentiated, stepped with torch AdamW.

For every family transformers ships (Llama, Qwen3, Qwen3-MoE, GLM-4 `glm`) the reference is transformers' own model,
loaded from the checkpoint converted back by notebook 03's code (eager attention, fp32). The remote-code families
(ChatGLM3 / chatglm-format GLM-4, Baichuan2) have no model in transformers; for them it is the kit's forward from
their published math (kit.convert.reference.hf_forward), one row at a time. Both reproduce Megatron's padded
vocabulary: the embedding and output rows are padded with the zeros the converter writes, so the softmax runs over
the same padded_vocab_size columns. Baichuan2's NormHead was normalised at conversion and Megatron trains a plain
output layer; the reference trains the same plain head.

The two sides define a MoE router's auxiliary loss differently, so the preflight compares it separately:
- megatron-core 0.16 (`switch_load_balancing_loss_func` in transformer/moe/moe_utils.py, called per MoE layer and per
  micro-batch in router.py `_apply_aux_loss`): per layer, E / (k T^2) * sum_i c_i s_i, where c_i counts the top-k
  assignments to expert i and s_i sums its softmax probabilities over the micro-batch's T tokens; each layer's term is
  added to the objective with --moe-aux-loss-coeff.
- transformers (`load_balancing_loss_func` in models/qwen3_moe/modeling_qwen3_moe.py): the counts and probabilities
  pooled over every layer and the whole batch, E / (L T)^2 * sum_i C_i S_i (no 1/k), added once with
  router_aux_loss_coef.
Both sides' objective here is the LM loss plus megatron-core's definition computed from HF's router logits (so the
grad norm and the steps compare like for like); HF's own number is reported beside it, not compared. A model whose
coefficient is 0 has no aux loss on either side (GLM-4.5: transformers' Glm4MoeForCausalLM computes none, and its
converted checkpoint has --moe-aux-loss-coeff 0), and no aux row.
A sigmoid router's coefficient (DeepSeek-V3's published aux_loss_alpha 0.001 with seq_aux) is the sequence-wise loss:
megatron-core's seq_aux_loss (router.py `_apply_seq_aux_loss`), the same formula per row of the micro-batch (T = the
row's S tokens), averaged over the rows, on sigmoid scores normalised over the experts and their plain top-k (no
expert bias, no group limit: `compute_routing_scores_for_aux_loss`). transformers trains DeepSeek-V3 without it, so
the HF side's objective adds it from the router logits (megatron_seq_aux_losses) and there is no HF number of its own.

GLM-4.5's (and DeepSeek-V3's) router picks experts by sigmoid score plus a score-correction bias that no gradient
moves: megatron-core moves it in finalize_model_grads after each step's backward (`_update_router_expert_bias`,
get_updated_expert_bias on the step's tokens per expert summed over TP x DP, --moe-router-bias-update-rate). The
reference moves transformers' `e_score_correction_bias` buffers after each optimizer step with the kit trainer's
own update (kit.train.expert_bias), counting the experts chosen in the step's training forwards, at the same rate.
Their MTP layer is trained by neither side: transformers has no MTP forward (kit.train.preflight.ranks leaves it
out of the GPTModel and carries its tensors through as loaded).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from kit.errors import InputError

BIAS_SUFFIX = "e_score_correction_bias"  # transformers' DeepSeek-V3 / GLM-4.5 router bias (a buffer)


def _aux_scores(logits, topk: int, score_function: str):
    """megatron-core's scores and top-k map for its aux losses (moe_utils.py `compute_routing_scores_for_aux_loss`):
    softmax, or sigmoid normalised over the experts; the top-k of those scores, without the expert bias or the
    group limit the routing itself applies. The map is not differentiable."""
    logits = logits.float()
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = torch.softmax(logits, dim=-1)
    with torch.no_grad():
        top = torch.topk(scores, k=topk, dim=-1).indices
        chosen = torch.zeros_like(scores).scatter(1, top, 1.0)
    return scores, chosen


def megatron_aux_losses(
    router_logits, topk: int, num_experts: int, score_function: str = "softmax"
) -> List[torch.Tensor]:
    """Per layer, megatron-core's load-balancing loss without its coefficient (see the module doc), from [T, E]
    router logits of one micro-batch; differentiable through the probabilities, the counts are not."""
    out = []
    for logits in router_logits:
        scores, chosen = _aux_scores(logits, topk, score_function)
        tokens = scores.shape[0]
        out.append((scores.sum(0) * chosen.sum(0)).sum() * (num_experts / (topk * tokens * tokens)))
    return out


def megatron_seq_aux_losses(
    router_logits, topk: int, num_experts: int, rows: int, score_function: str = "sigmoid"
) -> List[torch.Tensor]:
    """Per layer, megatron-core's sequence-wise load-balancing loss (router.py `_apply_seq_aux_loss`, DeepSeek-V3's
    complementary loss) without its coefficient: each row's E / (k S^2) * sum_i c_i s_i over its own S tokens, then
    the mean over the rows; from HF's [rows * S, E] router logits (row-major) of one micro-batch."""
    out = []
    for logits in router_logits:
        scores, chosen = _aux_scores(logits, topk, score_function)
        scores, chosen = scores.reshape(rows, -1, num_experts), chosen.reshape(rows, -1, num_experts)
        seq = scores.shape[1]
        per_row = (scores.sum(1) * chosen.sum(1)).sum(-1) * (num_experts / (topk * seq * seq))
        out.append(per_row.mean())
    return out


class _Reference:
    """What both references hold: fp32 parameters with the vocabulary padded (the rows of _vocab_rows)."""

    params: Dict[str, torch.nn.Parameter]
    vocab: int
    _vocab_rows: set

    def unpadded(self) -> Dict[str, torch.Tensor]:
        """The parameters with the padded vocabulary rows dropped (what the way back to HF writes)."""
        return {
            k: v.detach()[: self.vocab] if k in self._vocab_rows else v.detach()
            for k, v in self.params.items()
        }


class ModelReference(_Reference):
    """transformers' own causal LM in fp32 (padded vocabulary) and the terms of a micro-batch's objective."""

    note = "transformers' own model on the checkpoint converted back by notebook 03's code, fp32, eager attention"

    def __init__(self, hf_dir: Path, padded_vocab: int, moe: Optional[dict] = None):
        from transformers import AutoModelForCausalLM

        from kit.system.hf_compat import dtype_kw

        # eager: megatron-core's local DotProductAttention is the same unfused softmax(QK^T) V
        model = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), attn_implementation="eager", **dtype_kw(torch.float32)
        )
        cfg = model.config
        self.vocab = int(cfg.vocab_size)
        if padded_vocab > self.vocab:
            model.resize_token_embeddings(padded_vocab, mean_resizing=False)
            with torch.no_grad():  # the converter's zero rows
                model.get_input_embeddings().weight[self.vocab :] = 0
                model.get_output_embeddings().weight[self.vocab :] = 0
        # transformers builds the embedding with padding_idx = pad_token_id, whose row then never gets a gradient;
        # megatron-core's embedding has no such row: both sides train every row
        model.get_input_embeddings().padding_idx = None
        model.eval()  # no dropout; the MoE block behaves the same in both modes
        self.model = model
        self.num_experts = 0  # set where the objective has megatron-core's aux loss
        if moe and moe["aux_loss_coeff"] > 0:
            self.num_experts, self.topk = int(moe["num_experts"]), int(moe["topk"])
            # the checkpoint's, converted from router_aux_loss_coef (Qwen3-MoE) or aux_loss_alpha (DeepSeek-V3)
            self.aux_coef = float(moe["aux_loss_coeff"])
            self.score_function = moe.get("score_function", "softmax")
            self.seq_aux = moe.get("aux_loss_type") == "seq_aux_loss"
            # transformers' DeepSeek-V3 trains without any aux loss: nothing of its own to report
            if self.seq_aux:
                self.note += (
                    "; its objective adds megatron-core's per-layer sequence-wise load-balancing loss (seq_aux_loss, "
                    "computed from HF's router logits) so the grad norms compare like for like"
                )
            else:
                self.note += (
                    "; its objective adds megatron-core's per-layer load-balancing loss (computed from HF's router "
                    "logits) so the grad norms compare like for like; transformers' own load_balancing_loss_func is "
                    "reported beside it (facts.hf_load_balancing_loss), a different definition"
                )
        self.bias_update = None
        if moe and moe.get("expert_bias_rate"):
            from kit.train.expert_bias import attach

            self.bias_update = attach(model, moe["expert_bias_rate"])
            if self.bias_update is None:
                raise InputError(
                    f"the checkpoint's routers carry an expert bias but transformers' {cfg.model_type} model in "
                    f"{hf_dir} has no score-correction bias to move: the preflight cannot hold this model."
                )
            self.note += (
                f"; after each step its routers' score-correction biases move by the kit trainer's update "
                f"(kit.train.expert_bias, megatron-core's get_updated_expert_bias) on the experts chosen in the "
                f"step's training forwards, rate {moe['expert_bias_rate']:g}"
            )
        if moe and moe.get("mtp_layers"):
            self.note += "; the MTP layer is trained by neither side (transformers has no MTP forward)"
        self.params: Dict[str, torch.nn.Parameter] = dict(model.named_parameters())  # tied weights once
        vocab_rows = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        self._vocab_rows = {n for n, p in self.params.items() if any(p is w for w in vocab_rows)}

    def terms(self, b: dict) -> dict:
        """lm: mean CE over the loss-masked tokens (as the ranks' loss); for MoE also aux: megatron-core's per-layer
        aux losses (sequence-wise ones for seq_aux_loss) and, for the micro-batch loss, hf_aux: transformers'
        load_balancing_loss_func on the same router logits (no coefficients)."""
        from kit.train.preflight.batches import masked_mean, megatron_mask

        # causal and inside each segment (a packed row's dialogs), as megatron gets it; 0 attend, float min masked
        masked = megatron_mask(b["segments"])
        mask = torch.zeros(masked.shape).masked_fill(masked, torch.finfo(torch.float32).min)
        moe = {"output_router_logits": True} if self.num_experts else {}
        out = self.model.model(
            input_ids=b["tokens"], position_ids=b["position_ids"], attention_mask=mask, use_cache=False, **moe
        )
        logits = self.model.get_output_embeddings()(out.last_hidden_state).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1), reduction="none")
        terms = {"lm": masked_mean(ce, b["loss_mask"].reshape(-1))}
        if self.num_experts and self.seq_aux:
            rows = b["tokens"].shape[0]
            terms["aux"] = megatron_seq_aux_losses(
                out.router_logits, self.topk, self.num_experts, rows, self.score_function
            )
        elif self.num_experts:
            from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

            terms["aux"] = megatron_aux_losses(
                out.router_logits, self.topk, self.num_experts, self.score_function
            )
            with torch.no_grad():
                lb = load_balancing_loss_func(out.router_logits, self.num_experts, self.topk, None)
            terms["hf_aux"] = float(lb)
        return terms

    def expert_biases(self) -> Dict[str, torch.Tensor]:
        """The routers' score-correction biases (buffers, so not among params) under their HF names."""
        return {k: v.detach() for k, v in self.model.named_buffers() if k.endswith(BIAS_SUFFIX)}

    def trained(self, folder: Path) -> Iterator[Tuple[str, torch.Tensor]]:
        """An HF folder's weights under the names of unpadded() (transformers' loader and key conversions)."""
        from transformers import AutoModelForCausalLM

        from kit.system.hf_compat import dtype_kw

        model = AutoModelForCausalLM.from_pretrained(str(folder), **dtype_kw(torch.float32))
        return ((k, v.detach()) for k, v in model.named_parameters())


class ForwardReference(_Reference):
    """The remote-code families: HF-layout fp32 parameters (padded vocabulary) through the kit's forward."""

    note = "kit.convert.reference.hf_forward (the published math) on the checkpoint converted back by 03's code, fp32"

    def __init__(self, sd: Dict[str, torch.Tensor], spec, padded_vocab: int):
        self.spec = dataclasses.replace(spec, norm_head=False)
        self.vocab = spec.vocab_size
        glm = spec.family == "chatglm"
        emb = "transformer.embedding.word_embeddings.weight" if glm else "model.embed_tokens.weight"
        self._vocab_rows = {emb, "transformer.output_layer.weight" if glm else "lm_head.weight"}
        self.params: Dict[str, torch.nn.Parameter] = {}
        for k, v in sd.items():
            v = v.float()
            if k in self._vocab_rows and v.shape[0] < padded_vocab:
                v = torch.cat([v, v.new_zeros(padded_vocab - v.shape[0], v.shape[1])])
            self.params[k] = torch.nn.Parameter(v.clone())

    def terms(self, b: dict) -> dict:
        """lm: the mean CE over the loss-masked tokens of the rows (one micro-batch), each row on its own."""
        from kit.convert.reference import hf_forward
        from kit.train.preflight.batches import masked_mean

        ce = [
            F.cross_entropy(
                hf_forward(
                    self.params, self.spec, b["tokens"][r], b["position_ids"][r], b["segments"][r]
                ).float(),
                b["labels"][r],
                reduction="none",
            )
            for r in range(b["tokens"].shape[0])
        ]
        return {"lm": masked_mean(torch.stack(ce), b["loss_mask"])}

    def trained(self, folder: Path) -> Iterator[Tuple[str, torch.Tensor]]:
        """An HF folder's weights that the reference has, one tensor at a time."""
        from kit.convert.hf_io import HFReader

        reader = HFReader(folder)
        return ((k, reader.read(k)) for k in reader.keys() if k in self.params)


def load(hf_dir: Path, job: dict):
    """The reference for the HF folder: transformers' own model where it ships the family, the kit's forward else."""
    from kit.convert.hf_io import HFReader
    from kit.convert.reference import transformers_ships
    from kit.convert.spec import ModelSpec

    reader = HFReader(hf_dir)
    if transformers_ships(reader.config.get("model_type")):
        return ModelReference(hf_dir, job["padded_vocab_size"], job.get("moe"))
    sd = {k: reader.read(k) for k in reader.keys()}
    return ForwardReference(sd, ModelSpec(**job["spec"]), job["padded_vocab_size"])


def lr_at(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """The kit trainer's schedule (kit.train.engine.lr_lambda) for `steps` iterations, as an absolute rate."""
    from types import SimpleNamespace

    from kit.train.engine import lr_lambda

    return lr * lr_lambda(SimpleNamespace(lr=lr, min_lr=min_lr, warmup_iters=warmup, train_iters=steps))(step)


def train(ref, batches: dict, job: dict) -> dict:
    """The run the ranks make: same global batches, micro-batch means averaged, clip, AdamW (no decay on 1-D)."""
    decay = [p for p in ref.params.values() if p.dim() > 1]
    flat = [p for p in ref.params.values() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": job["weight_decay"]}, {"params": flat, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(
        groups, lr=job["lr"], betas=(job["adam_beta1"], job["adam_beta2"]), eps=job["adam_eps"]
    )
    per_step = job["dp"] * job["micro_batches"]
    mbs = job["mbs"]
    out: Dict[str, list] = {"losses": [], "grad_norms": [], "lrs": []}
    params = list(ref.params.values())
    for step in range(job["steps"]):
        rate = lr_at(step, job["lr"], job["min_lr"], job["warmup_iters"], job["steps"])
        for g in opt.param_groups:
            g["lr"] = rate
        opt.zero_grad()
        total = 0.0
        aux_sum: List[float] = []  # MoE: per layer, megatron-core's aux loss summed over the micro-batches
        hf_aux = 0.0  # MoE: transformers' own aux loss, summed likewise
        for i in range(per_step):
            first = (step * per_step + i) * mbs
            t = ref.terms({k: v[first : first + mbs] for k, v in batches.items()})
            loss = t["lm"] / per_step
            if (
                "aux" in t
            ):  # the objective megatron-core differentiates: LM loss + coefficient x each layer's aux
                (loss + ref.aux_coef * torch.stack(t["aux"]).sum() / per_step).backward()
                aux_sum = [a + float(x.detach()) for a, x in zip(aux_sum or [0.0] * len(t["aux"]), t["aux"])]
                hf_aux += t.get("hf_aux", 0.0)
            else:
                loss.backward()
            total += float(loss.detach())
        if aux_sum:
            out.setdefault("aux_losses", []).append([a / per_step for a in aux_sum])
            if not getattr(ref, "seq_aux", False):  # transformers' own number (DeepSeek-V3 has none)
                out.setdefault("hf_aux_losses", []).append(hf_aux / per_step)
        # the norm in float64: torch's fp32 CPU norm of a large tensor is off by ~1e-5 relative, the size of the
        # tolerance; clipped as megatron-core's clip_grad_norm_fp32 does (coefficient max / (norm + 1e-6))
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
        coeff = job["clip_grad"] / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
        opt.step()
        if getattr(ref, "bias_update", None) is not None:  # as megatron-core after each step's backward
            ref.bias_update.step()
        out["losses"].append(total)
        out["grad_norms"].append(norm)
        out["lrs"].append(rate)
        if not math.isfinite(total):
            break
    return out
