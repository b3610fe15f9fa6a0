"""The results table of an evaluation: metric x model, the changes between the models, and `invalid` where a score
came from NaN / inf (such a score is never reported as a number)."""

from __future__ import annotations

import math
from typing import Any, Dict, List

INVALID = "invalid"  # a table cell whose score was computed from NaN / inf


def results_table(results: Dict[str, Any], labels: List[str]):
    """metric x model, plus `change` (trained - base) for two models, `sft - base` and `dpo - sft` for three."""
    import pandas as pd

    metrics: List[str] = []
    for label in labels:
        for key in results["models"][label]:
            if key not in metrics:
                metrics.append(key)
    table = pd.DataFrame(
        {label: [results["models"][label].get(m) for m in metrics] for label in labels}, index=metrics
    )
    table.index.name = "metric"
    changes = {}  # column -> (later model, earlier model)
    if len(labels) == 2:
        changes["change"] = (labels[1], labels[0])
    elif len(labels) == 3:
        changes.update({f"{b} - {a}": (b, a) for a, b in zip(labels, labels[1:])})
    for column, (later, earlier) in changes.items():
        table[column] = table[later] - table[earlier]
    invalid = results.get("invalid") or {}
    if invalid:
        table = table.astype(object)
        for label, metrics in invalid.items():
            for m in metrics:
                table.loc[m, label] = INVALID
                for column, pair in changes.items():
                    if label in pair:
                        table.loc[m, column] = INVALID
    return table


def invalid_scores(scores: Dict[str, Any], tasks: Dict[str, Any], label: str) -> List[str]:
    """The metrics of `scores` computed from NaN / inf (set to None there): a non-finite value, or an accuracy
    whose log-likelihoods are not all finite (an argmax over NaN still picks a choice, a plausible accuracy)."""
    bad = []
    for name, task in tasks.items():
        found = task["models"].get(label) or {}
        lls = found.get("logliks") or [d["logliks"] for d in found.get("details") or []]
        if any(not math.isfinite(v) for q in lls for v in q):
            for key in (f"{name}_acc", f"{name}_acc_norm"):
                if key in scores:
                    bad.append(key)
            found["acc"] = found["acc_norm"] = None
    no_tokens = scores.get("heldout_tokens") == 0  # nothing scored: a blank, not a broken model
    for key, value in scores.items():
        if isinstance(value, float) and not math.isfinite(value) and key not in bad:
            if not (no_tokens and key.startswith("heldout_")):
                bad.append(key)
    for key in bad:
        scores[key] = None
    if "heldout_loss" in bad and "heldout_perplexity" in scores and "heldout_perplexity" not in bad:
        bad.append("heldout_perplexity")
        scores["heldout_perplexity"] = None
    return bad
