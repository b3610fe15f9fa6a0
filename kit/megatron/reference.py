"""The HF side of the preflight: the same batches through the HF weights, differentiated, stepped with torch AdamW.

The forward is kit.convert.reference.hf_forward (the published math of Llama / ChatGLM3 / Baichuan2, which
tests/test_convert_logits.py holds against transformers), one row at a time with its positions and segment ids.
Megatron's padded vocabulary is reproduced: the embedding and output rows are padded with the zeros the converter
writes, so the softmax runs over the same padded_vocab_size columns. Baichuan2's NormHead was normalised at
conversion and Megatron trains a plain output layer; the reference trains the same plain head.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List

import torch
import torch.nn.functional as F

from kit.convert.reference import hf_forward


def _embedding_key(sd: Dict[str, torch.Tensor]) -> str:
    return (
        "transformer.embedding.word_embeddings.weight"
        if "transformer.embedding.word_embeddings.weight" in sd
        else "model.embed_tokens.weight"
    )


def _head_key(sd: Dict[str, torch.Tensor]) -> str:
    return "transformer.output_layer.weight" if "transformer.output_layer.weight" in sd else "lm_head.weight"


class Reference:
    """HF-layout fp32 parameters (padded vocabulary) and the loss of a batch of [n, s] rows."""

    def __init__(self, sd: Dict[str, torch.Tensor], spec, padded_vocab: int):
        self.spec = dataclasses.replace(spec, norm_head=False)
        self.vocab = spec.vocab_size
        self.params: Dict[str, torch.nn.Parameter] = {}
        for k, v in sd.items():
            v = v.float()
            if k in (_embedding_key(sd), _head_key(sd)) and v.shape[0] < padded_vocab:
                v = torch.cat([v, v.new_zeros(padded_vocab - v.shape[0], v.shape[1])])
            self.params[k] = torch.nn.Parameter(v.clone())

    def loss(self, b: dict) -> torch.Tensor:
        """Mean over the loss-masked tokens of the rows (one micro-batch), like the preflight's Megatron loss."""
        total = torch.zeros(())
        for r in range(b["tokens"].shape[0]):
            mask = b["loss_mask"][r]
            if float(mask.sum()) == 0:
                continue
            logits = hf_forward(
                self.params, self.spec, b["tokens"][r], b["position_ids"][r], b["segments"][r]
            )
            ce = F.cross_entropy(logits.float(), b["labels"][r], reduction="none")
            total = total + (ce * mask).sum()
        return total / b["loss_mask"].sum().clamp(min=1)

    def unpadded(self) -> Dict[str, torch.Tensor]:
        """The parameters with the padded vocabulary rows dropped (what the way back to HF writes)."""
        return {
            k: (
                v.detach()[: self.vocab]
                if v.shape[0] > self.vocab
                and v.dim() == 2
                and k in (_embedding_key(self.params), _head_key(self.params))
                else v.detach()
            )
            for k, v in self.params.items()
        }


def lr_at(step: int, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """The kit trainer's schedule (kit.train.engine.lr_lambda) for `steps` iterations, as an absolute rate."""
    from types import SimpleNamespace

    from kit.train.engine import lr_lambda

    return lr * lr_lambda(SimpleNamespace(lr=lr, min_lr=min_lr, warmup_iters=warmup, train_iters=steps))(step)


def train(ref: Reference, batches: dict, job: dict) -> dict:
    """The run the ranks make: same global batches, micro-batch means averaged, clip, AdamW (no decay on 1-D)."""
    decay = [p for p in ref.params.values() if p.dim() > 1]
    flat = [p for p in ref.params.values() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": job["weight_decay"]}, {"params": flat, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(
        groups, lr=job["lr"], betas=(job["adam_beta1"], job["adam_beta2"]), eps=job["adam_eps"]
    )
    per_step = job["dp"] * job["micro_batches"]
    mbs = job["mbs"]
    losses: List[float] = []
    norms: List[float] = []
    lrs: List[float] = []
    aux_steps: List[
        List[float]
    ] = []  # MoE: per step, per layer, megatron-core's aux loss (mean of micro-batches)
    hf_aux_steps: List[float] = []  # MoE: per step, transformers' own aux loss (mean of micro-batches)
    params = list(ref.params.values())
    moe = hasattr(ref, "terms")
    for step in range(job["steps"]):
        rate = lr_at(step, job["lr"], job["min_lr"], job["warmup_iters"], job["steps"])
        for g in opt.param_groups:
            g["lr"] = rate
        opt.zero_grad()
        total = 0.0
        aux_sum: List[float] = []
        hf_aux = 0.0
        for i in range(per_step):
            first = (step * per_step + i) * mbs
            b = {k: v[first : first + mbs] for k, v in batches.items()}
            if (
                moe
            ):  # the objective megatron-core differentiates: LM loss + coefficient x each layer's aux loss
                t = ref.terms(b)
                loss = t["lm"] / per_step
                (loss + ref.aux_coef * torch.stack(t["aux"]).sum() / per_step).backward()
                aux_sum = [a + float(x.detach()) for a, x in zip(aux_sum or [0.0] * len(t["aux"]), t["aux"])]
                hf_aux += t["hf_aux"]
            else:
                loss = ref.loss(b) / per_step
                loss.backward()
            total += float(loss.detach())
        if moe:
            aux_steps.append([a / per_step for a in aux_sum])
            hf_aux_steps.append(hf_aux / per_step)
        # the norm in float64: torch's fp32 CPU norm of a large tensor is off by ~1e-5 relative, the size of the
        # tolerance; clipped as megatron-core's clip_grad_norm_fp32 does (coefficient max / (norm + 1e-6))
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))
        coeff = job["clip_grad"] / (norm + 1e-6)
        if coeff < 1.0:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coeff)
        opt.step()
        losses.append(total)
        norms.append(norm)
        lrs.append(rate)
        if not math.isfinite(total):
            break
    out = {"losses": losses, "grad_norms": norms, "lrs": lrs}
    if moe:
        out.update(aux_losses=aux_steps, hf_aux_losses=hf_aux_steps)
    return out
