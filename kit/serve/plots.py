"""The load test's figure: latency percentiles and output throughput against concurrency and against request rate.

One column per kind of load the test ran (closed-loop concurrency, open-loop Poisson rate), one row per figure (TTFT,
end-to-end latency, output throughput); x is the load itself (its ticks: zero and the points measured), both axes start at
zero so that a few milliseconds between points are not drawn as a cliff, and every point carries its value. Drawn
without pyplot (nothing is shown or left open in a notebook); `plot_load` saves it as the load test's PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Union

# (column prefix of kit.serve.loadtest's point, legend name, line style, colour, label offset in points)
PERCENTILES = (
    ("median", "p50", "o-", "#08519c", (4, -10)),
    ("p90", "p90", "s--", "#6baed6", (4, 2)),
    ("p99", "p99", "^:", "#e6550d", (4, 8)),
)
# (load kind, the point's key for x, x label)
LOADS = (
    ("concurrency", "max_concurrency", "requests in flight (closed loop)"),
    ("poisson", "request_rate", "request rate (req/s, Poisson arrivals)"),
)
# (metric, y label): latencies in ms with their percentiles, then the output throughput
ROWS = (
    ("ttft", "TTFT (ms)"),
    ("e2el", "end-to-end latency (ms)"),
    ("output_throughput", "output throughput (tokens/s)"),
)


def _value(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 else f"{v:.1f}"


def _series(points: Sequence[Dict[str, Any]], load: str, key: str, grid: tuple) -> List[Dict[str, Any]]:
    """The valid points of one load kind and one (input, output) length pair, by increasing load."""
    chosen = [
        p
        for p in points
        if p["load"] == load and (p["input_len"], p["output_len"]) == grid and p.get("valid", True)
    ]
    return sorted(chosen, key=lambda p: p[key])


def load_figure(points: Sequence[Dict[str, Any]], title: str = ""):
    """The figure of a load test's points (kit.serve.loadtest's rows: `load`, `max_concurrency`, `request_rate`,
    `input_len`, `output_len`, `{median,p90,p99}_{ttft,e2el}_ms`, `output_throughput`, `valid`)."""
    from matplotlib.figure import Figure

    loads = [spec for spec in LOADS if any(p["load"] == spec[0] for p in points)]
    if not loads:
        raise ValueError("no load point to plot")
    grids = sorted({(p["input_len"], p["output_len"]) for p in points})
    fig = Figure(figsize=(5.4 * len(loads), 3.0 * len(ROWS)))
    axes = fig.subplots(len(ROWS), len(loads), squeeze=False)
    markers = ("o", "s", "^", "D", "v")
    for col, (load, key, xlabel) in enumerate(loads):
        for row, (metric, ylabel) in enumerate(ROWS):
            ax = axes[row][col]
            said = set()  # (x, value text): equal percentiles of a point are labelled once
            for g, grid in enumerate(grids):
                pts = _series(points, load, key, grid)
                x = [p[key] for p in pts]
                suffix = f", {grid[0]} in / {grid[1]} out" if len(grids) > 1 else ""
                if metric == "output_throughput":
                    lines = [
                        ("output_throughput", "output tokens/s", f"{markers[g % 5]}-", "#31a354", (4, 4))
                    ]
                else:
                    lines = [
                        (f"{s}_{metric}_ms", name, style, c, off) for s, name, style, c, off in PERCENTILES
                    ]
                for column, name, style, color, offset in lines:
                    y = [p[column] for p in pts]
                    ax.plot(x, y, style, color=color, label=name + suffix, alpha=1.0 if g == 0 else 0.6)
                    for xi, yi in zip(x, y):
                        if (xi, _value(yi)) in said:
                            continue
                        said.add((xi, _value(yi)))
                        ax.annotate(
                            _value(yi), (xi, yi), textcoords="offset points", xytext=offset, fontsize=7
                        )
            ticks = [0] + sorted({p[key] for p in points if p["load"] == load})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_xlim(0, max(ticks) * 1.15)
            ax.set_ylim(bottom=0)
            ax.set(xlabel=xlabel, ylabel=ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_load(points: Sequence[Dict[str, Any]], png: Union[str, Path], title: str = "") -> Path:
    """`load_figure(points, title)` saved as `png`; returns the path."""
    from kit.errors import writing

    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    with writing(png):
        load_figure(points, title).savefig(png, dpi=100)
    return png
