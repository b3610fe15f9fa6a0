"""Two captures side by side (before/after a change, two commits): per-operator deltas and step time change."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import pandas as pd

from kit.profiling.loader import load
from kit.profiling.profile_data import ProfileData
from kit.profiling.tables import mean_step_us, operator_table


@dataclass
class Comparison:
    """Per-operator deltas (b minus a) and the step time change, with both profiles' commits."""

    operators: pd.DataFrame
    step_us: dict  # {"a": mean us, "b": mean us, "change_pct": (b-a)/a*100}
    labels: tuple = ("a", "b")
    commits: dict = field(default_factory=dict)

    def summary(self, top: int = 5) -> str:
        """A few lines: step time change and the operators that moved most."""
        a, b = self.labels
        s = self.step_us
        lines = [
            f"mean step: {a} {s['a']:.1f} us -> {b} {s['b']:.1f} us ({s['change_pct']:+.1f}%)"
            if s["a"] == s["a"] and s["b"] == s["b"]
            else "mean step: not available in both captures"
        ]
        if any(self.commits.values()):
            lines.append(f"commits: {a} {self.commits.get(a)} / {b} {self.commits.get(b)}")
        for r in self.operators.head(top).itertuples():
            lines.append(
                f"{r.type}: {r.total_us_a:.1f} -> {r.total_us_b:.1f} us ({r.delta_us:+.1f} us), "
                f"calls {r.calls_a} -> {r.calls_b}"
            )
        return "\n".join(lines)


def _as_data(x: Union[ProfileData, str]) -> ProfileData:
    return x if isinstance(x, ProfileData) else load(x)


def compare(a, b, labels: tuple = ("before", "after")) -> Comparison:
    """Compare two profiles (ProfileData or paths) by operator type; rows sorted by |delta| descending."""
    da, db = _as_data(a), _as_data(b)
    ta, tb = (
        operator_table(d, by="type")
        .groupby("type", as_index=False)
        .agg(calls=("calls", "sum"), total_us=("total_us", "sum"), share_pct=("share_pct", "sum"))
        for d in (da, db)
    )
    m = ta.merge(tb, on="type", how="outer", suffixes=("_a", "_b"))
    for c in ("calls_a", "calls_b"):
        m[c] = m[c].fillna(0).astype("int64")
    for c in ("total_us_a", "total_us_b", "share_pct_a", "share_pct_b"):
        m[c] = m[c].fillna(0.0)
    m["delta_us"] = m["total_us_b"] - m["total_us_a"]
    m["delta_pct"] = 100.0 * m["delta_us"] / m["total_us_a"].where(m["total_us_a"] > 0)
    m = m.reindex(m["delta_us"].abs().sort_values(ascending=False).index).reset_index(drop=True)
    sa, sb = mean_step_us(da), mean_step_us(db)
    change = 100.0 * (sb - sa) / sa if sa and sa == sa and sb == sb else float("nan")
    commits = {lab: (d.meta.get("capture") or {}).get("git_commit") for lab, d in zip(labels, (da, db))}
    return Comparison(
        operators=m, step_us={"a": sa, "b": sb, "change_pct": change}, labels=tuple(labels), commits=commits
    )
