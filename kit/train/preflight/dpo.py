"""The preflight on preference pairs (RUN_TYPE=dpo): MindSpeed-LLM's pairwise files through megatron-core's
IndexedDataset, the sigmoid DPO loss on the ranks' GPTModel, the kit's own DPO step (kit.train.dpo) on the HF side.

Both sides take the reference log-probabilities from the starting weights before the first step (the kit's
`precompute`; MindSpeed-LLM's frozen `--ref-model` computes the same numbers), so the first loss is log 2 on both
sides whatever the weights: what can fail at step 0 is the per-sequence log-probabilities (the "log-probs vs HF"
row), the grad norm, and after the first step the losses and the parameters.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

IGNORE = -100


def read_pairs(job: dict) -> dict:
    """Every pair the run consumes as [n, 2, s] tensors (chosen, rejected): tokens, labels (-100 on the prompt and
    the padding, not shifted), attention_mask (1 on real tokens), position_ids; right-padded to seq_len."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from kit.data.prepared import PAIR_MEGATRON_KEYS

    data, n, s = job["data"], job["samples"], job["seq_len"]
    files = {k: IndexedDataset(f"{data['prefix']}_packed_{k}_document") for k in PAIR_MEGATRON_KEYS}
    rows = len(files["chosen_input_ids"])
    out = {
        "tokens": torch.full((n, 2, s), data["pad"], dtype=torch.long),
        "labels": torch.full((n, 2, s), IGNORE, dtype=torch.long),
        "attention_mask": torch.zeros((n, 2, s), dtype=torch.long),
        "position_ids": torch.zeros((n, 2, s), dtype=torch.long),
    }
    for j in range(n):
        for side, name in enumerate(("chosen", "rejected")):
            ids = files[f"{name}_input_ids"][j % rows].astype(np.int64)
            lab = files[f"{name}_labels"][j % rows].astype(np.int64)
            if ids.size > s:
                raise ValueError(f"pair {j % rows} has {ids.size} tokens > seq_len {s}")
            out["tokens"][j, side, : ids.size] = torch.from_numpy(ids)
            out["labels"][j, side, : ids.size] = torch.from_numpy(lab)
            out["attention_mask"][j, side, : ids.size] = 1
            out["position_ids"][j, side, : ids.size] = torch.arange(ids.size)
    return out


def as_rows(x: Any) -> Any:
    """[b, 2, ...] pairs as [2b, ...] rows: the b chosen, then the b rejected (the kit's and TRL's layout)."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def megatron_step(mdl: Any, b: Dict[str, Any], job: dict):
    """(per-sequence log-probs, their token counts, and a loss function) of one micro-batch on the ranks' GPTModel:
    its per-token cross-entropy (labels = the next token), summed over the answer tokens."""
    import torch

    from kit.train.dpo import dpo_loss
    from kit.train.preflight.batches import megatron_mask

    tokens, labels = as_rows(b["tokens"]), as_rows(b["labels"])
    nxt = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], 1)
    mask = nxt != IGNORE
    # causal among the real tokens; the padding (segment 0) sees only padding and carries no loss
    output = mdl(
        tokens,
        as_rows(b["position_ids"]),
        megatron_mask(as_rows(b["attention_mask"])),
        labels=nxt.clamp(min=0),
    )

    def loss_func(per_token):
        logps = -(per_token.float() * mask).sum(-1)
        ref = b.get("ref")
        if ref is None:  # the reference pass: log-probs only
            return logps.sum() * 0.0, {"logps": logps.detach().clone()}
        d = job["dpo"]
        loss, _ = dpo_loss(logps, mask.sum(-1), ref, d["beta"], d["label_smoothing"])
        return loss, {"lm loss": loss.detach().clone(), "logps": logps.detach().clone()}

    return output, loss_func


class DpoReference:
    """The HF side of a DPO preflight: the kit's DPO step (kit.train.dpo's sequence_logps and dpo_loss) on
    transformers' own model, with the reference log-probabilities of the starting weights in the batch (`ref`)."""

    def __init__(self, ref: Any, job: dict):
        self.ref, self.job = ref, job
        self.params, self.vocab = ref.params, ref.vocab
        self.note = ref.note + "; the loss is the kit's DPO step (kit.train.dpo) on the same pairs"
        self.bias_update = getattr(ref, "bias_update", None)  # routers with a score-correction bias

    def unpadded(self):
        return self.ref.unpadded()

    def trained(self, folder):
        return self.ref.trained(folder)

    def expert_biases(self):
        return self.ref.expert_biases()

    def logps(self, b: Dict[str, Any]):
        from kit.train.dpo import sequence_logps

        batch = {k: as_rows(b[k]) for k in ("attention_mask", "labels", "position_ids")}
        batch["input_ids"] = as_rows(b["tokens"])
        return sequence_logps(self.ref.model, batch)

    def terms(self, b: Dict[str, Any]) -> dict:
        from kit.train.dpo import dpo_loss

        logps, counts = self.logps(b)
        d = self.job["dpo"]
        loss, _ = dpo_loss(logps, counts, as_rows(b["ref"]), d["beta"], d["label_smoothing"])
        return {"lm": loss}

    def reference_logps(self, batches: Dict[str, Any]) -> Any:
        """[n, 2] log-probs of every pair with the starting weights (the kit's precompute), into batches['ref']."""
        import torch

        out = []
        with torch.no_grad():
            for i in range(0, batches["tokens"].shape[0], self.job["mbs"]):
                sums = self.logps({k: v[i : i + self.job["mbs"]] for k, v in batches.items()})[0]
                out.append(torch.stack(sums.chunk(2), 1))
        batches["ref"] = torch.cat(out).float()
        return batches["ref"]


def logps_check(results: List[dict], hf_logps: Any, rtol: float) -> dict:
    """The row that can fail at step 0: every pair's chosen and rejected log-probability, megatron vs HF."""
    mg = {int(i): (c, r) for res in results for i, c, r in res.get("pair_logps", [])}
    worst, where = 0.0, ""
    for i, (c, r) in sorted(mg.items()):
        for side, a, b in (("chosen", c, float(hf_logps[i, 0])), ("rejected", r, float(hf_logps[i, 1]))):
            rel = abs(a - b) / max(abs(b), 1e-12)
            if rel >= worst:
                worst, where = rel, f"pair {i} {side}: megatron {a:.6f}, HF {b:.6f}"
    complete = len(mg) == int(hf_logps.shape[0])
    detail = (
        f"{len(mg)} pairs x (chosen, rejected), sums over the answer tokens; worst {where} (relative {worst:.1e})"
        if complete
        else f"the ranks reported {len(mg)} of {int(hf_logps.shape[0])} pairs"
    )
    return {
        "check": "log-probs vs HF",
        "passed": complete and worst <= rtol,
        "value": worst,
        "limit": rtol,
        "detail": detail,
    }
