"""Preference accuracy on held-out pairs: does the model give the chosen answer more probability than the rejected one?

A pair is scored the way DPO's loss scores it (kit.train.dpo's `pair_batch` and `sequence_logps`, the same code): the
summed log-probability of each answer's tokens after the shared prompt, rendered through the data's chat template.
  accuracy = the share of pairs with log p(chosen) > log p(rejected) (a tie is no preference)
  margin   = the mean over the pairs of log p(chosen) - log p(rejected), in nats
Against the model a DPO run started from (its reference), DPO's implicit reward r(x, y) = β (log π(y|x) - log π_ref(y|x))
gives the reward margin = the mean of r(chosen) - r(rejected) = β (margin of π - margin of π_ref, pair by pair) and the
reward accuracy = the share of pairs with r(chosen) > r(rejected): what TRL logs as rewards/margins and
rewards/accuracies while training, here on pairs the training never saw.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kit.errors import InputError

COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass
class PairScores:
    """Each pair's summed answer log-probabilities (nats) under one model."""

    chosen: List[float] = field(default_factory=list)
    rejected: List[float] = field(default_factory=list)

    @property
    def pairs(self) -> int:
        return len(self.chosen)

    def _finite(self) -> bool:
        return all(math.isfinite(v) for v in self.chosen + self.rejected)

    @property
    def accuracy(self) -> float:
        """Share of pairs with log p(chosen) > log p(rejected); NaN when a log-probability is not finite (a NaN
        compared is False, which would read as a plausible accuracy)."""
        if not self.pairs or not self._finite():
            return float("nan")
        return sum(c > r for c, r in zip(self.chosen, self.rejected)) / self.pairs

    @property
    def margin(self) -> float:
        """Mean of log p(chosen) - log p(rejected), nats."""
        if not self.pairs:
            return float("nan")
        return sum(c - r for c, r in zip(self.chosen, self.rejected)) / self.pairs

    def rewards(self, reference: PairScores, beta: float) -> Dict[str, float]:
        """DPO's implicit reward margin and accuracy of this model (the policy) against `reference`."""
        if reference.pairs != self.pairs or not self.pairs:
            raise ValueError("policy and reference scores cover different pairs")
        gaps = [
            beta * ((c - rc) - (r - rr))
            for c, r, rc, rr in zip(self.chosen, self.rejected, reference.chosen, reference.rejected)
        ]
        ok = self._finite() and reference._finite()
        return {
            "reward_margin": sum(gaps) / len(gaps),
            "reward_accuracy": sum(g > 0 for g in gaps) / len(gaps) if ok else float("nan"),
        }

    def as_dict(self) -> Dict[str, Any]:
        return {"chosen_logps": list(self.chosen), "rejected_logps": list(self.rejected)}


def load_pairs(heldout: Dict[str, Any], limit: int = 0) -> Any:
    """The held-out pairs of a prepared pair folder's manifest entry `heldout` (at most `limit`, 0: all)."""
    from kit.evaluate.inputs import load_split

    fix = "not preference pairs; prepare them with notebook 02 (kind dpo)."
    return load_split(heldout["path"], COLUMNS, limit, fix)


def score_pairs(model: Any, rows: Any, pad_id: int = 0, batch_tokens: Optional[int] = None) -> PairScores:
    """Every pair's summed chosen / rejected answer log-probabilities under `model` (no gradients, float32 sums).

    Pairs of similar length are batched up to `batch_tokens` tokens (both answers of a pair count; by default
    kit.evaluate.scoring's figure for the device), laid out and scored by kit.train.dpo exactly as a DPO step does."""
    import torch

    from kit.evaluate.scoring import batch_tokens_for
    from kit.train.dpo import pair_batch, sequence_logps

    device = next(model.parameters()).device
    budget = batch_tokens or batch_tokens_for(device)
    plain = rows.with_format(None) if hasattr(rows, "with_format") else rows
    pairs = [{c: list(row[c]) for c in COLUMNS} for row in plain]
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    top = max((max(p[c]) for p in pairs for c in COLUMNS if p[c]), default=-1)
    if vocab and top >= vocab:
        raise InputError(
            f"the pairs hold token id {top}, beyond the model's vocabulary of {vocab}: they were prepared with another "
            f"tokenizer; give the pairs prepared for this model (PAIRS) or its DPO run."
        )
    width = [len(p["prompt_ids"]) + max(len(p["chosen_ids"]), len(p["rejected_ids"])) for p in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -width[i])  # similar lengths together: little padding
    out = PairScores([0.0] * len(pairs), [0.0] * len(pairs))
    with torch.no_grad():
        at = 0
        while at < len(order):
            n = max(1, budget // max(2 * width[order[at]], 1))
            idx = order[at : at + n]
            at += n
            batch = pair_batch({c: [pairs[i][c] for i in idx] for c in COLUMNS}, pad_id)
            sums, _ = sequence_logps(model, {k: v.to(device) for k, v in batch.items()})
            chosen, rejected = sums.float().cpu().chunk(2)
            for k, i in enumerate(idx):
                out.chosen[i], out.rejected[i] = float(chosen[k]), float(rejected[k])
    return out


SIDE_BY_SIDE = (
    "preference_pairs",
    "preference_accuracy",
    "preference_margin",
    "reward_margin",
    "reward_accuracy",
)


def side_by_side(results: Dict[str, Any], table: Any) -> Any:
    """One row per model: the preference metrics next to held-out loss and multiple-choice accuracy (the cells of
    the results table, `invalid` ones included); None when no pairs were scored."""
    if not results.get("preference"):
        return None
    labels = list(results["models"])
    extra = [m for m in table.index if m == "heldout_loss" or m.endswith("_acc")]
    rows = [m for m in SIDE_BY_SIDE if m in table.index] + extra
    out = table.loc[rows, labels].T
    out.index.name = "model"
    return out


def _pct(x: Any) -> str:
    return f"{x:.0%}" if isinstance(x, float) and math.isfinite(x) else "invalid"


def _nats(x: Any) -> str:
    return f"{x:+.3f}" if isinstance(x, float) and math.isfinite(x) else "invalid"


def note(results: Dict[str, Any]) -> str:
    """The preference result in one sentence (see the module doc for the definitions), or why there is none."""
    pref = results.get("preference")
    if not pref:
        skipped = [n for n in results.get("notes") or [] if n.startswith("preference accuracy skipped")]
        return (
            skipped[0] if skipped else "Preference accuracy was not measured ('preference' is not in PARTS)."
        )
    scores = {label: results["models"][label] for label in pref["models"]}
    n = pref["pairs"]
    acc = ", ".join(f"{label} {_pct(s.get('preference_accuracy'))}" for label, s in scores.items())
    margin = ", ".join(f"{label} {_nats(s.get('preference_margin'))}" for label, s in scores.items())
    text = (
        f"On {n} held-out pair{'s' if n != 1 else ''} the chosen answer gets the higher log-probability under {acc}; "
        f"mean log p(chosen) - log p(rejected): {margin} nats"
    )
    policy = scores.get(pref.get("policy") or "") or {}
    if "reward_margin" in policy:
        text += (
            f"; DPO's implicit reward margin of {pref['policy']} against {pref['reference']} (beta {pref['beta']:g}): "
            f"{_nats(policy['reward_margin'])}, reward accuracy {_pct(policy.get('reward_accuracy'))}"
        )
    return text + "."
