"""Charts people would rather see than read: top operators, step time breakdown; each also saved as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import pandas as pd

PathLike = Union[str, Path]
CORE_COLORS = {
    "AI_CORE": "#1f77b4",
    "MIX_AIC": "#17becf",
    "AI_VECTOR_CORE": "#2ca02c",
    "MIX_AIV": "#98df8a",
    "AI_CPU": "#d62728",
    "CPU": "#7f7f7f",
    "GPU": "#9467bd",
}


def _save(fig, path: Optional[PathLike]) -> None:
    if path is not None:
        from kit.errors import writing
        from kit.storage.atomic import atomic_file

        with writing(path), atomic_file(path, "wb") as fh:  # a failed write inside savefig names no file
            fig.savefig(fh, format="png", dpi=110, bbox_inches="tight")


def plot_top_operators(table: pd.DataFrame, top: int = 10, path: Optional[PathLike] = None, title: str = ""):
    """Horizontal bars of total time per operator (colour = core), share in the label; saved to `path` if given."""
    import matplotlib.pyplot as plt

    t = table.sort_values("total_us", ascending=False).head(top).iloc[::-1]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(t) + 1.2))
    colors = [CORE_COLORS.get(c, "#bcbd22") for c in t["core"]]
    ax.barh([f"{ty} ({c})" for ty, c in zip(t["type"], t["core"])], t["total_us"] / 1000.0, color=colors)
    for y, (ms, share) in enumerate(zip(t["total_us"] / 1000.0, t["share_pct"])):
        ax.text(ms, y, f" {share:.1f}%", va="center", fontsize=8)
    ax.set_xlabel("total time (ms)")
    ax.set_title(title or f"Top {len(t)} operators by total time")
    ax.margins(x=0.15)
    _save(fig, path)
    return fig


def plot_step_breakdown(steps: pd.DataFrame, path: Optional[PathLike] = None, title: str = "Step time"):
    """Stacked bars per step: computing / communication / free (or the step total for torch traces)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    parts = [c for c in ("computing_us", "communication_us", "free_us") if c in steps.columns]
    bottom = pd.Series(0.0, index=steps.index)
    for c in parts or ["total_us"]:
        ax.bar(steps["step"].astype(str), steps[c] / 1000.0, bottom=bottom, label=c.replace("_us", ""))
        bottom = bottom + steps[c] / 1000.0
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=8)
    _save(fig, path)
    return fig
